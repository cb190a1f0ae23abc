"""Part (a) of ``benchmarks/gpu_check.py``: equivalence on the grid 1,1,1,1 of a world of one.

Each 3D-parallel layer (Linear with and without transpose and bias, Embedding, RMSNorm, the
vocabulary-parallel cross-entropy) against its ``torch.nn`` equivalent in fp32 and under bf16
autocast, then ``ParallelLlama`` against the fp32 single-process reference Llama with the same
weights after one forward and backward, eager and compiled (``compile_blocks``), in mode
``fp32`` and mode ``trainer`` (:func:`tetrad.train.step.train_step`). Errors are relative:
the loss's ``|a - b| / |b|`` (nats per token) and ``||a - b|| / ||b||`` of each tensor;
tolerances in :data:`TOLERANCES`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.grid import Grid
from tetrad.models.reference import Llama as Reference
from tetrad.parallel import (
    Embedding,
    Linear,
    RMSNorm,
    init_parameters,
    sync_gradients,
    vocab_parallel_cross_entropy,
)
from tetrad.parallel.model import ParallelLlama, compile_blocks, compile_stats
from tetrad.spec.grid import Axis
from tetrad.spec.model import ModelSpec
from tetrad.spec.precision import compute_dtype
from tetrad.spec.presets import PRESETS
from tetrad.train import step as train_step_module

from .common import SEED, say
from .profiles import LayerSizes, Profile


@dataclass(frozen=True)
class Tolerance:
    """Largest accepted errors: ``loss_rel`` relative error of a loss, ``tensor_rel`` relative
    norm ``||a - b|| / ||b||`` of an output or gradient."""

    loss_rel: float
    tensor_rel: float


TOLERANCES = {"fp32": Tolerance(1e-5, 1e-4), "bf16": Tolerance(2e-2, 5e-2)}
"""Per compute precision. fp32: only the order of reductions differs. bf16: ~3 significant
digits per operation, errors grow through the layers (measured: ~1e-2 worst gradient)."""


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16: the trainer's autocast on CUDA (:func:`tetrad.dtypes.autocast`), CPU bf16
    autocast on CPU; fp32: nothing."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if device.type == "cuda":
        return train_step_module.autocast(device)
    return torch.autocast("cpu", dtype=torch.bfloat16)


def rel_norm(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in fp32 (the plain norm when ``expected`` is 0)."""
    a, e = actual.detach().float(), expected.detach().float().to(actual.device)
    diff = (a - e).norm().item()
    ref = e.norm().item()
    return diff / ref if ref else diff


def _load(layer: nn.Module, ref: nn.Module, grid: Grid) -> None:
    """Copy ``ref``'s parameters into ``layer``'s shards (same names)."""
    refs = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(p.placement.shard_of(refs[name], grid))


def _param_grads(layer: nn.Module, ref: nn.Module, grid: Grid) -> dict[str, float]:
    refs = dict(ref.named_parameters())
    return {
        f"{name} grad": rel_norm(p.grad, p.placement.shard_of(refs[name].grad, grid))
        for name, p in layer.named_parameters()
    }


def _compare_dense(
    layer: nn.Module, ref: nn.Module, grid: Grid, x: torch.Tensor, n_out: int, precision: str
) -> dict[str, float]:
    """``layer`` (the 1,1,1,1 grid) against ``ref`` on input ``x [B, S, k]`` (requires grad)
    and a random output weighting ``[B, S, n_out]``: output, input and parameter gradients."""
    r = torch.randn(*x.shape[:-1], n_out, device=x.device)
    y_ref = ref(x)
    (y_ref * r).sum().backward()
    _load(layer, ref, grid)
    xl = x.detach().clone().requires_grad_()
    with autocast_for(grid.device, precision):
        y = layer(xl)
    (y.float() * r).sum().backward()
    sync_gradients(layer, grid)
    errors = {"output": rel_norm(y, y_ref), "input grad": rel_norm(xl.grad, x.grad)}
    return errors | _param_grads(layer, ref, grid)


def check_linear(
    grid: Grid, ls: LayerSizes, precision: str, transpose: bool, bias: bool
) -> dict[str, float]:
    """tetrad Linear ``hidden -> ffn`` against ``nn.Linear``: errors by tensor."""
    dev = grid.device
    torch.manual_seed(0)
    ref = nn.Linear(ls.hidden, ls.ffn, bias=bias, device=dev)
    if bias:
        nn.init.normal_(ref.bias)
    x = torch.randn(ls.batch, ls.seq, ls.hidden, device=dev, requires_grad=True)
    layer = Linear(ls.hidden, ls.ffn, grid, transpose=transpose, bias=bias)
    return _compare_dense(layer, ref, grid, x, ls.ffn, precision)


