"""Expert parallelism (:mod:`tetrad.parallel.experts`) against the single-process reference.

Each grid folds an expert axis of 2 or 4 over its data x context ranks (composed with Z,
context, a pipeline, full activation checkpointing): a few AdamW steps (gradient accumulation,
clipping, warm-up) on the same global batches must give the reference's LM loss and
load-balancing loss to 1e-5 relative, its gradient norm to 1e-4, and its updated weights to
0.05 lr, the dense grids' tolerance. Both runs are in float64 (:func:`float64_run`): in float32
the first Adam steps turn rounding on near-zero gradients into near-full steps, and the softmax
configuration's attention ``wqkv`` ended 0.051 lr off on data=4 with expert parallelism (0.043
without it); in float64 the worst weight is 0.0013 lr off. Both
configurations of tests/test_moe_parallel.py: a softmax router with a shared expert, a dense
block and q/k norms; a sigmoid router with a selection bias. Also: resuming across expert
parallel sizes, and the options' one-line refusals.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_moe_parallel import (
    CLIP,
    CONFIGS,
    LR,
    MICRO,
    PRESET_CONFIGS,
    SEED,
    batches,
    check_routing,
    reference_run,
    set_lr,
    train_checked,
)
from tests.test_train import corpus  # noqa: F401  (a fixture)
from tetrad.grid import Grid
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.spec.grid import Axis, GridError
from tetrad.train.step import build_optimizer, train_step_losses

MODEL = "moe-tiny,vocab_size=0,router_score=sigmoid,bias_update_rate=0.01"
# (DATA, CONTEXT, Z, Y, X), G_expert[, activation checkpointing]
TWO_RANKS = [((2, 1, 1, 1, 1), 2), ((1, 2, 1, 1, 1), 2), ((2, 1, 1, 1, 1), 2, "full")]
FOUR_RANKS = [
    ((4, 1, 1, 1, 1), 4),
    ((4, 1, 1, 1, 1), 2),
    ((2, 1, 2, 1, 1), 2),
    ((2, 2, 1, 1, 1), 4),
    ((1, 2, 2, 1, 1), 2),
]


def float64_run(cfg):
    """The reference run of tests/test_moe_parallel.py with float64 parameters and activations."""
    torch.set_default_dtype(torch.float64)
    try:
        return reference_run(cfg)
    finally:
        torch.set_default_dtype(torch.float32)


def ep_run(name, curves, ref_state, grids):
    """Train each ``(sizes, G_expert[, recompute])`` grid (also tests/test_moe_tensor.py's)
    and compare losses, norm and weights with the float64 reference."""
    torch.set_default_dtype(torch.float64)  # as float64_run (this rank's process only)
    cfg = CONFIGS[name]
    for sizes, ep, *recompute in grids:  # recompute: activation checkpointing, full
        grid = Grid.build(sizes, expert=ep)
        model = ParallelLlama(
            cfg,
            grid,
            activation_checkpointing=recompute[0] if recompute else "none",
            overlaps=("dp_all_reduce", "reduce_scatter", "expert"),
        )
        init_parameters(model, SEED, grid)
        experts = model.layers["1"].feed_forward.experts
        assert experts.w1.shape[0] == cfg.n_experts // ep  # really split
        opt = build_optimizer(model, LR, weight_decay=0.1)
        for step, batch in enumerate(batches(cfg)):
            set_lr(opt, step)
            grid.comm.reset()
            got = [float(t) for t in train_step_losses(model, opt, grid, batch, MICRO, CLIP)]
            assert (grid.comm.stats(Axis.EXPERT).calls > 0) == (ep > 1)
            for what, g, r, tol in zip(
                ("lm", "aux", "norm"), got, curves[step][:3], (1e-5, 1e-5, 1e-4), strict=True
            ):
                assert abs(g - r) <= tol * abs(r), f"{name} {sizes} ep{ep} {step} {what}: {g} {r}"
            check_routing([model], grid, curves[step][3], f"{name} {sizes} ep{ep} {step}")
        check_weights([model], ref_state, grid, f"{name} {sizes} ep{ep}")


def check_weights(models, ref_state, grid, label):
    """Every float64 weight of ``models`` against the reference's slice, to the dense grids'
    0.05 lr."""
    worst = 0.0
    for model in models:
        params = dict(model.named_parameters())
        for key, t in model.state_dict().items():
            p = params.get(key)
            want = ref_state[key] if p is None else p.placement.shard_of(ref_state[key], grid)
            assert t.dtype == want.dtype == torch.float64, f"{label}: {key} {t.dtype}"
            worst = max(worst, (t - want).abs().max().item())
    assert worst <= 0.05 * LR, f"{label}: {worst / LR:.3g} lr"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_expert_parallel_matches_reference(name):
    curves, state = float64_run(CONFIGS[name])
    assert curves[0][1] > 0
    run_distributed(ep_run, 2, name, curves, state, TWO_RANKS)
    run_distributed(ep_run, 4, name, curves, state, FOUR_RANKS)


def pipeline_run(name, curves, ref_state, grids):
    from tetrad.pipeline.schedule import Pipeline
    from tetrad.pipeline.step import pipeline_train_step_losses

    torch.set_default_dtype(torch.float64)  # as float64_run (this rank's process only)
    cfg = CONFIGS[name]
    for pipe, sizes, ep in grids:
        grid = Grid.build(sizes, pipe=pipe, expert=ep)
        m = 8 // (sizes[0] * sizes[2]) // MICRO
        pipeline = Pipeline(cfg, grid, "1f1b", 1, m, overlaps=("dp_all_reduce", "expert"))
        for part in pipeline.parts:
            init_parameters(part, SEED, grid)
        opt = build_optimizer(pipeline.parts, LR, weight_decay=0.1)
        for step, batch in enumerate(batches(cfg)):
            set_lr(opt, step)
            got = [float(t) for t in pipeline_train_step_losses(pipeline, opt, batch, CLIP)]
            for what, g, r, tol in zip(
                ("lm", "aux", "norm"), got, curves[step][:3], (1e-5, 1e-5, 1e-4), strict=True
            ):
                assert abs(g - r) <= tol * abs(r), f"{name} pipe{pipe} ep{ep} {step} {what} {g} {r}"
            check_routing(pipeline.parts, grid, curves[step][3], f"{name} pipe{pipe} {step}")
        check_weights(pipeline.parts, ref_state, grid, f"{name} pipe{pipe} ep{ep}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pipeline_with_expert_parallel_matches_reference(name):
    """``pipe=2 x data=2`` with ``G_expert = 2`` (and ``pipe=2`` alone): the load-balancing
    terms are differentiated on their own stage (AttachAux), the bias update runs per part."""
    curves, state = float64_run(CONFIGS[name])
    run_distributed(pipeline_run, 2, name, curves, state, [(2, (1, 1, 1, 1, 1), 1)])
    run_distributed(pipeline_run, 4, name, curves, state, [(2, (2, 1, 1, 1, 1), 2)])
    # data=2 y=2 ep2 (over Y): an expert-data group of 2, the experts' sums issued during the last
    # micro-batch's backward phase (tetrad/parallel/expert_grads.py)
    run_distributed(pipeline_run, 8, name, curves, state, [(2, (2, 1, 1, 2, 1), 2)])


def compiled_and_eager(name, curves):
    """``name`` trained on ``data=2`` with ``G_expert = 2``, eagerly and with its blocks
    compiled (``aot_eager``), each against the reference's losses and gradient norm
    (:func:`train_checked`), the two runs' against each other, and their weights to 0.05 lr of
    each other."""
    grid = Grid.build((2, 1, 1, 1, 1), expert=2)
    (eager, losses), (compiled, compiled_losses) = (
        train_checked(name, grid, curves, backend, routing=False) for backend in (None, "aot_eager")
    )
    for e, c in zip(losses, compiled_losses, strict=True):
        assert c == pytest.approx(e, rel=1e-5), (name, e, c)
    weights = eager.state_dict()
    worst = max((weights[k] - t).abs().max().item() for k, t in compiled.state_dict().items())
    assert worst <= 0.05 * LR, f"{name}: compiled weights {worst / LR:.3g} lr from eager"


def test_moe_small_compiled_matches_eager():
    """The ``moe-small`` preset as it is (softmax top-2 of 8 experts, the sequence-wise balance
    term, selection biases at 0.003) trains compiled (``aot_eager``) with expert parallelism 2:
    the losses and gradient norm of the eager run and of the reference (1e-5, 1e-4), the eager
    run's weights to 0.05 lr, and nothing compiled again after the first step. (The weights
    are compared with the eager run's, not the reference's: with 4,096 embedding rows and 128
    tokens a step, a row seen once has elements whose first Adam step divides a gradient near
    AdamW's eps, and rounding differences between the two implementations move one of them
    0.48 lr from the reference in fp32, 0.07 lr in float64, eager or compiled alike.)"""
    curves, _ = reference_run(PRESET_CONFIGS["moe-small"])
    run_distributed(compiled_and_eager, 2, "moe-small", curves)


def bad_expert_grid():
    with pytest.raises(GridError, match="must divide the 2 ranks of a pipeline stage") as e:
        Grid.build((1, 1, 2, 1, 1), expert=4)
    assert "\n" not in str(e.value)


def test_expert_parallel_not_dividing_refused():
    run_distributed(bad_expert_grid, 2)


def _train(cfg):
    from tetrad.train import trainer

    trainer.train(cfg)


def test_resume_across_expert_parallel_sizes(corpus, tmp_path, monkeypatch):  # noqa: F811
    """The MoE run on ``data=4`` resumed from its DCP checkpoints with another expert
    parallelism each time (2 -> 4 -> none, the experts' shards re-cut; the first two parts with
    the sharded optimizer, whose expert weights' states are split over expert-data, 2 ranks,
    then whole with ``G_expert = 4``) gives the uninterrupted
    run's losses and routing figures; the checkpoints' keys do not depend on ``G_expert``."""
    from tests.test_resume import full_state
    from tests.test_train import config, losses

    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    whole, split = tmp_path / "whole", tmp_path / "split"
    # a flat learning rate after the warm-up: the cosine's end is the run's --steps
    opts = dict(model=MODEL, grid="data=4,expert=2", checkpoint_every=2, lr=3e-3, min_lr=3e-3)
    run_distributed(_train, 4, config(corpus, whole, 6, **opts))
    rows, expected = losses(whole)
    run_distributed(_train, 4, config(corpus, split, 2, shard_optimizer=True, **opts))
    four = opts | {"grid": "data=4,expert=4"}  # expert=2 and --expert-parallel 4 disagree
    run_distributed(_train, 4, config(corpus, split, 4, resume=True, shard_optimizer=True, **four))
    opts["grid"] = "4,1,1,1"
    run_distributed(_train, 4, config(corpus, split, 6, resume=True, **opts))
    got_rows, got = losses(split)
    assert len(got) == len(expected) == 6
    for g, e in zip(got, expected, strict=True):
        assert abs(g - e) <= 1e-5 * abs(e), (got, expected)
    for g, e in zip(got_rows, rows, strict=True):  # routing figures: G_expert 2, 4, then 1
        assert g["moe_max_load"] == e["moe_max_load"], (g["step"], g["moe_max_load"])
        assert g["moe_expert_load"] == e["moe_expert_load"], g["step"]
        assert g["moe_balance"] == pytest.approx(e["moe_balance"], rel=1e-5), g["step"]
    a = full_state(whole / "checkpoints/step_0000004")
    b = full_state(split / "checkpoints/step_0000004")  # written with G_expert = 4
    assert a.keys() == b.keys() and a["model.layers.1.feed_forward.experts.w1"].shape[0] == 4


def test_expert_parallel_options_and_one_line_refusals():

    from tetrad.spec.presets import PRESETS
    from tetrad.spec.sharding import check_moe_grid
    from tetrad.train.config import ConfigError, load_config

    cfg = load_config(None, {"grid": "data=4,expert=2"})
    assert cfg.parallelism.grid == (4, 1, 1, 1, 1) and cfg.parallelism.expert_parallel == 2
    load_config(None, {"grid": "data=4,expert=2", "shard_optimizer": True}).check()
    cfg = load_config(None, {"grid": "2,1,1,1", "expert_parallel": 4})
    with pytest.raises(ConfigError, match="use --expert-parallel 1 or 2") as e:
        cfg.check()
    assert "\n" not in str(e.value)
    with pytest.raises(GridError, match="n_experts=4") as e:
        check_moe_grid(PRESETS["moe-tiny"], (8, 1, 1, 1, 1), expert=8)
    with pytest.raises(GridError, match="needs a model with experts"):
        check_moe_grid(PRESETS["tiny"], (2, 1, 1, 1, 1), expert=2)
    check_moe_grid(PRESETS["moe-tiny"], (2, 2, 1, 1, 1), pipe=2, expert=4)


def expert_sums_during_backward():
    """On ``data=4`` with ``G_expert = 2`` (an expert-data group of 2) and the
    ``dp_all_reduce`` overlap, the last micro-batch's backward has issued one expert-data sum
    per MoE block before it returns; the end of the micro-batch waits for them, and
    ``sync_gradients`` sums nothing more over expert-data."""
    from tetrad.parallel.batch import inputs_targets, local_samples
    from tetrad.parallel.grads import sync_gradients

    cfg = CONFIGS["sigmoid-bias"]
    grid = Grid.build((4, 1, 1, 1, 1), expert=2)
    model = ParallelLlama(cfg, grid, overlaps=("dp_all_reduce",))
    init_parameters(model, SEED, grid)
    tokens, targets = inputs_targets(local_samples(batches(cfg)[0], grid), grid)
    overlap = model.overlap
    overlap.begin_micro_batch(last=True)
    grid.comm.reset()
    model.loss_sum(tokens, targets).backward()
    issued = grid.comm.stats(Axis.EXPERT_DATA).calls
    assert issued == cfg.moe_layers, issued
    overlap.end_micro_batch()
    sync_gradients(model, grid, overlap.buckets.reduced)
    assert grid.comm.stats(Axis.EXPERT_DATA).calls == issued


def test_expert_gradient_sums_run_during_backward():
    run_distributed(expert_sums_during_backward, 4)
