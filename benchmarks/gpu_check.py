"""One-GPU acceptance check of tetrad: equivalence, throughput, memory and step-time prediction.

On a machine with one GPU (about 5 minutes, at most 10; tetrad run from the checkout)::

    PYTHONPATH=. python benchmarks/gpu_check.py [--out runs/gpu_check] [--steps 20]

On CPU, as a smoke test with tiny sizes (about a minute; ``tests/test_gpu_check.py`` runs it)::

    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check

(a) **Equivalence**, in this process on a world-size-1 process group (NCCL on CUDA, gloo on
    CPU) and the grid 1,1,1,1. Each 3D-parallel layer (Linear with and without transpose and
    bias, Embedding, RMSNorm, the vocabulary-parallel cross-entropy) against its ``torch.nn``
    equivalent (output, input gradient, parameter gradients), in fp32 and under bf16 autocast.
    Then ``ParallelLlama`` against the single-process reference Llama with the same weights
    (``init_parameters`` of one seed) after one forward and backward, eager and with
    ``compile_blocks`` (torch.compile per block): mode ``fp32`` (no autocast) and mode
    ``trainer`` (``tetrad.train.step.train_step`` as the trainer runs it, two micro-batches:
    bf16 autocast on CUDA, fp32 on CPU), both against the fp32 reference. Errors: the relative
    error of the loss (nats per token) and the relative norm ``||a - b|| / ||b||`` of every
    output and gradient, the worst parameter counted. Tolerances (:data:`TOLERANCES`): fp32
    loss 1e-5, tensors 1e-4; bf16 (about 3 significant digits) loss 2e-2, tensors 5e-2.
(b) **Training**: ``python -m tetrad.cli train`` of ``--model`` (CUDA: ``llama-1b``, bf16, seq
    2048) for ``--steps`` steps, eager and ``--compile``; the micro-batch is the largest of
    1, 2, 4, 8, 16 that ``tetrad memory --method tetrad`` predicts to fit (<= 80% of this GPU's
    memory), the global batch two micro-batches. From ``RUN_DIR/metrics.jsonl``: medians of
    tokens/s, MFU (against the datasheet bf16 peak on CUDA) and step time over the steps after
    the first logging interval (it holds torch.compile's compilation), and the peak memory
    (``torch.cuda.max_memory_allocated``). Steps 17-18 run under ``--profile-steps``; the
    report adds each run's device time by kernel category (:mod:`tetrad.train.trace`). Each
    run's whole output is kept in ``OUT/train_<variant>.log``; its checkpoints and trace are
    deleted.
(c) **Memory**: the planner's predicted peak (``tetrad memory``) against the measured one.
(d) **Step time**: ``tetrad calibrate --quick`` writes a machine file (it needs two ranks, so on
    a one-GPU machine it fails and the machine preset stands in: said in the output); the
    planner's predicted step time (``tetrad.plan.comm.estimate``) on the calibrated machine, on
    the preset with this device's compute measured in-process
    (``tetrad.calibrate.measure.measure_compute``, the quick set) and on the bare preset,
    against the measured median step time.
(e) ``OUT/gpu_check.json`` (every figure), ``OUT/gpu_check.md`` (the table, also printed).

Exit status 0 when every check passed and every part ran; 1 otherwise. Standard library, torch
and tetrad only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import io
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tetrad

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tetrad.device import cpu_cores, device_name, total_memory_bytes
from tetrad.grid import Grid, backend_for
from tetrad.models.config import PRESETS, ModelConfig, parse_model
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
from tetrad.plan.machine.description import Machine, get_machine
from tetrad.plan.question import StepQuestion
from tetrad.plan.step_time import estimate
from tetrad.spec import DTYPE_BYTES, Axis, GiB, compute_dtype
from tetrad.train import step as train_step_module
from tetrad.train.metrics import read_rows

REPO = Path(__file__).resolve().parents[1]
SEED = 1234
GRID = (1, 1, 1, 1)
PRESET_FALLBACK = "dgx-h100"
GPU_PRESETS = {"H200": "h200-node", "H100": "dgx-h100", "A100": "dgx-a100-80gb"}
T = TypeVar("T")


@dataclass(frozen=True)
class Tolerance:
    """Largest accepted errors: ``loss_rel`` relative error of a loss, ``tensor_rel`` relative
    norm ``||a - b|| / ||b||`` of an output or gradient."""

    loss_rel: float
    tensor_rel: float


TOLERANCES = {"fp32": Tolerance(1e-5, 1e-4), "bf16": Tolerance(2e-2, 5e-2)}
"""Per compute precision. fp32: only the order of reductions differs. bf16: ~3 significant
digits per operation, errors grow through the layers (measured: ~1e-2 worst gradient)."""


@dataclass(frozen=True)
class LayerSizes:
    """Shapes of the layer checks: ``batch x seq`` tokens, ``hidden -> ffn`` Linear, ``vocab``."""

    batch: int
    seq: int
    hidden: int
    ffn: int
    vocab: int


@dataclass(frozen=True)
class Profile:
    """The sizes and limits of one device (seconds for the time limits)."""

    model: str
    seq_len: int
    steps: int
    log_every: int
    warmup: int
    micro_batches: tuple[int, ...]
    check_model: str
    check_batch: int
    check_seq: int
    layers: LayerSizes
    data: tuple[str, ...]
    bpe_vocab: int | None
    budget_s: float
    run_timeout_s: float
    profile_steps: tuple[int, int]


PROFILES = {
    "cuda": Profile(
        model="llama-1b,vocab_size=32768",
        seq_len=2048,
        steps=20,
        log_every=5,
        warmup=5,
        micro_batches=(1, 2, 4, 8, 16),
        check_model="medium",
        check_batch=4,
        check_seq=512,
        layers=LayerSizes(batch=4, seq=256, hidden=1024, ffn=2816, vocab=8192),
        data=(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py"),),  # ~7 MB
        bpe_vocab=None,
        budget_s=330.0,
        run_timeout_s=170.0,
        profile_steps=(17, 18),
    ),
    "cpu": Profile(
        model="tiny,vocab_size=512",
        seq_len=64,
        steps=20,
        log_every=5,
        warmup=2,
        micro_batches=(1, 2, 4),
        check_model="tiny",
        check_batch=4,
        check_seq=64,
        layers=LayerSizes(batch=4, seq=16, hidden=64, ffn=128, vocab=256),
        data=(str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py"),),  # ~50 KB
        bpe_vocab=512,
        budget_s=300.0,
        run_timeout_s=150.0,
        profile_steps=(17, 18),
    ),
}
"""CUDA: the real check. CPU: tiny sizes, a small corpus, every code path in about a minute."""


def say(msg: str) -> None:
    """One progress line on stdout."""
    print(f"gpu_check: {msg}", flush=True)


def guarded(errors: dict[str, str], part: str, fn: Callable[[], T]) -> T | None:
    """``fn()``, or None after recording its exception under ``errors[part]`` (one failing part
    must not hide the figures of the others)."""
    try:
        return fn()
    except Exception as e:
        errors[part] = "".join(traceback.format_exception(e)[-3:]).strip()
        say(f"{part} failed: {e!r}")
        return None


@contextlib.contextmanager
def timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Record the seconds of the ``with`` body under ``timings[key]``."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        timings[key] = time.monotonic() - t0


# ---- (a) equivalence ---------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def world_of_one(device_type: str) -> Iterator[Grid]:
    """A world-size-1 process group in this process (NCCL on CUDA, gloo on CPU) and the grid
    1,1,1,1 over it; destroyed on exit."""
    if device_type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend_for(device_type),
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    try:
        yield Grid.build(GRID, device_type)
    finally:
        dist.destroy_process_group()


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16: the trainer's autocast on CUDA (:func:`tetrad.train.step.autocast`), CPU bf16
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
            p.copy_(refs[name][p.placement.local_slices(grid)])


def _param_grads(layer: nn.Module, ref: nn.Module, grid: Grid) -> dict[str, float]:
    refs = dict(ref.named_parameters())
    return {
        f"{name} grad": rel_norm(p.grad, refs[name].grad[p.placement.local_slices(grid)])
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


def reference_run(cfg: ModelConfig, batch: torch.Tensor, device: torch.device) -> dict:
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


def parallel_run(grid: Grid, cfg: ModelConfig, batch: torch.Tensor, mode: str, compiled: bool):
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
    grid: Grid, cfg: ModelConfig, batch: torch.Tensor, ref: dict, mode: str, compiled: bool
) -> dict:
    """One ParallelLlama-vs-reference comparison: loss, gradient-norm and gradient errors and
    the verdict against :data:`TOLERANCES` of the mode's precision."""
    precision = "fp32" if mode == "fp32" else compute_dtype(grid.device.type)
    t0 = time.perf_counter()
    loss, norm, model, grads = parallel_run(grid, cfg, batch, mode, compiled)
    num = den = 0.0
    worst, worst_name = -1.0, ""
    for name, p in model.named_parameters():
        expected = ref["grads"][name][p.placement.local_slices(grid)]
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


