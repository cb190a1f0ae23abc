"""Weights stored in bf16 with fp32 masters in the optimizer (:mod:`tetrad.parallel.masters`,
``--param-dtype bf16``) against the single-process reference under the same policy (bf16
weights, bf16 GEMMs under the CPU's autocast, a bf16 residual stream, fp32 gradients
accumulated apart, fp32 masters updated by AdamW), on data,
data x Z, Y x X, data x context and pipeline x data grids, with the sharded optimizer (masters
sharded with the AdamW states) and without, the gradients summed over data in fp32 or in bf16
(``--grad-reduce-dtype``: every sum over data is seen in that format); the bf16 stream also
with sequence parallelism (data x Y, selective recompute) and under full recompute (context x
X); an fp32 residual stream (``--residual-dtype fp32``) on Y x X against the reference with the
same stream; checkpoints that keep the fp32 masters, so that runs resume across storage
formats; and the MoE model (both router configurations of tests/test_moe_parallel.py) with
expert parallelism (``G_expert = 2`` on data=4, its experts summed over expert-data, and on
data x Z, split over Z and summed over data), with the sharded optimizer (the experts' states
and masters split over expert-data too) and without: the routed experts' grouped
GEMMs in bf16, their gradients kept apart in fp32 and summed over expert-data in the
``--grad-reduce-dtype`` format as the others over data.

Tolerances. Both sides round the weights and every GEMM's output to bf16 (unit roundoff
``u = 2^-8``) but sum in other orders (over ranks, over micro-batches, in fused collectives), so
a forward's activations differ by a few ``u`` relative, and the loss, a mean over 128 tokens of
``log_softmax``, by far less: ``LOSS_TOL = u / 4`` relative (the runs below differ by at most
1e-4). The global gradient norm (fp32 sums of bf16-computed gradients) within ``NORM_TOL = u``
relative. The updated masters: AdamW's update is about ``lr * sign(grad)``, so an element whose
gradient is near zero may move the other way (up to ``2 lr``, as in fp32, see
``/work/shared/notes/testing-equivalence.md``), and bf16 rounding makes that common: the masters
are compared by the mean absolute difference, at most ``0.05 lr`` (a planted bug, such as a
gradient not summed over data or a master not refreshed, moves it past ``0.3 lr``), and by the
largest, at most twice the sum of the steps' learning rates (an element that flips every
step). The MoE runs: the same tolerances, the load-balancing loss (fp32, from the same choices
of experts and the fp32 probabilities of bf16 logits) within ``LOSS_TOL`` as the LM loss (they
differ by at most 1.5e-4 relative, the LM loss by 2.5e-5, the norm by 1.2e-3; the masters by
0.018-0.024 lr on average, 3.4 lr at most; experts not summed over expert-data move the mean
to 0.14 lr). A near-tie of two bf16 router logits may choose another expert for a slot on one
side, so the selection biases (sign updates from the step's loads) are not compared. That
flip is amplified by the sigmoid configuration's bias update where it lands on a load equal
to the mean (the sign then differs from 0): on context grids (data=1 x context=2, with or
without experts split) one slot of block 1 moved at step 0 routes the next steps otherwise
and leaves that block's masters 0.3-0.4 lr off on average, no bug (the fp32 runs route
identically); hence data and Z grids here (on data=4 one flip, at the last step, changes
only the final biases).
"""

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.test_moe_parallel import CONFIGS
from tests.test_zero import build_model
from tetrad.dtypes import autocast, torch_dtype
from tetrad.grid import Grid
from tetrad.models.llama import Block
from tetrad.models.reference import Llama as Reference
from tetrad.parallel import init_parameters
from tetrad.parallel.experts import biased_routers
from tetrad.parallel.masters import MasterAdamW, grad_of
from tetrad.parallel.model import ParallelLlama
from tetrad.parallel.zero import settle_parameters
from tetrad.pipeline.step import pipeline_train_step
from tetrad.spec.grid import Axis
from tetrad.spec.overlap import OVERLAPS
from tetrad.spec.precision import precision
from tetrad.spec.presets import PRESETS
from tetrad.train.checkpoint import Checkpointer
from tetrad.train.step import build_optimizer, lr_at, train_step, train_step_losses

