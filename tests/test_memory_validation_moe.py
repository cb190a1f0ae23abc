"""The planner's memory model of a mixture-of-experts model against what the runtime allocates
and saves (the MoE counterpart of tests/test_memory_validation.py, same measures).

Three MoE shapes on gloo ranks (CPU): a softmax router with a shared expert and a dense first
block on one rank; a sigmoid router with selection biases and route scaling, its experts split
over 2 data ranks (``expert=2``); 8 experts of another width with a batch-scoped balance loss,
split over 2 data ranks on a tensor grid (``x=2``: each tensor rank routes half the tokens).
Each rank measures its parameter, gradient and AdamW-state bytes and the unique storages
autograd saves during one micro-batch's forward (fp32, under CPU bf16 autocast with an fp32
residual stream, and under the step's autocast with the bf16 stream of the CUDA policy), in the
checkpointing modes ``none``, ``selective`` and ``full`` (and the recompute set of one block
under ``full``). Model states must equal :func:`tetrad.plan.memory.runtime.runtime_memory` to
the byte; saved activations must be within 5% of
:func:`tetrad.plan.memory.activations.saved_activations` (issue 46), on every rank without
expert parallelism and on the mean of the expert group's ranks with it (a rank's received rows
depend on the routing; their sum over the group does not).
"""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.test_memory_validation import (
    SavedBytes,
    block_recompute_bytes,
    forward_and_backward_bytes,
)
from tetrad.dtypes import autocast
from tetrad.grid import Grid
from tetrad.parallel import init_parameters
from tetrad.parallel.batch import inputs_targets, local_samples
from tetrad.parallel.masters import store_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.parallel.zero import settle_parameters
from tetrad.plan.memory.activations import saved_activations
from tetrad.plan.memory.runtime import runtime_memory
from tetrad.spec.activation_checkpointing import checkpointed_blocks
from tetrad.spec.model import ModelSpec
from tetrad.spec.precision import precision
from tetrad.train.step import build_optimizer, train_step

BASE = ModelSpec(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    vocab_size=256,
    n_experts=4,
    top_k=2,
    expert_ffn_dim=32,
    aux_loss_coef=0.01,
)
SHAPES = {  # name: (model, grid (G_data, G_z, G_y, G_x), G_expert)
    "softmax-shared": (
        dataclasses.replace(BASE, shared_ffn_dim=32, dense_layers=1, router_z_loss_coef=0.001),
        (1, 1, 1, 1),
        1,
    ),
    "sigmoid-ep2": (
        dataclasses.replace(BASE, router_score="sigmoid", route_scale=2.5, bias_update_rate=0.01),
        (2, 1, 1, 1),
        2,
    ),
    "wide-ep2-x2": (
        dataclasses.replace(BASE, dim=128, n_experts=8, expert_ffn_dim=64, aux_loss_scope="batch"),
        (2, 1, 1, 2),
        2,
    ),
}
MICRO, SEQ, SEED = 2, 16, 3
MODES = ("none", "selective", "full")
TOLERANCE = 0.05


def _measure(cfg: ModelSpec, grid: Grid, mode: str) -> dict:
    model = ParallelLlama(cfg, grid, mode)
    init_parameters(model, SEED, grid)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    g = torch.Generator().manual_seed(SEED)
    batch = torch.randint(0, cfg.vocab_size, (MICRO * grid.batch_shards, SEQ + 1), generator=g)
    tokens, targets = inputs_targets(local_samples(batch, grid), grid)
    out = forward_and_backward_bytes(model, tokens, targets, params)
    if mode == "full":  # the top (MoE) block's forward as the recomputation runs it
        out["recompute"] = block_recompute_bytes(model, tokens, params, str(cfg.n_layers - 1))
    # weights stored in bf16 (--param-dtype bf16): the expert and router weights are no copies
    bf16 = ParallelLlama(cfg, grid, mode)
    init_parameters(bf16, SEED, grid)
    store_parameters(bf16, torch.bfloat16, torch.float32)
    stored = {p.untyped_storage().data_ptr() for p in bf16.parameters()}
    with SavedBytes(stored) as saved, autocast(tokens.device, precision("cuda")):
        bf16.loss_sum(tokens, targets, grad_scale=1.0)
    out["activations_bf16_params"] = saved.total
    if mode != "none":
        return out
    model.zero_grad(set_to_none=True)
    opt = build_optimizer(model, 1e-3, weight_decay=0.1)
    train_step(model, opt, grid, batch, MICRO, 1.0)
    out["optimizer_states"] = sum(
        opt.state[p][k].numel() * opt.state[p][k].element_size()
        for p in model.parameters()
        for k in ("exp_avg", "exp_avg_sq")
    )
    # the sharded optimizer: the AdamW states of this rank's pieces (the experts' split over
    # their expert-data group where it has more than one rank)
    opt = build_optimizer(model, 1e-3, weight_decay=0.1, shard=grid)
    train_step(model, opt, grid, batch, MICRO, 1.0)
    settle_parameters(opt)
    out["optimizer_states_sharded"] = sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for k, t in st.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    return out