def measure_compute_figures(device: torch.device) -> dict:
    """This device's compute measured as ``tetrad calibrate --quick`` measures it (GEMMs,
    memory copy, attention; :func:`tetrad.calibrate.measure.measure_compute`), turned into the
    machine file's compute figures (``memory_gib`` GiB, ``peak_tflops`` TFLOP/s, ``hbm_gbps``
    GB/s, ``compute``) by :func:`tetrad.calibrate.describe.compute_figures`. Call inside a
    process group."""
    from tetrad.calibrate.describe import Run, compute_figures
    from tetrad.calibrate.measure import measure_compute
    from tetrad.calibrate.settings import settings

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    comp = measure_compute(device, dtype, settings(device.type, quick=True))
    run = Run(device, "in-process", True, 1, 1, cpu_cores(), torch.get_num_threads())
    figures, sources = compute_figures(run, comp, device_name(device), "gpu_check in-process")
    return {"figures": figures, "sources": sources}


def equivalence_part(grid: Grid, prof: Profile) -> dict:
    """Part (a): the layer checks (fp32 and bf16) and the model checks, with the tolerances."""
    say("(a) layer checks")
    layers = layer_checks(grid, prof.layers, ("fp32", "bf16"))
    models = model_checks(grid, prof)
    passed = all(r["passed"] for r in layers + models["runs"])
    tol = {k: dataclasses.asdict(v) for k, v in TOLERANCES.items()}
    return {"tolerances": tol, "layers": layers, **models, "passed": passed}