# the reference's torch.nn.RMSNorm reads the fp32 residual stream with a bf16 weight: torch warns
# that it takes its unfused kernel
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2)
STEPS, BATCH, SEQ, MICRO, LR, CLIP, SEED = 3, 8, 16, 2, 3e-3, 1.0, 7
OVERLAP_OPTIONS = {"bucket_bytes": 1 << 14, "domino_min_rows": 8}
BF16 = precision("cpu", "bf16")
U = 2.0**-8
LR_SUM = sum(lr_at(s, LR, LR / 10, 2, STEPS) for s in range(STEPS)) / LR  # 2.5
LOSS_TOL, NORM_TOL, MEAN_TOL, MAX_TOL = U / 4, U, 0.05, 2 * LR_SUM


def batches():
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def reference_run(policy=BF16):
    """The plain model under ``policy`` (bf16 weights), micro-batches of ``MICRO``: (losses,
    norms), the final fp32 masters."""
    model = Reference(CFG)
    init_parameters(model, SEED)
    opt = build_optimizer(model, LR, weight_decay=0.1, policy=policy)
    assert isinstance(opt, MasterAdamW)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    losses, norms = [], []
    for step, batch in enumerate(batches()):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)
        loss = 0.0
        for mb in batch.split(MICRO):
            with autocast(torch.device("cpu"), policy):
                h = model.hidden(mb[:, :-1])
                part = model.loss_sum(mb[:, :-1], mb[:, 1:]) / batch[:, 1:].numel()
            assert h.dtype == torch_dtype(policy.residual)  # the final norm's input's format
            part.backward()
            loss += part.item()
        norm = _clip(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        norms.append(norm)
    masters = {n: opt.master_of(p).clone() for n, p in model.named_parameters()}
    return (losses, norms), masters


def _clip(model) -> float:
    """Clip the reference's fp32 gradients (kept apart) to a global norm of ``CLIP``; the norm
    before."""
    grads = [grad_of(p) for p in model.parameters()]
    assert {g.dtype for g in grads} == {torch.float32}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch._foreach_mul_(grads, min(1.0, CLIP / (norm.item() + 1e-6)))
    return norm.item()


@pytest.fixture(scope="module")
def reference():
    """The reference runs by residual stream format."""
    return {r: reference_run(precision("cpu", "bf16", residual=r)) for r in ("bf16", "fp32")}


def _masters(opt, weights) -> dict:
    """Each parameter's whole local fp32 master (collective over data with the sharded
    optimizer)."""
    named = list(weights.named_parameters())
    if not isinstance(opt, MasterAdamW):  # torch's AdamW: the parameters are the masters
        return {n: p.detach().clone() for n, p in named}
    states = opt.full_states([p for _, p in named])
    return {n: st["master"] for (n, _), st in zip(named, states, strict=True)}


def _train(model, opt, grid, pipe, steps, ref_curves=None, label=""):
    for step, batch in steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)
        if pipe > 1:
            loss, norm = map(float, pipeline_train_step(model, opt, batch, CLIP))
        else:
            loss, norm = map(float, train_step(model, opt, grid, batch, MICRO, CLIP))
        if ref_curves is not None:
            ref_loss, ref_norm = ref_curves[0][step], ref_curves[1][step]
            assert abs(loss - ref_loss) <= LOSS_TOL * ref_loss, f"{label} step {step}: {loss}"
            assert abs(norm - ref_norm) <= NORM_TOL * ref_norm, f"{label} {step}: norm {norm}"
    settle_parameters(opt)


