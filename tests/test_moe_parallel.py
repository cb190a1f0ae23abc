"""The MoE Llama on the grid against the single-process reference (2 gloo ranks).

Experts are replicated on every rank here (expert parallelism: tests/test_moe_expert_parallel.py),
so data parallelism and Z are the axes tested: a few
AdamW steps (gradient accumulation, clipping, warm-up) on the same global batches must give the
reference's LM loss and load-balancing loss (with the router z-loss in one config) to 1e-5
relative, its gradient norm to 1e-4, its routing figures per MoE block (max/mean expert load,
normalised balance term, router z-loss), and its updated
weights (and aux-loss-free selection biases) to 0.05 lr, as tests/test_model.py requires of the
dense model. Y and X grids: tests/test_moe_tensor.py.
"""

import dataclasses

import pytest
import torch

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.models.moe import Router
from tetrad.models.reference import Llama as Reference
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama, compile_blocks, compile_stats
from tetrad.spec.grid import GridError
from tetrad.spec.presets import PRESETS
from tetrad.spec.sharding import check_grid
from tetrad.train.routing import routing_row, sum_routing, take_step_routing
from tetrad.train.step import build_optimizer, lr_at, train_step_losses

# sigmoid scores with a selection bias in one config; softmax, a shared expert, a dense block,
# Qwen3's q/k norms and the router z-loss (large enough to matter) in the other
CONFIGS = {
    "softmax-qk-norm": dataclasses.replace(
        PRESETS["moe-tiny"], qk_norm=True, router_z_loss_coef=0.05
    ),
    "sigmoid-bias": dataclasses.replace(
        PRESETS["moe-tiny"],
        router_score="sigmoid",
        route_scale=2.5,
        bias_update_rate=0.01,
        shared_ffn_dim=0,
        dense_layers=0,
    ),
}
# and the preset of the demo-sized MoE runs, for tests/test_moe_expert_parallel.py's compiled one
PRESET_CONFIGS = CONFIGS | {"moe-small": PRESETS["moe-small"]}
STEPS, BATCH, SEQ, MICRO, LR, CLIP, SEED = 3, 8, 16, 2, 3e-3, 1.0, 7


def batches(cfg):
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def set_lr(opt, step):
    for group in opt.param_groups:
        group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)


def reference_run(cfg):
    """Plain PyTorch, whole batch at once: loss = mean CE + aux sum / sequences."""
    torch.manual_seed(0)
    model = Reference(cfg)
    init_parameters(model, SEED)
    opt = build_optimizer(model, LR, weight_decay=0.1)
    curves = []
    for step, batch in enumerate(batches(cfg)):
        set_lr(opt, step)
        lm = model.loss_sum(batch[:, :-1], batch[:, 1:]) / batch[:, 1:].numel()
        aux = model.aux_loss_sum() / batch.shape[0]
        model.record_routing()
        (lm + aux).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
        opt.step()
        opt.zero_grad()
        for r in model.modules():
            if isinstance(r, Router) and r.bias is not None:
                r.update_bias(r.tokens_per_expert.clone())
        routing = routing_row(take_step_routing([model], cfg), cfg, BATCH)
        curves.append((lm.item(), aux.item(), norm, routing))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return curves, state


def train_checked(name, grid, curves, backend=None, routing=True):
    """``name`` trained on ``grid`` from the seed's weights (its blocks compiled with the
    ``backend`` first): each step's LM and load-balancing losses (1e-5) and gradient norm (1e-4)
    against the reference's ``curves``, its routing figures too (``routing``), and with a
    backend nothing compiled again after the first step. Returns the model and its losses."""
    cfg = PRESET_CONFIGS[name]
    label = f"{name} {grid.sizes} {backend}"
    model = ParallelLlama(cfg, grid, overlaps=("dp_all_reduce", "reduce_scatter", "expert"))
    init_parameters(model, SEED, grid)
    if backend is not None:
        compile_blocks(model, backend)
    opt = build_optimizer(model, LR, weight_decay=0.1)
    losses = []
    for step, batch in enumerate(batches(cfg)):
        set_lr(opt, step)
        got = [float(t) for t in train_step_losses(model, opt, grid, batch, MICRO, CLIP)]
        for what, g, r, tol in zip(
            ("lm", "aux", "norm"), got, curves[step][:3], (1e-5, 1e-5, 1e-4), strict=True
        ):
            assert abs(g - r) <= tol * abs(r), f"{label} step {step} {what}: {g} vs {r}"
        if routing:
            check_routing([model], grid, curves[step][3], f"{label} step {step}")
        if backend is not None and step == 0:
            graphs = compile_stats()["graphs"]
        losses.append(got)
    if backend is not None:  # no recompilation (a host-read size would force one a step)
        assert compile_stats()["graphs"] == graphs, f"{label}: compiled again"
    return model, losses