def in_process_part(args: argparse.Namespace, prof: Profile, errors: dict[str, str]) -> dict:
    """Part (a) and the in-process compute measurement of part (d), in one world-of-one group;
    frees the device memory afterwards. Keys ``equivalence`` and ``compute_figures`` (None
    when that part raised)."""
    out: dict = {}
    torch.set_float32_matmul_precision("highest")  # fp32 checks: no TF32
    with world_of_one(args.device) as grid:
        if not args.skip_equivalence:
            out["equivalence"] = guarded(
                errors, "equivalence", lambda: equivalence_part(grid, prof)
            )
        say("(d) measuring this device's compute in-process (calibrate's quick set)")
        out["compute_figures"] = guarded(
            errors, "compute measurement", lambda: measure_compute_figures(grid.device)
        )
    torch._dynamo.reset()  # drop the compiled blocks and their caches
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- (b) training, (c) memory ------------------------------------------------------------------


def planner_model_text(model: str) -> str:
    """The runtime's ``--model`` as the planner's sizes (``name=...,hidden=...``)."""
    cfg, _ = parse_model(model)
    s = cfg.spec(model.split(",")[0])
    return (
        f"name={s.name},hidden={s.hidden},n_layers={s.n_layers},n_heads={s.n_heads},"
        f"n_kv_heads={s.n_kv_heads},ffn_hidden={s.ffn_hidden},vocab={s.vocab},"
        f"rope_theta={s.rope_theta}"
    )