@contextlib.contextmanager
def data_sums(grid, into: set, counts: int = 0):
    """Collects the dtypes of the tensors (more than one element) summed over data, or over
    expert-data (the expert-sharded weights' part of data), while active (on gloo a
    reduce-scatter is an all-reduce too); not those of ``counts`` elements (the routers'
    expert loads, summed for the selection biases' update, are no gradients)."""
    plain = dist.all_reduce
    axes = (Axis.DATA, Axis.EXPERT_DATA) if grid.expert > 1 else (Axis.DATA,)
    groups = [grid.group(a) for a in axes if grid.size(a) > 1]

    def spy(t, *args, **kwargs):
        if any(kwargs.get("group") is g for g in groups) and t.numel() not in (1, counts):
            into.add(t.dtype)
        return plain(t, *args, **kwargs)

    dist.all_reduce = spy
    try:
        yield
    finally:
        dist.all_reduce = plain


def _build(pipe, sizes, variant):
    """``build_model``'s ``(grid, model, weights)``, or for a ``variant`` ``(checkpointing,
    sequence_parallel)`` the ParallelLlama so built (no pipeline)."""
    if variant is None:
        return build_model(pipe, sizes, OVERLAPS, CFG)
    grid = Grid.build(sizes)
    mode, sp = variant
    model = ParallelLlama(CFG, grid, mode, OVERLAPS, sequence_parallel=sp, **OVERLAP_OPTIONS)
    init_parameters(model, SEED, grid)
    return grid, model, model


def master_runs(world_size, references, cases, run_dir):
    for pipe, sizes, shard, reduce, residual, variant in cases:
        ref_curves, ref_masters = references[residual]
        grid, model, weights = _build(pipe, sizes, variant)
        policy = precision("cpu", "bf16", grad_reduce=reduce, residual=residual)
        opt = build_optimizer(weights, LR, 0.1, shard=grid if shard else None, policy=policy)
        label = f"pipe {pipe} grid {sizes} shard {shard} reduce {reduce} {residual} {variant}"
        assert {p.dtype for p in weights.parameters()} == {torch.bfloat16}, label
        sums, streams = set(), set()
        with data_sums(grid, sums), _block_outputs(weights, streams):
            _train(model, opt, grid, pipe, enumerate(batches()), ref_curves, label)
        assert streams == {torch_dtype(residual)}, f"{label}: residual stream in {streams}"
        if grid.size("data") > 1:
            assert sums == {torch_dtype(reduce)}, f"{label}: summed over data in {sums}"
        _check_masters(opt, weights, grid, ref_masters, label)
    _resume_across_formats(run_dir)


def _check_masters(opt, weights, grid, ref_masters: dict, label: str) -> None:
    """Every local fp32 master of ``weights`` against the reference's slice (mean and largest
    difference, in units of ``LR``), and the stored bf16 weights are the masters rounded."""
    masters, diffs = _masters(opt, weights), []
    for name, p in weights.named_parameters():
        assert masters[name].dtype == torch.float32, label
        assert torch.equal(p.detach(), masters[name].to(torch.bfloat16)), f"{label} {name}"
        diffs.append(masters[name] - p.placement.shard_of(ref_masters[name], grid))
    flat = torch.cat([d.reshape(-1) for d in diffs]).abs() / LR
    mean, worst = flat.mean().item(), flat.max().item()
    assert mean <= MEAN_TOL and worst <= MAX_TOL, f"{label}: masters {mean:.3g} {worst:.3g} lr"
    if not any(grid.coord.values()):
        print(f"{label}: masters differ by {mean:.2e} lr on average, {worst:.2f} lr at most")