def _worker(name: str, out_dir: str) -> None:
    cfg, sizes, expert = SHAPES[name]
    grid = Grid.build(sizes, expert=expert)
    for mode in MODES:
        with open(f"{out_dir}/{name}_{mode}_{dist.get_rank()}.json", "w") as fh:
            json.dump(_measure(cfg, grid, mode), fh)


def predicted(name: str, mode: str) -> dict:
    cfg, sizes, expert = SHAPES[name]
    opts = {"activation_checkpointing": mode, "expert": expert}
    r = runtime_memory(cfg, sizes, MICRO, SEQ, 1e9, dtype="fp32", **opts)
    out = {k: r.components[k] for k in ("parameters", "gradients", "optimizer_states")}
    zero = runtime_memory(cfg, sizes, MICRO, SEQ, 1e9, dtype="fp32", shard_optimizer=True, **opts)
    out["optimizer_states_sharded"] = zero.components["optimizer_states"]
    # plain torch.autocast keeps an fp32 residual stream; the step's autocast with the CUDA
    # policy a bf16 one (the default, residual None)
    cases = (
        ("fp32", "activations", "fp32", "fp32"),
        ("bf16", "activations_bf16", "fp32", "fp32"),
        ("bf16", "activations_bf16_stream", None, "fp32"),
        ("bf16", "activations_bf16_params", None, "bf16"),
    )
    for dtype, key, residual, params in cases:
        more = {"residual": residual, "params": params}
        s = saved_activations(cfg, sizes, MICRO, SEQ, dtype=dtype, **more, **opts)
        out[key] = s["blocks"] + s["embedding"] + s["final_norm"] + s["loss"]
        if mode == "full" and dtype == "fp32":
            out["recompute"] = s["recompute"]
    # as for dense models: the CPU kernel's heads-major attention output is copied token-major
    # under bf16 (the model's bf16 describes CUDA's FlashAttention, token-major already)
    plain = cfg.n_layers - checkpointed_blocks(mode, cfg.n_layers)[1]
    for key in ("activations_bf16", "activations_bf16_stream", "activations_bf16_params"):
        out[key] += plain * 2 * MICRO * SEQ * cfg.q_dim // sizes[2]
    return out


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_moe_memory_model_matches_runtime(name, tmp_path):
    _, sizes, expert = SHAPES[name]
    world = sizes[0] * sizes[1] * sizes[2] * sizes[3]
    run_distributed(_worker, world, name, str(tmp_path))
    for mode in MODES:
        want = predicted(name, mode)
        got = [json.loads((tmp_path / f"{name}_{mode}_{r}.json").read_text()) for r in range(world)]
        for k in want:
            if k not in got[0]:
                continue
            values = [g[k] for g in got]
            mean = sum(values) / world
            print(
                f"{name} {mode} {k}: measured {values} (mean {mean:.0f}), predicted {want[k]:.0f}"
            )
            if k in ("parameters", "gradients", "optimizer_states", "optimizer_states_sharded"):
                assert values == [want[k]] * world, f"{name} {mode} {k}"
            elif expert > 1:  # the received rows vary by rank; their sum does not
                assert abs(mean - want[k]) <= TOLERANCE * want[k], f"{name} {mode} {k}"
            else:  # whole experts on every rank: the model's bytes are the runtime's
                assert values == [want[k]] * world, f"{name} {mode} {k}"