def device_memory_bytes(device: str) -> int:
    """This GPU's memory (bytes); on CPU the host's physical memory."""
    if device == "cuda":
        return total_memory_bytes(torch.device("cuda", 0))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_estimate(
    model: str, micro_batch: int, seq_len: int, gpu_bytes: int, recompute: str = "none"
) -> dict:
    """``tetrad memory --method tetrad --grid 1,1,1,1 --activation-checkpointing RECOMPUTE
    ... --json`` (run in this process): the planner's breakdown (bytes) and verdict (``fits``:
    total <= 80% of ``gpu_bytes``)."""
    from tetrad.cli import main as tetrad_main

    argv = ["memory", "--method", "tetrad", "--grid", ",".join(map(str, GRID))]
    argv += ["--model", planner_model_text(model), "--micro-batch", str(micro_batch)]
    argv += ["--activation-checkpointing", recompute]
    argv += ["--seq-len", str(seq_len), "--gpu-memory-gib", f"{gpu_bytes / GiB:.4f}", "--json"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = tetrad_main(argv)
    if rc != 0:
        raise RuntimeError(f"tetrad {shlex.join(argv)} exited with {rc}")
    return json.loads(buf.getvalue())


def choose_micro_batch(args: argparse.Namespace, prof: Profile, gpu_bytes: int) -> dict:
    """The predicted memory of every candidate micro-batch and the largest that fits (or
    ``--micro-batch``)."""
    estimates = {
        mb: memory_estimate(args.model, mb, args.seq_len, gpu_bytes) for mb in prof.micro_batches
    }
    if args.micro_batch and args.micro_batch not in estimates:
        estimates[args.micro_batch] = memory_estimate(
            args.model, args.micro_batch, args.seq_len, gpu_bytes
        )
    fitting = [mb for mb, e in estimates.items() if e["fits"]]
    chosen = args.micro_batch or (max(fitting) if fitting else min(estimates))
    return {"chosen": chosen, "by_micro_batch": estimates, "given": bool(args.micro_batch)}


def train_command(args: argparse.Namespace, prof: Profile, mb: int, run_dir: Path) -> list[str]:
    """The ``tetrad train`` command line of one run (eager; append ``--compile``)."""
    cmd = [sys.executable, "-m", "tetrad.cli", "train", "--model", args.model]
    cmd += ["--device", args.device, "--grid", ",".join(map(str, GRID))]
    cmd += ["--seq-len", str(args.seq_len), "--micro-batch", str(mb), "--global-batch", str(2 * mb)]
    cmd += ["--steps", str(args.steps), "--warmup-steps", str(min(prof.warmup, args.steps))]
    cmd += ["--log-every", str(prof.log_every), "--val-every", str(max(1000, args.steps))]
    a, b = prof.profile_steps
    if b < args.steps:  # a profiled window before the last step (which validates and saves)
        cmd += ["--profile-steps", f"{a}:{b}"]
    cmd += [
        "--val-batches",
        "1",
        "--checkpoint-every",
        "0",
        "--no-resume",
        "--run-dir",
        str(run_dir),
    ]
    for path in prof.data:
        cmd += ["--data", path]
    if prof.bpe_vocab:
        cmd += ["--vocab-size", str(prof.bpe_vocab)]
    return cmd


def subprocess_env() -> dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH`` (tetrad need not be
    installed)."""
    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.environ | {"PYTHONPATH": os.pathsep.join(paths)}


def run_logged(cmd: list[str], log: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run ``cmd`` in its own session with stdout and stderr into ``log``: ``(exit status or
    None after the timeout, wall seconds)``. On a timeout or an interrupt the whole session
    (the command and the workers it started) is killed."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=subprocess_env(),
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, time.perf_counter() - t0


def summarize_metrics(rows: list[dict], log_every: int) -> dict:
    """Medians over the steps after the first logging interval (all steps if there are no
    others): ``tokens_per_s``, ``mfu`` (fraction), ``step_time_s`` (s); the peak memory (bytes),
    the first interval's seconds (torch.compile's compilation included) and the last losses."""
    after = [r for r in rows if r["step"] > log_every] or rows
    first = [r for r in rows if r["step"] <= log_every]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in after)

    return {
        "steps_logged": len(rows),
        "steps_in_median": len(after),
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "step_time_s": median("step_time_s"),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows),
        "first_interval_s": sum(r["step_time_s"] for r in first),
        "final_loss": rows[-1]["loss"],
        "val_loss": rows[-1].get("val_loss"),
    }


def train_run(args: argparse.Namespace, prof: Profile, name: str, mb: int, deadline: float) -> dict:
    """One training run (``name``: ``eager`` or ``compile``): its command, exit status, log,
    the lines about torch.compile and the MFU peak, and :func:`summarize_metrics`."""
    out = Path(args.out)
    run_dir, log = out / f"run_{name}", out / f"train_{name}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = train_command(args, prof, mb, run_dir) + (["--compile"] if name == "compile" else [])
    res: dict = {"command": shlex.join(cmd), "micro_batch": mb, "log": str(log), "ok": False}
    timeout = min(prof.run_timeout_s, deadline - time.monotonic())
    if timeout < 30:
        return res | {"error": "skipped: the time budget is spent"}
    say(f"(b) training {name}, micro-batch {mb} (log {log})")
    rc, wall = run_logged(cmd, log, timeout)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    text = log.read_text(errors="replace")
    lines = text.splitlines()
    res |= {"rc": rc, "wall_s": wall, "oom": "out of memory" in text.lower()}
    res["compile_line"] = next((ln for ln in lines if "tetrad: torch.compile:" in ln), None)
    res["mfu_peak_line"] = next((ln for ln in lines if "tetrad: MFU against" in ln), None)
    summaries = sorted(run_dir.glob("trace_steps_*.txt"))
    res["profile"] = summaries[0].read_text() if summaries else None
    for trace in run_dir.glob("trace_steps_*.json"):
        trace.unlink()  # hundreds of MB; the summary above is what the report keeps
    metrics = run_dir / "metrics.jsonl"
    if rc != 0 or not metrics.is_file():
        why = "timed out" if rc is None else f"exit status {rc}"
        return res | {"error": f"{why}: " + " | ".join(lines[-8:])}
    rows, _ = read_rows(metrics)
    return res | {"ok": bool(rows)} | (summarize_metrics(rows, prof.log_every) if rows else {})


def training_part(args: argparse.Namespace, prof: Profile, mb: int, deadline: float) -> dict:
    """Eager then compiled runs; an eager run out of memory is retried with half the
    micro-batch (the compiled run then uses that one)."""
    eager = train_run(args, prof, "eager", mb, deadline)
    retried = []
    while not eager["ok"] and eager.get("oom") and mb > 1:
        retried.append(mb)
        mb //= 2
        say(f"(b) out of memory: retrying with micro-batch {mb}")
        eager = train_run(args, prof, "eager", mb, deadline)
    compiled = train_run(args, prof, "compile", mb, deadline)
    return {
        "micro_batch": mb,
        "out_of_memory_at": retried,
        "runs": {"eager": eager, "compile": compiled},
    }


def memory_part(choice: dict, training: dict | None, gpu_bytes: int) -> dict:
    """Predicted peak of the micro-batch used against the measured peak of each run (ratio
    measured / predicted)."""
    mb = training["micro_batch"] if training else choice["chosen"]
    est = choice["by_micro_batch"][mb]
    out = {
        "micro_batch": mb,
        "predicted_bytes": est["total_bytes"],
        "predicted_peak_phase": est.get("peak_phase"),
        "gpu_memory_bytes": gpu_bytes,
        "predicted_fraction": est["fraction"],
        "fit_fraction": est["fit_fraction"],
        "runs": {},
    }
    for name, run in (training or {}).get("runs", {}).items():
        if run.get("ok"):
            measured = run["peak_memory_bytes"]
            out["runs"][name] = {
                "measured_bytes": measured,
                "ratio": measured / est["total_bytes"],
            }
    return out


# ---- (d) step time -----------------------------------------------------------------------------


def calibrate_part(args: argparse.Namespace, deadline: float) -> dict:
    """``tetrad calibrate --device DEV --quick`` into ``OUT/machine.toml`` (two ranks on CPU;
    on CUDA the default, one rank per visible GPU): the command, exit status and output."""
    path = Path(args.out) / "machine.toml"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tetrad.cli", "calibrate", "--device", args.device, "--quick"]
    cmd += ["--out", str(path)] + (["--nproc", "2"] if args.device == "cpu" else [])
    log = Path(args.out) / "calibrate.log"
    say(f"(d) {shlex.join(cmd[1:])}")
    rc, wall = run_logged(cmd, log, min(300.0, max(30.0, deadline - time.monotonic())))
    lines = log.read_text(errors="replace").splitlines()
    ok = rc == 0 and path.is_file()
    return {
        "command": shlex.join(cmd),
        "rc": rc,
        "wall_s": wall,
        "ok": ok,
        "machine_file": str(path) if ok else None,
        "output_tail": lines[-12:],
    }


def preset_name(device: str) -> str:
    """The machine preset of this GPU (``dgx-h100`` when unknown, and on CPU)."""
    name = device_name(torch.device("cuda", 0)) if device == "cuda" else ""
    return next((m for key, m in GPU_PRESETS.items() if key in name), PRESET_FALLBACK)


def with_measured_compute(preset: Machine, figures: dict) -> Machine:
    """``preset`` with its compute figures (peak, memory, HBM bandwidth, GEMM and attention
    efficiencies) replaced by the ones measured here."""
    table = sorted((float(f), float(e)) for f, e in figures["compute"]["gemm_efficiency"])
    if len(table) == 1:
        table.append((table[0][0] * 10, table[0][1]))
    return dataclasses.replace(
        preset,
        name=f"{preset.name}+measured-compute",
        memory_bytes=int(figures["memory_gib"] * GiB),
        peak_flops=figures["peak_tflops"] * 1e12,
        hbm_bytes_per_s=figures["hbm_gbps"] * 1e9,
        gemm_table=tuple(table),
        attention_efficiency=figures["compute"]["attention_efficiency"],
    )


def predict_step(machine: Machine, args: argparse.Namespace, mb: int) -> dict:
    """The planner's predicted step (seconds) of this run on ``machine``:
    ``tetrad.plan.comm.estimate(Context(model, machine, seq_len, global_batch), grid,
    micro_batch, checkpointing=False)`` with every overlap on, as ``tetrad train`` runs."""
    cfg, _ = parse_model(args.model)
    ctx = StepQuestion(
        cfg.spec(),
        machine,
        args.seq_len,
        2 * mb,
        overlaps="all",
        compute_bytes=DTYPE_BYTES[compute_dtype(args.device)],
    )
    est = estimate(ctx, GRID, mb, False)
    return {
        "step_s": est.step_s,
        "compute_s": est.compute_s,
        "exposed_comm_s": sum(est.exposed_s.values()),
    }


def planner_part(
    args: argparse.Namespace, calib: dict, figures: dict | None, mb: int, training: dict | None
) -> dict:
    """Predicted step time on each machine (calibrated file, preset with measured compute,
    preset) against each run's measured median step (ratio measured / predicted)."""
    preset = get_machine(preset_name(args.device))
    machines = []
    if calib["ok"]:
        machines.append(("calibrated", get_machine(calib["machine_file"])))
    if figures is not None:
        measured = with_measured_compute(preset, figures["figures"])
        machines.append(("preset with compute measured here", measured))
    machines.append(("preset", preset))
    preds = []
    for source, machine in machines:
        p = predict_step(machine, args, mb) | {"machine": machine.name, "source": source}
        p["measured"] = {}
        for name, run in (training or {}).get("runs", {}).items():
            if run.get("ok"):
                ratio = run["step_time_s"] / p["step_s"]
                p["measured"][name] = {"step_time_s": run["step_time_s"], "ratio": ratio}
        preds.append(p)
    notes = []
    if not calib["ok"]:
        notes.append(
            f"tetrad calibrate did not run here ({' '.join(calib['output_tail'][-1:])}): "
            f"fell back to the {preset.name} preset, bare and with this device's compute "
            "measured in-process"
        )
    if figures is None:
        notes.append("the in-process compute measurement failed (see errors)")
    note = "; ".join(notes) or None
    api = (
        "tetrad.plan.comm.estimate.estimate(tetrad.plan.comm.context.Context(...), grid, "
        "micro_batch, False)"
    )
    return {"api": api, "calibrate": calib, "predictions": preds, "note": note}