@contextlib.contextmanager
def _block_outputs(weights, into: set):
    """Collects the dtypes of the blocks' outputs (the residual stream) while active."""
    hooks = [
        m.register_forward_hook(lambda _m, _a, out: into.add(out.dtype))
        for m in weights.modules()
        if isinstance(m, Block)
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _resume_across_formats(run_dir):
    """fp32 weights for a step, saved; resumed with bf16 weights and the sharded optimizer (the
    masters are the saved weights exactly), a step, saved; resumed with fp32 weights (they are
    the saved masters exactly); the same keys and fp32 tensors in both checkpoints. Every load
    places the AdamW steps where torch's fused AdamW reads them (``place_steps``: on a GPU the
    device; here a call is all that shows it), for plain and sharded AdamW with masters."""
    import tetrad.parallel.masters as masters_module
    import tetrad.train.checkpoint as checkpoint_module

    placed, place = [], masters_module.place_steps  # every load places the AdamW steps

    def placing(optimizer):
        placed.append(optimizer)
        place(optimizer)

    masters_module.place_steps = checkpoint_module.place_steps = placing
    sizes, fp32 = (2, 2, 1, 1), precision("cpu")
    ckpt = Checkpointer(run_dir, Grid.build(sizes))
    keys, saved = [], {}
    for i, (policy, shard) in enumerate([(fp32, False), (BF16, True), (fp32, False)]):
        grid, model, weights = build_model(1, sizes, OVERLAPS, CFG)
        opt = build_optimizer(model, LR, 0.1, shard=grid if shard else None, policy=policy)
        if i > 0:
            path = ckpt.run_dir / "checkpoints" / f"step_{i:07d}"
            placed.clear()
            assert ckpt.load(model, opt, path) == i
            assert placed and placed[-1] is opt, type(opt).__name__
            masters = _masters(opt, model)
            for name, p in model.named_parameters():
                assert torch.equal(masters[name], saved[name]), f"{policy.params} {name}"
                assert torch.equal(p.detach(), saved[name].to(p.dtype)), f"{policy.params} {name}"
        _train(model, opt, grid, 1, [(i, batches()[i])])
        saved = _masters(opt, model)
        ckpt.save(model, opt, i + 1)
        ckpt.wait()
        state = ckpt._state(model, opt, i + 1)
        keys.append({k: v.dtype for k, v in state.items() if isinstance(v, torch.Tensor)})
    assert keys[0] == keys[1] == keys[2] and keys[1]["model.tok_embeddings.weight"] == torch.float32
    ckpt.close()


CASES = [  # (G_pipe, grid, sharded optimizer, grad_reduce, residual stream, variant)
    (1, (4, 1, 1, 1), False, "fp32", "bf16", None),
    (1, (2, 2, 1, 1), True, "bf16", "bf16", None),
    (1, (1, 1, 2, 2), False, "fp32", "bf16", None),
    (1, (2, 2, 1, 1, 1), True, "fp32", "bf16", None),
    (2, (2, 1, 1, 1, 1), False, "bf16", "bf16", None),
    (1, (2, 1, 2, 1), False, "fp32", "bf16", ("selective", True)),  # sequence parallelism
    (1, (1, 2, 1, 1, 2), False, "fp32", "bf16", ("full", False)),
    (1, (1, 1, 2, 2), False, "fp32", "fp32", None),  # --residual-dtype fp32
]


def test_bf16_weights_with_fp32_masters_match_reference(reference, tmp_path):
    run_distributed(master_runs, 4, 4, reference, CASES, tmp_path / "run")


def moe_reference_run(cfg) -> tuple:
    """The plain MoE model under ``BF16``, micro-batches of ``MICRO``, differentiating
    ``lm + aux`` as :func:`tetrad.train.step.train_step_losses` does: ``((lm loss, aux loss,
    norm) per step, the final fp32 masters)``."""
    assert cfg.vocab_size == CFG.vocab_size  # batches() draws from CFG's vocabulary
    model = Reference(cfg)
    init_parameters(model, SEED)
    opt = build_optimizer(model, LR, weight_decay=0.1, policy=BF16)
    curves = []
    for step, batch in enumerate(batches()):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)
        lm = aux = 0.0
        for mb in batch.split(MICRO):
            with autocast(torch.device("cpu"), BF16):
                part = model.loss_sum(mb[:, :-1], mb[:, 1:]) / batch[:, 1:].numel()
                extra = model.aux_loss_sum() / len(batch)
            (part + extra).backward()
            lm, aux = lm + part.item(), aux + extra.item()
        norm = _clip(model)
        opt.step()
        opt.zero_grad()
        for r in biased_routers(model):
            r.update_bias(r.tokens_per_expert.clone())
        curves.append((lm, aux, norm))
    masters = {n: opt.master_of(p).clone() for n, p in model.named_parameters()}
    return curves, masters