def parallel_run(name, curves, ref_state, grids, backend=None):
    """Train on each grid (sizes, or ``(sizes, G_expert)``) and compare with the reference
    (:func:`train_checked`, then every weight to 0.05 lr); ``backend``: the blocks compiled
    with this torch.compile backend first."""
    for sizes in grids:
        sizes, ep = (sizes, 1) if isinstance(sizes[0], int) else sizes
        grid = Grid.build(sizes, expert=ep)
        model, _ = train_checked(name, grid, curves, backend)
        worst = 0.0
        for key, t in model.state_dict().items():
            p = dict(model.named_parameters()).get(key)
            want = p.placement.shard_of(ref_state[key], grid) if p is not None else ref_state[key]
            worst = max(worst, (t - want).abs().max().item())
        assert worst <= 0.05 * LR, f"{name} {sizes}: weights differ by {worst / LR:.3g} lr"


def check_routing(parts, grid, want: dict, label: str) -> None:
    """The step's routing figures per MoE block (:mod:`tetrad.train.routing`), summed over the
    grid, against the reference's: the max/mean and per-expert loads exactly (counts of the same
    choices), the balance terms to 1e-5 relative as the losses."""
    cfg = parts[0].cfg
    got = routing_row(sum_routing(take_step_routing(parts, cfg), grid), cfg, BATCH)
    keys = {"moe_max_load", "moe_balance", "moe_expert_load"}
    keys |= {"moe_z_loss"} if cfg.router_z_loss_coef > 0 else set()
    assert got.keys() == want.keys() == keys, label
    assert got["moe_max_load"] == pytest.approx(want["moe_max_load"], rel=1e-12), label
    assert got["moe_expert_load"] == want["moe_expert_load"], label
    assert got["moe_balance"] == pytest.approx(want["moe_balance"], rel=1e-5), label
    if cfg.router_z_loss_coef > 0:  # ST-MoE's mean over every token, whatever the split
        assert got["moe_z_loss"] == pytest.approx(want["moe_z_loss"], rel=1e-5), label


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_data_and_z_match_reference(name):
    curves, state = reference_run(CONFIGS[name])
    assert curves[0][1] > 0  # the load-balancing term is really on
    run_distributed(parallel_run, 2, name, curves, state, [(2, 1, 1, 1), (1, 2, 1, 1)])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compiled_blocks_match_reference(name):
    """``--compile`` on the MoE model (``aot_eager``: what Dynamo traces and AOTAutograd
    differentiates; Inductor's side is the dense model's tests'), the same tolerances as
    eager, on data, expert-parallel and Y grids: the fp32 experts' grouped GEMMs run eagerly
    inside the compiled blocks (Dynamo traces ``grouped_mm`` in bf16 only), and the
    all-to-alls and the routing statistics' sums stay outside the graphs: nothing is compiled
    again after the first step."""
    curves, state = reference_run(CONFIGS[name])
    grids = [((2, 1, 1, 1, 1), 2), (1, 1, 1, 2, 1)]
    run_distributed(parallel_run, 2, name, curves, state, grids, "aot_eager")
    # an expert-data group of 2: the experts' backward hook that issues their sum
    # (tetrad/parallel/expert_grads.py) on a compiled block
    run_distributed(parallel_run, 4, name, curves, state, [((4, 1, 1, 1, 1), 2)], "aot_eager")


@pytest.mark.parametrize("grid", [(1, 1, 1, 2, 1), (1, 1, 1, 1, 2), (1, 2, 1, 2, 2)])
def test_tensor_grids_accepted_sequence_checked_in_one_line(grid):
    """MoE runs on Y and X (tests/test_moe_tensor.py); each tensor rank routes a slice of its
    sequence positions, so the sequence length must divide by G_context G_y G_x."""
    from tetrad.spec.sharding import check_moe_grid

    check_grid(PRESETS["moe-tiny"], grid)
    n = grid[1] * grid[3] * grid[4]
    check_moe_grid(PRESETS["moe-tiny"], grid, seq_len=16 * n)
    with pytest.raises(GridError, match=f"G_context\\*G_y\\*G_x={n}") as e:
        check_moe_grid(PRESETS["moe-tiny"], grid, seq_len=16 * n + 1)
    assert "\n" not in str(e.value)
