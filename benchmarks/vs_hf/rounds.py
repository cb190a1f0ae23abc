"""One round of ``benchmarks/vs_transformers.py``: a side's model (tetrad's ``ParallelLlama``
or HF's ``LlamaForCausalLM``) built, warmed up, timed for some steps and freed, and the rounds
of a side pooled (median step seconds, tokens/s, MFU, peak memory bytes)."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tetrad.device import datasheet_flops
from tetrad.grid import Grid
from tetrad.parallel.model import ParallelLlama, compile_blocks
from tetrad.spec.model import ModelSpec
from tetrad.train.step import build_optimizer, train_step

from .llama import build_hf, compile_layers, hf_train_step

LR = 3e-4
"""The learning rate of both sides' AdamW (``tetrad train``'s default peak)."""


WEIGHT_DECAY = 0.1
"""AdamW's weight decay, on matrices only (:func:`tetrad.train.step.build_optimizer`)."""


GRAD_CLIP = 1.0
"""The global gradient norm both sides clip to."""


SEED = 0
"""The seed of the batch (token ids)."""


SIDES = ("tetrad", "hf")


@dataclass(frozen=True)
class Shape:
    """One batch shape: ``seq`` tokens per sample, ``micro_batch`` samples per micro-batch; the
    global batch is two micro-batches."""

    seq: int
    micro_batch: int

    @property
    def global_batch(self) -> int:
        return 2 * self.micro_batch

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.global_batch * self.seq

    def __str__(self) -> str:
        return f"{self.seq}x{self.micro_batch}"


def draw_weights(model: nn.Module) -> None:
    """Matrices normal with std 0.02, vectors (the RMSNorm weights) 1, drawn on their device
    (``init_parameters`` draws on the host, about 30 s per 1e9 parameters)."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)


def n_params(model: nn.Module) -> int:
    """The model's parameter elements (on the grid 1,1,1,1 tetrad's shards are whole)."""
    return sum(p.numel() for p in model.parameters())


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Collect garbage, return the cached blocks and reset the peak statistics."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def step_times(
    step: Callable[[], torch.Tensor], n: int, device: torch.device
) -> tuple[list[float], torch.Tensor]:
    """Run ``step`` ``n`` times: the seconds of each and the last step's loss. On CUDA the
    seconds come from events recorded between the steps (the host is not synchronised between
    them); on CPU from ``time.perf_counter``."""
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            loss = step()
            events[i + 1].record()
        events[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:], strict=False)], loss
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        loss = step()
        out.append(time.perf_counter() - t0)
    return out, loss


def build_side(
    side: str, cfg: ModelSpec, shape: Shape, grid: Grid, compiled: bool
) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The model of ``side`` (``tetrad`` or ``hf``) and its step function ``step() -> loss``
    (a 0-dim tensor, not read) on the global batch of ``shape`` (token ids ``[2 x micro-batch,
    seq + 1]``, the same batch every step). Drop both references to free the model."""
    batch = torch.randint(
        0,
        cfg.vocab_size,
        (shape.global_batch, shape.seq + 1),
        generator=torch.Generator().manual_seed(SEED),
    )
    if side == "tetrad":
        model = ParallelLlama(cfg, grid)  # no recompute
    else:
        model = build_hf(cfg, shape.seq, grid.device)
    draw_weights(model)
    if compiled:
        compile_blocks(model) if side == "tetrad" else compile_layers(model)
    opt = build_optimizer(model, LR, WEIGHT_DECAY)

    def step() -> torch.Tensor:
        if side == "tetrad":
            return train_step(model, opt, grid, batch, shape.micro_batch, GRAD_CLIP)[0]
        return hf_train_step(model, opt, batch, shape.micro_batch, grid.device, GRAD_CLIP)

    return model, step


def allocated_bytes(device: torch.device) -> int | None:
    """Bytes allocated on the GPU now (None on CPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def run_round(
    side: str, cfg: ModelSpec, shape: Shape, grid: Grid, compiled: bool, args: argparse.Namespace
) -> dict:
    """Build ``side``'s model, warm up, time ``args.steps`` steps, free it: seconds of the
    build, the warm-up and each timed step, the first and last losses (nats per token), the
    peak memory (bytes, from before the build; None on CPU) and the bytes allocated before the
    build (0 unless something of the previous round survived)."""
    device = grid.device
    free_memory(device)
    start = allocated_bytes(device)
    t0 = time.perf_counter()
    model, step = build_side(side, cfg, shape, grid, compiled)
    try:
        build_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        first = float(step())
        for _ in range(args.warmup - 1):
            step()
        sync(device)
        warmup_s = time.perf_counter() - t1
        times, loss = step_times(step, args.steps, device)
        last = float(loss)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finally:
        del model, step
        free_memory(device)
    return {
        "build_s": build_s,
        "warmup_s": warmup_s,
        "step_s": times,
        "median_step_s": statistics.median(times),
        "loss_first": first,
        "loss_last": last,
        "peak_memory_bytes": peak,
        "start_allocated_bytes": start,
    }


def side_summary(rounds: list[dict], cfg: ModelSpec, shape: Shape, device: torch.device) -> dict:
    """The rounds of one side pooled: the median step over every timed step (seconds), the
    per-round medians, tokens/s, MFU (fraction; None without a datasheet peak), the peak memory
    (the largest of the rounds, bytes)."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"rounds": rounds, "error": rounds[-1]["error"] if rounds else "not run"}
    median = statistics.median(t for r in ok for t in r["step_s"])
    tokens_per_s = shape.tokens / median
    peak_flops = datasheet_flops(device)
    peaks = [r["peak_memory_bytes"] for r in ok if r["peak_memory_bytes"] is not None]
    return {
        "median_step_s": median,
        "round_medians_s": [r["median_step_s"] for r in ok],
        "tokens_per_s": tokens_per_s,
        "mfu": cfg.flops_per_token(shape.seq) * tokens_per_s / peak_flops if peak_flops else None,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "rounds": rounds,
    }


def guarded_round(
    side: str, cfg: ModelSpec, shape: Shape, grid: Grid, compiled: bool, args: argparse.Namespace
) -> dict:
    """:func:`run_round`, or ``{"error": ...}`` when it raised (out of memory included); the
    run goes on with the next round."""
    try:
        return run_round(side, cfg, shape, grid, compiled, args)
    except Exception as e:  # one failing round must not hide the others
        tail = "".join(traceback.format_exception(e)[-2:]).strip().splitlines()
        kind = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
        error = f"{kind}: {tail[-1][:300] if tail else e!r}"
    free_memory(grid.device)  # here: the exception's frames no longer hold the model
    return {"error": error}