def check_embedding(grid: Grid, ls: LayerSizes, precision: str) -> dict[str, float]:
    """tetrad Embedding against ``nn.Embedding``: errors by tensor."""
    dev = grid.device
    torch.manual_seed(1)
    ref = nn.Embedding(ls.vocab, ls.hidden, device=dev)
    ids = torch.randint(0, ls.vocab, (ls.batch, ls.seq), device=dev)
    r = torch.randn(ls.batch, ls.seq, ls.hidden, device=dev)
    out_ref = ref(ids)
    (out_ref * r).sum().backward()
    layer = Embedding(ls.vocab, ls.hidden, grid)
    _load(layer, ref, grid)
    with autocast_for(dev, precision):
        out = layer(ids)
    (out.float() * r).sum().backward()
    sync_gradients(layer, grid)
    return {"output": rel_norm(out, out_ref)} | _param_grads(layer, ref, grid)


def check_rmsnorm(grid: Grid, ls: LayerSizes, precision: str) -> dict[str, float]:
    """tetrad RMSNorm against ``nn.RMSNorm``: errors by tensor."""
    dev = grid.device
    torch.manual_seed(3)
    ref = nn.RMSNorm(ls.hidden, eps=1e-5, device=dev)
    nn.init.normal_(ref.weight)
    x = torch.randn(ls.batch, ls.seq, ls.hidden, device=dev, requires_grad=True)
    layer = RMSNorm(ls.hidden, grid, Axis.X, eps=1e-5)
    return _compare_dense(layer, ref, grid, x, ls.hidden, precision)


def check_cross_entropy(grid: Grid, ls: LayerSizes, precision: str) -> dict[str, float]:
    """Vocabulary-parallel cross-entropy against ``F.cross_entropy`` (fp32 logits); in bf16
    the logits are given in bf16, as the bf16 LM head produces them."""
    dev, v = grid.device, ls.vocab
    torch.manual_seed(2)
    logits = torch.randn(ls.batch, ls.seq, v, device=dev, requires_grad=True)
    targets = torch.randint(0, v, (ls.batch, ls.seq), device=dev)
    w = torch.rand(ls.batch, ls.seq, device=dev)
    ref = F.cross_entropy(logits.view(-1, v), targets.view(-1), reduction="none")
    ref = ref.view(ls.batch, ls.seq)
    (ref * w).sum().backward()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    ll = logits.detach().to(dtype).requires_grad_()
    with autocast_for(dev, precision):
        loss = vocab_parallel_cross_entropy(ll, targets, grid, Axis.Y)
    (loss * w).sum().backward()
    return {"token losses": rel_norm(loss, ref), "logits grad": rel_norm(ll.grad, logits.grad)}


def layer_checks(grid: Grid, ls: LayerSizes, precisions: tuple[str, ...]) -> list[dict]:
    """Every layer check in every precision: records with the errors, the worst and the verdict
    against :data:`TOLERANCES` (``tensor_rel``)."""
    checks: list[tuple[str, Callable[[str], dict[str, float]]]] = [
        (
            f"Linear(transpose={t}, bias={b})",
            lambda p, t=t, b=b: check_linear(grid, ls, p, t, b),
        )
        for t in (False, True)
        for b in (False, True)
    ]
    checks += [
        ("Embedding", lambda p: check_embedding(grid, ls, p)),
        ("RMSNorm", lambda p: check_rmsnorm(grid, ls, p)),
        ("vocab_parallel_cross_entropy", lambda p: check_cross_entropy(grid, ls, p)),
    ]
    out = []
    for precision in precisions:
        tol = TOLERANCES[precision].tensor_rel
        for name, fn in checks:
            errors = fn(precision)
            worst = max(errors, key=lambda k: errors[k])
            out.append(
                {
                    "check": name,
                    "precision": precision,
                    "errors": errors,
                    "worst": errors[worst],
                    "worst_tensor": worst,
                    "tolerance": tol,
                    "passed": errors[worst] <= tol,
                }
            )
    return out