# ---- (e) report --------------------------------------------------------------------------------


def _e(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2e}"


def _s(x: float) -> str:
    return f"{x:.3g} s"


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def equivalence_rows(eq: dict) -> list[list[str]]:
    """Table rows of part (a)."""
    rows = []
    for r in eq["layers"]:
        rows.append(
            [
                r["check"],
                r["precision"],
                f"worst rel-norm {_e(r['worst'])} ({r['worst_tensor']})",
                f"<= {r['tolerance']:.0e}",
                _verdict(r["passed"]),
            ]
        )
    for r in eq["runs"]:
        tol = r["tolerance"]
        rows.append(
            [
                f"{r['check']} ({r['model']}, {r['batch']}x{r['seq_len']})",
                r["mode"]
                + (f" ({r['precision']})" if r["mode"] != r["precision"] else "")
                + (", compiled" if r["compiled"] else ""),
                f"loss rel {_e(r['loss_rel'])}; grad rel-norm worst "
                f"{_e(r['grad_rel_norm_worst'])} ({r['worst_param']}), all "
                f"{_e(r['grad_rel_norm_global'])}"
                + (
                    f"; grad norm rel {_e(r['grad_norm_rel'])}"
                    if r["grad_norm_rel"] is not None
                    else ""
                ),
                f"loss <= {tol['loss_rel']:.0e}, grads <= {tol['tensor_rel']:.0e}",
                _verdict(r["passed"]),
            ]
        )
    stats = eq["compile_stats"]
    rows.append(
        [
            "torch.compile in-process",
            "compile_blocks",
            f"{stats['graphs']} graphs, {stats['graph_breaks']} graph breaks",
            "",
            "",
        ]
    )
    return rows