def moe_master_runs(name, reference, cases):
    """Train the MoE model ``CONFIGS[name]`` on each ``(sizes, G_expert, sharded optimizer,
    grad_reduce)`` of ``cases`` with bf16 weights and compare each step's LM loss, load-balancing
    loss and gradient norm, the format of every sum over data and expert-data, the residual
    stream's format and the final masters with :func:`moe_reference_run`'s."""
    curves, ref_masters = reference
    for sizes, ep, shard, reduce in cases:
        grid = Grid.build(sizes, expert=ep)
        model = ParallelLlama(CONFIGS[name], grid, "none", OVERLAPS, **OVERLAP_OPTIONS)
        init_parameters(model, SEED, grid)
        assert model.layers["1"].feed_forward.experts.w1.shape[0] == CONFIGS[name].n_experts // ep
        policy = precision("cpu", "bf16", grad_reduce=reduce)
        opt = build_optimizer(model, LR, 0.1, shard=grid if shard else None, policy=policy)
        label = f"{name} grid {sizes} expert {ep} shard {shard} reduce {reduce}"
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, label
        sums, streams = set(), set()
        counts = sum(r.n_experts for r in biased_routers(model))
        with data_sums(grid, sums, counts), _block_outputs(model, streams):
            for step, batch in enumerate(batches()):
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)
                grid.comm.reset()
                got = [float(t) for t in train_step_losses(model, opt, grid, batch, MICRO, CLIP)]
                assert grid.comm.stats(Axis.EXPERT).calls > 0, label  # tokens left their rank
                want = zip(("lm", "aux", "norm"), curves[step], TOLS, strict=True)
                for g, (what, r, tol) in zip(got, want, strict=True):
                    assert abs(g - r) <= tol * r, f"{label} step {step} {what}: {g} vs {r}"
        settle_parameters(opt)
        assert streams == {torch.bfloat16}, f"{label}: residual stream in {streams}"
        assert sums == {torch_dtype(reduce)}, f"{label}: summed over data in {sums}"
        _check_masters(opt, model, grid, ref_masters, label)
        edp = grid.size(Axis.EXPERT_DATA) if shard else 1  # expert states split over it
        for p in model.parameters():
            if p.placement.expert_sharded:
                state = opt.state_of(p)
                want = -(-p.numel() // edp)
                assert state["exp_avg"].numel() == opt.master_of(p).numel() == want, label


TOLS = (LOSS_TOL, LOSS_TOL, NORM_TOL)  # LM loss, load-balancing loss, gradient norm
MOE_CASES = [  # (G_data, G_context, G_z, G_y, G_x), G_expert, sharded optimizer, grad_reduce
    ((4, 1, 1, 1, 1), 2, True, "bf16"),  # experts summed over expert-data (2 ranks)
    ((4, 1, 1, 1, 1), 2, False, "fp32"),
    ((2, 1, 2, 1, 1), 2, True, "fp32"),  # experts split over Z, summed over data
]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_expert_parallel_bf16_weights_match_reference(name):
    run_distributed(moe_master_runs, 4, name, moe_reference_run(CONFIGS[name]), MOE_CASES)


def test_place_steps_puts_a_fused_groups_step_on_its_parameters_device():
    """A checkpoint load fills ``step`` on the host; fused (and capturable) AdamW reads it on
    the parameter's device (a host one fails ``_fused_adamw_`` on CUDA), as torch's own
    ``load_state_dict`` places it. The meta device stands in for a GPU."""
    from types import SimpleNamespace

    from tetrad.parallel.masters import place_steps

    fused, plain = torch.empty(3, device="meta"), torch.empty(3, device="meta")
    host = torch.tensor(7.0, dtype=torch.float64)
    opt = SimpleNamespace(
        param_groups=[{"params": [fused], "fused": True}, {"params": [plain], "fused": False}],
        state={fused: {"step": host}, plain: {"step": host}},
    )
    place_steps(opt)
    moved = opt.state[fused]["step"]
    assert moved.device.type == "meta" and moved.dtype == torch.float32
    assert opt.state[plain]["step"] is host  # foreach/for-loop AdamW keeps it on the host