class _CaptureGrads:
    """Stands in for the optimizer of :func:`tetrad.train.step.train_step`: ``step`` keeps a
    copy of every gradient (after synchronisation), nothing is updated."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}

    def step(self) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model.parameters():
            p.grad = None


def reference_run(cfg: ModelSpec, batch: torch.Tensor, device: torch.device) -> dict:
    """The fp32 single-process reference: loss (nats per token), gradients, gradient norm."""
    ref = Reference(cfg)
    init_parameters(ref, SEED)
    ref.to(device)
    b = batch.to(device)
    loss = ref.loss_sum(b[:, :-1], b[:, 1:]) / b[:, 1:].numel()
    loss.backward()
    grads = {n: p.grad.detach() for n, p in ref.named_parameters()}
    norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))
    return {"loss": loss.item(), "grads": grads, "grad_norm": norm}


def parallel_run(grid: Grid, cfg: ModelSpec, batch: torch.Tensor, mode: str, compiled: bool):
    """ParallelLlama (``init_parameters`` of :data:`SEED`) on one batch: ``(loss, gradient
    norm or None, model, gradients by name)``. Mode ``fp32``: one forward/backward without
    autocast; ``trainer``: :func:`tetrad.train.step.train_step` with two micro-batches and no
    clipping."""
    model = ParallelLlama(cfg, grid)
    init_parameters(model, SEED, grid)
    if compiled:
        compile_blocks(model)
    cap = _CaptureGrads(model)
    if mode == "trainer":
        loss, norm = train_step_module.train_step(
            model, cap, grid, batch, batch.shape[0] // 2, grad_clip=0.0
        )
        return float(loss), float(norm), model, cap.grads
    b = batch.to(grid.device)
    model.overlap.begin_micro_batch(last=True)
    loss = model.loss_sum(b[:, :-1], b[:, 1:]) / b[:, 1:].numel()
    loss.backward()
    model.overlap.end_micro_batch()
    sync_gradients(model, grid, model.overlap.buckets.reduced)
    cap.step()
    return loss.item(), None, model, cap.grads


def model_check(
    grid: Grid, cfg: ModelSpec, batch: torch.Tensor, ref: dict, mode: str, compiled: bool
) -> dict:
    """One ParallelLlama-vs-reference comparison: loss, gradient-norm and gradient errors and
    the verdict against :data:`TOLERANCES` of the mode's precision."""
    precision = "fp32" if mode == "fp32" else compute_dtype(grid.device.type)
    t0 = time.perf_counter()
    loss, norm, model, grads = parallel_run(grid, cfg, batch, mode, compiled)
    num = den = 0.0
    worst, worst_name = -1.0, ""
    for name, p in model.named_parameters():
        expected = p.placement.shard_of(ref["grads"][name], grid)
        err = rel_norm(grads[name], expected)
        num += ((grads[name].float() - expected.float()).norm().item()) ** 2
        den += expected.float().norm().item() ** 2
        if math.isnan(err) or err > worst:  # a NaN stays the worst
            worst, worst_name = err, name
    tol = TOLERANCES[precision]
    loss_rel = abs(loss - ref["loss"]) / abs(ref["loss"])
    norm_rel = None if norm is None else abs(norm - ref["grad_norm"]) / ref["grad_norm"]
    return {
        "check": "ParallelLlama vs reference Llama",
        "mode": mode,
        "precision": precision,
        "compiled": compiled,
        "loss": loss,
        "reference_loss": ref["loss"],
        "loss_rel": loss_rel,
        "grad_norm_rel": norm_rel,
        "grad_rel_norm_global": math.sqrt(num / den),
        "grad_rel_norm_worst": worst,
        "worst_param": worst_name,
        "tolerance": dataclasses.asdict(tol),
        "seconds": time.perf_counter() - t0,
        "passed": loss_rel <= tol.loss_rel
        and worst <= tol.tensor_rel
        and (norm_rel is None or norm_rel <= tol.tensor_rel),
    }


def model_checks(grid: Grid, prof: Profile) -> dict:
    """ParallelLlama against the reference: modes fp32 and trainer, eager and compiled (on CPU
    the compiled check runs the trainer mode only, which is fp32 there)."""
    cfg = PRESETS[prof.check_model]
    gen = torch.Generator().manual_seed(SEED)
    batch = torch.randint(0, cfg.vocab_size, (prof.check_batch, prof.check_seq + 1), generator=gen)
    ref = reference_run(cfg, batch, grid.device)
    runs = [("fp32", False), ("trainer", False), ("trainer", True)]
    if grid.device.type == "cuda":
        runs.insert(2, ("fp32", True))
    records = []
    for mode, compiled in runs:
        say(f"(a) model check: mode {mode}{', compiled' if compiled else ''}")
        rec = model_check(grid, cfg, batch, ref, mode, compiled)
        records.append(
            rec | {"model": prof.check_model, "batch": prof.check_batch, "seq_len": prof.check_seq}
        )
    return {"runs": records, "compile_stats": compile_stats()}


def equivalence_part(grid: Grid, prof: Profile) -> dict:
    """Part (a): the layer checks (fp32 and bf16), the model checks, with the tolerances, and
    the resume checks (:mod:`gpu.resume`)."""
    from .resume import resume_checks

    say("(a) layer checks")
    layers = layer_checks(grid, prof.layers, ("fp32", "bf16"))
    models = model_checks(grid, prof)
    resume = resume_checks(grid, prof)
    passed = all(r["passed"] for r in layers + models["runs"] + resume)
    tol = {k: dataclasses.asdict(v) for k, v in TOLERANCES.items()}
    return {"tolerances": tol, "layers": layers, **models, "resume": resume, "passed": passed}