def training_rows(result: dict) -> list[list[str]]:
    """Table rows of parts (b) and (c)."""
    tr, mem = result.get("training"), result["memory"]
    rows = [
        [
            "memory estimate (tetrad memory)",
            f"micro-batch {mem['micro_batch']}, seq {result['settings']['seq_len']}",
            f"{_gib(mem['predicted_bytes'])} ({100 * mem['predicted_fraction']:.0f}% of "
            f"{_gib(mem['gpu_memory_bytes'])})",
            f"fits below {100 * mem['fit_fraction']:.0f}%",
            "",
        ]
    ]
    for name, run in (tr or {}).get("runs", {}).items():
        setting = f"{result['settings']['model']}, micro-batch {run['micro_batch']}"
        if not run["ok"]:
            rows.append([f"train {name}", setting, run.get("error", "failed"), "", "FAIL"])
            continue
        measured = (
            f"{run['tokens_per_s']:,.0f} tok/s, MFU {100 * run['mfu']:.1f}%, "
            f"{_s(run['step_time_s'])}/step, peak {_gib(run['peak_memory_bytes'])}, "
            f"first {result['settings']['log_every']} steps {_s(run['first_interval_s'])}"
        )
        if run.get("compile_line"):
            measured += f"; {run['compile_line'].removeprefix('tetrad: ')}"
        rows.append([f"train {name}", setting, measured, "", "ok"])
        m = mem["runs"].get(name)
        if m:
            rows.append(
                [
                    f"memory measured / predicted ({name})",
                    "the run's peak_memory_bytes",
                    f"{_gib(m['measured_bytes'])} / {_gib(mem['predicted_bytes'])} = "
                    f"{m['ratio']:.2f}",
                    "about 1"
                    if result["environment"]["device"] == "cuda"
                    else "none: on CPU the peak is the process's RSS",
                    "",
                ]
            )
    return rows


