"""The MoE feed-forward on 3D tensor-parallel grids (:mod:`tetrad.parallel.moe_tensor`) and the
expert axis folded over Z, Y and X, against the single-process reference: Y and X alone, with
data parallelism, Z, context, expert parallelism and a pipeline. Each tensor rank routes its
own slice of the tokens (whole: the block's input exchanged over X); the expert axis takes the
stage's ranks X first, then Y, Z, context and data (:data:`tetrad.spec.grid.EXPERT_GRID_AXES`),
so ``z=2,expert=2`` splits the experts over Z, ``y=2,x=2,expert=4`` over both tensor axes and
``data=2,z=2,expert=4`` over Z and data: no rank of an expert group holds another's experts. As
tests/test_moe_expert_parallel.py: both configurations (a softmax router with a shared expert,
a dense block and q/k norms, whose weights are summed over Y; a sigmoid router with a selection
bias), float64, a few AdamW steps with accumulation and clipping; LM and load-balancing losses
to 1e-5 relative, the gradient norm to 1e-4, every weight to 0.05 lr.
"""

import pytest

from tests.distributed import run_distributed
from tests.test_moe_expert_parallel import ep_run, float64_run, pipeline_run
from tests.test_moe_parallel import CONFIGS
from tests.test_train import corpus  # noqa: F401  (a fixture)

# (DATA, CONTEXT, Z, Y, X), G_expert[, activation checkpointing]
# (the expert axis: over the innermost ranks of the stage, X first)
TWO_RANKS = [
    ((1, 1, 1, 2, 1), 1),
    ((1, 1, 1, 1, 2), 1, "full"),
    ((1, 1, 2, 1, 1), 2),  # Z
    ((1, 1, 1, 1, 2), 2),  # X
]
FOUR_RANKS = [
    ((2, 1, 1, 2, 1), 2),  # Y
    ((2, 1, 1, 1, 2), 2),  # X
    ((1, 1, 2, 2, 1), 1),
    ((1, 1, 1, 2, 2), 1),
    ((1, 2, 1, 1, 2), 2),  # X
    ((1, 1, 1, 2, 2), 4),  # Y and X
    ((2, 1, 2, 1, 1), 4),  # Z and data
]
EIGHT_RANKS = [((2, 1, 2, 2, 1), 4)]  # Y and Z


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tensor_grids_match_reference(name):
    curves, state = float64_run(CONFIGS[name])
    run_distributed(ep_run, 2, name, curves, state, TWO_RANKS)
    run_distributed(ep_run, 4, name, curves, state, FOUR_RANKS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_eight_ranks_and_pipeline_match_reference(name):
    """``data=2 z=2 y=2`` with expert parallelism 4 over Y and Z (8 ranks), and ``pipe=2`` with
    ``y=2`` (its experts split over Y) or ``x=2`` (the load-balancing terms differentiated on
    their own stage)."""
    curves, state = float64_run(CONFIGS[name])
    run_distributed(ep_run, 8, name, curves, state, EIGHT_RANKS)
    grids = [(2, (1, 1, 1, 2, 1), 2), (2, (1, 1, 1, 1, 2), 1)]
    run_distributed(pipeline_run, 4, name, curves, state, grids)


def _train(cfg):
    from tetrad.train import trainer

    trainer.train(cfg)


def test_train_and_resume_across_tensor_grids(corpus, tmp_path, monkeypatch):  # noqa: F811
    """``tetrad train`` of the MoE model on ``y=2`` with its experts split over Y
    (``expert=2``), resumed from its step-2 checkpoint on ``x=2`` with the experts whole, gives
    the uninterrupted ``y=2`` run's losses (1e-5) and routing figures per block (loads exact,
    balance terms to 1e-5)."""
    from tests.test_train import config, losses

    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    whole, split = tmp_path / "whole", tmp_path / "split"
    model = "moe-tiny,vocab_size=0,router_score=sigmoid,bias_update_rate=0.01"
    opts = dict(model=model, checkpoint_every=2, lr=3e-3, min_lr=3e-3)
    run_distributed(_train, 2, config(corpus, whole, 4, grid="1,1,2,1", **opts))
    rows, expected = losses(whole)
    run_distributed(_train, 2, config(corpus, split, 2, grid="y=2,expert=2", **opts))
    run_distributed(_train, 2, config(corpus, split, 4, resume=True, grid="1,1,1,2", **opts))
    got_rows, got = losses(split)
    assert len(got) == len(expected) == 4
    for g, e in zip(got, expected, strict=True):
        assert abs(g - e) <= 1e-5 * abs(e), (got, expected)
    for g, e in zip(got_rows, rows, strict=True):  # the routing: y=2, then x=2 from step 3
        assert g["moe_max_load"] == e["moe_max_load"], (g["step"], g["moe_max_load"])
        assert g["moe_expert_load"] == e["moe_expert_load"], g["step"]
        assert g["moe_balance"] == pytest.approx(e["moe_balance"], rel=1e-5), g["step"]


def check_expert_bytes(grids):
    """Per rank, for each grid: the routed experts' parameter bytes of the MoE model for
    ``G_expert`` 1, 2 and 4 fall as ``1/G_expert`` and equal the planner's states
    (:func:`local_parameter_elements`, fp32 weights)."""
    import torch

    from tetrad.grid import Grid
    from tetrad.parallel.model import ParallelLlama
    from tetrad.plan.memory.states import local_parameter_elements

    cfg = CONFIGS["sigmoid-bias"]
    for sizes in grids:
        whole = None
        for ep in (1, 2, 4):
            grid = Grid.build(sizes, expert=ep)
            with torch.device("meta"):
                model = ParallelLlama(cfg, grid)
            got = sum(
                p.numel() * p.element_size()
                for name, p in model.named_parameters()
                if ".experts." in name
            )
            whole = whole or got
            assert got * ep == whole, (sizes, ep, got, whole)
            planned = local_parameter_elements(cfg, sizes, ep)["experts"]  # 0: not split
            assert got == 4 * (planned or cfg.moe_layers * cfg.expert_params()), (sizes, ep)


def test_expert_bytes_fall_as_one_over_the_expert_axis_on_tensor_ranks():
    """On ``y=2,x=2`` and ``z=2,y=2`` the routed experts' bytes per rank are ``1/G_expert`` of
    the whole when the expert axis spans the tensor (and Z) ranks, and equal the planner's."""
    run_distributed(check_expert_bytes, 4, [(1, 1, 1, 2, 2), (1, 1, 2, 2, 1)])
