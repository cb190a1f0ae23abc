"""What ``tetrad train`` says on rank 0 about its job: the start, a resume, checkpoints and
torch.compile's graphs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tqdm import tqdm

from tetrad.device import device_name
from tetrad.parallel.model import compile_stats
from tetrad.spec.model import ModelSpec
from tetrad.spec.precision import fp8_converts
from tetrad.train.checkpoint_dir import read_meta
from tetrad.train.job import Job
from tetrad.train.peak import Peak
from tetrad.train.resume import restart_count


def print_resume(job: Job, path: Path) -> None:
    """One line for a restart, and one when the checkpoint comes from another grid."""
    meta = read_meta(path) or {}
    saved, turn = meta.get("grid"), meta.get("orientation", "xy")
    if restart_count():
        limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        print(f"tetrad: restart {restart_count()} of {limit}: resuming from {path}")
    grid, pipe = job.grid, meta.get("pipe", 1)
    if saved and ((pipe, *saved) != (grid.pipe, *grid.physical) or turn != grid.orientation):
        fmt = ",".join
        print(
            f"tetrad: resharding {path.name} from grid {fmt(map(str, (pipe, *saved)))} ({turn}) "
            f"to grid {fmt(map(str, (grid.pipe, *grid.physical)))} ({grid.orientation}) "
            "(G_pipe,G_data,G_context,G_z,G_y,G_x)"
        )


def report_save(job: Job, done: tuple[Path, float] | None) -> None:
    """Say on rank 0 that a checkpoint is complete."""
    if done is not None and job.rank0:
        tqdm.write(f"tetrad: checkpoint {done[0]} complete ({done[1]:.2f} s)", file=sys.stdout)


def print_start(job: Job, model_cfg: ModelSpec, start: int) -> None:
    grid, corpus, t = job.grid, job.corpus, job.cfg.training
    size = f"{model_cfg.num_params() / 1e6:.2f}M-parameter"
    if model_cfg.is_moe:
        size += (
            f" ({model_cfg.active_params() / 1e6:.2f}M active, {model_cfg.n_experts} experts, "
            f"top-{model_cfg.top_k})"
        )
    print(
        f"tetrad: {size} Llama on grid {grid} "
        f"({grid.world_size} ranks, {device_name(grid.device)}), {job.cfg.grad_accum} "
        f"micro-batch(es) of {t.micro_batch} per step, {job.meter.tokens} tokens/step"
    )
    print(
        f"tetrad: corpus {corpus.n_files} files, {len(corpus.train):,} train tokens, "
        f"{len(corpus.val):,} val tokens; unigram entropy {corpus.unigram_entropy:.3f} nats"
    )
    fp8 = job.cfg.precision.fp8
    if fp8 != "off":
        n, of = fp8_linears(model_cfg, fp8)
        print(
            f"tetrad: FP8 {fp8} GEMMs (torchao.float8"
            f"{', emulated on the CPU' if grid.device.type != 'cuda' else ''}) in {n} of {of} "
            "block Linears"
            + (
                "; rowwise keeps Linears below its size filter in the compute dtype"
                if n < of
                else ""
            )
        )
    peak = job.meter.peak
    if peak.flops:
        print(f"tetrad: MFU against {peak.flops / 1e9:,.1f} GFLOP/s per rank ({peak.source})")
    if start:
        print(f"tetrad: resumed from step {start}")


def notes(job: Job, first: bool, peak: Peak) -> list[str]:
    """Lines for the log at a logging boundary: torch.compile's graphs after the first steps,
    and the MFU peak when a step raised it above ``peak``."""
    notes = []
    if first and job.cfg.training.compile:
        stats = compile_stats()
        notes.append(
            f"tetrad: torch.compile: {stats['graphs']} graphs, {stats['graph_breaks']} "
            "graph breaks (at the collectives)"
        )
    if job.meter.peak is not peak:
        notes.append(
            f"tetrad: MFU now against {job.meter.peak.flops / 1e9:,.1f} GFLOP/s per rank "
            "(a step beat the measured peak)"
        )
    return notes


def fp8_linears(model_cfg: ModelSpec, recipe: str) -> tuple[int, int]:
    """``(converted, all)``: the model's block Linears that ``recipe`` runs in FP8
    (:func:`tetrad.spec.precision.fp8_converts`) and all of them: attention's in every block,
    the feed-forward's in the dense blocks (an MoE block's routed experts stay in the compute
    dtype; its shared expert is not counted)."""
    n = total = 0
    dense = model_cfg.n_layers - model_cfg.moe_layers
    for lin in model_cfg.linears():
        blocks = (model_cfg.n_layers if lin.name in ("wqkv", "wo") else dense) * lin.count
        total += blocks
        n += blocks * fp8_converts(recipe, lin.out_features, lin.in_features)
    return n, total