def planner_rows(pl: dict) -> list[list[str]]:
    """Table rows of part (d)."""
    cal = pl["calibrate"]
    status = "ok" if cal["ok"] else "fallback"
    rows = [
        [
            "tetrad calibrate --quick",
            f"rc {cal['rc']}",
            (pl["note"] or "machine file written"),
            "",
            status,
        ]
    ]
    for p in pl["predictions"]:
        measured = "; ".join(
            f"{name} {_s(m['step_time_s'])} = {m['ratio']:.3g}x predicted"
            for name, m in p["measured"].items()
        )
        rows.append(
            [
                "step time: planner vs measured",
                f"{p['machine']} ({p['source']})",
                f"predicted {_s(p['step_s'])} (compute {_s(p['compute_s'])})"
                + (f"; measured {measured}" if measured else ""),
                "",
                "",
            ]
        )
    return rows


def markdown(result: dict) -> str:
    """The Markdown report: a header and one table of every figure."""
    env = result["environment"]
    head = (
        f"# tetrad gpu_check: {env['device_name']} ({env['device']})\n\n"
        f"torch {env['torch']}, Python {env['python']}, {env['started']}, "
        f"{env['wall_s']:.0f} s; result: {'ok' if result['ok'] else 'PROBLEMS'}\n\n"
    )
    rows = []
    if result.get("equivalence"):
        rows += equivalence_rows(result["equivalence"])
    if result.get("memory"):
        rows += training_rows(result)
    if result.get("planner"):
        rows += planner_rows(result["planner"])
    table = ["| check | setting | measured | expected | result |", "|---|---|---|---|---|"]
    table += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    problems = "".join(f"\n- {p}" for p in result["problems"])
    text = head + "\n".join(table) + ("\n\nProblems:" + problems if problems else "") + "\n"
    for name, run in (result.get("training") or {}).get("runs", {}).items():
        if run.get("profile"):
            text += f"\n## Profile of the {name} run (tetrad.train.trace)\n\n```\n"
            text += run["profile"] + "```\n"
    return text


def problems_of(result: dict) -> list[str]:
    """What failed or did not run (empty: all good)."""
    out = []
    eq = result.get("equivalence")
    if eq is not None:
        out += [
            f"equivalence failed: {r['check']} {r['precision']}"
            for r in eq["layers"]
            if not r["passed"]
        ]
        out += [
            f"equivalence failed: model {r['mode']}{' compiled' if r['compiled'] else ''}"
            for r in eq["runs"]
            if not r["passed"]
        ]
    for name, run in (result.get("training") or {}).get("runs", {}).items():
        if not run["ok"]:
            out.append(f"training {name} failed: {run.get('error')}")
    for part, err in result.get("errors", {}).items():
        out.append(f"{part} raised: {err.splitlines()[-1] if err else ''}")
    return out


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options; the per-device defaults come from :data:`PROFILES`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default="runs/gpu_check", help="output folder")
    p.add_argument("--model", help="tetrad train --model (cuda: llama-1b,vocab_size=32768)")
    p.add_argument("--steps", type=int, help="training steps per run (default 20)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (cuda: 2048)")
    p.add_argument("--micro-batch", type=int, help="skip the choice by the memory planner")
    p.add_argument("--skip-train", action="store_true", help="no training runs")
    p.add_argument("--skip-equivalence", action="store_true", help="no equivalence checks")
    args = p.parse_args(argv)
    prof = PROFILES[args.device]
    args.model = args.model or prof.model
    args.steps = args.steps or prof.steps
    args.seq_len = args.seq_len or prof.seq_len
    args.out = str(Path(args.out).resolve())  # the training runs start in the checkout
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible: use --device cpu")
    return args


def environment(args: argparse.Namespace, started: str) -> dict:
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    return {
        "device": args.device,
        "device_name": device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_cores": cpu_cores(),
        "argv": sys.argv,
        "started": started,
    }


def run_all(args: argparse.Namespace, prof: Profile, deadline: float) -> dict:
    """Parts (a) to (d); the result without the environment. ``timings``: seconds per part;
    ``errors``: the parts that raised (part -> the end of the traceback)."""
    result: dict = {"settings": {"model": args.model, "seq_len": args.seq_len}}
    result["settings"] |= {"steps": args.steps, "log_every": prof.log_every, "grid": GRID}
    timings: dict[str, float] = {}
    errors: dict[str, str] = {}
    result |= {"timings": timings, "errors": errors}
    with timed(timings, "equivalence_and_compute_measurement_s"):
        result |= in_process_part(args, prof, errors)
    gpu_bytes = device_memory_bytes(args.device)
    choice = guarded(
        errors, "micro-batch choice", lambda: choose_micro_batch(args, prof, gpu_bytes)
    )
    if choice is None:
        return result
    result["micro_batch_choice"] = {
        "chosen": choice["chosen"],
        "given": choice["given"],
        "predicted_bytes": {mb: e["total_bytes"] for mb, e in choice["by_micro_batch"].items()},
        "fits": {mb: e["fits"] for mb, e in choice["by_micro_batch"].items()},
    }
    say(f"(b) micro-batch {choice['chosen']} (memory planner, {_gib(gpu_bytes)} device)")
    training = None
    if not args.skip_train:
        with timed(timings, "training_s"):
            training = guarded(
                errors, "training", lambda: training_part(args, prof, choice["chosen"], deadline)
            )
    result["training"] = training
    result["memory"] = memory_part(choice, training, gpu_bytes)
    mb = training["micro_batch"] if training else choice["chosen"]
    with timed(timings, "calibrate_s"):
        calib = calibrate_part(args, deadline)
    figures = result.get("compute_figures")
    result["planner"] = guarded(
        errors, "planner", lambda: planner_part(args, calib, figures, mb, training)
    )
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the check; write ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` and print the
    table. Returns 0 when everything passed and ran."""
    args = parse_args(argv)
    prof = PROFILES[args.device]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    result = run_all(args, prof, t0 + prof.budget_s)
    result["environment"] = environment(args, started) | {"wall_s": time.monotonic() - t0}
    result["problems"] = problems_of(result)
    result["skipped"] = [k for k in ("train", "equivalence") if getattr(args, f"skip_{k}")]
    result["ok"] = not result["problems"]
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    table = markdown(result)
    (out / "gpu_check.md").write_text(table)
    print(table, flush=True)
    say(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
