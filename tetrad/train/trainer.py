"""The ``tetrad train`` job: data, model, optimizer, loop, metrics and checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from tetrad.device import (
    device_name,
    gpu_count,
    peak_flops,
    peak_memory_bytes,
    threads_per_rank,
)
from tetrad.grid import Grid
from tetrad.models.config import ModelConfig, check_divisible
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.spec import GiB, MiB, parse_overlaps
from tetrad.train.auto import domino_pays
from tetrad.train.checkpoint import Checkpointer, latest_checkpoint
from tetrad.train.config import ConfigError, TrainConfig
from tetrad.train.data import Corpus, prepare_corpus, sample_batch, val_batches
from tetrad.train.step import build_optimizer, evaluate, lr_at, train_step


def preflight(cfg: TrainConfig) -> tuple[Corpus, ModelConfig]:
    """Everything that can fail before workers start: values, data, tokenizer, model vs grid.

    Tokenises and caches the corpus, so workers only load it.

    Raises:
        ConfigError, DataError, ModelConfigError: one-line messages saying what to change.
    """
    cfg.check()
    if cfg.device == "cuda" and not gpu_count():
        raise ConfigError("--device cuda but no CUDA device is visible: use --device cpu")
    corpus = prepare_corpus(cfg.data, cfg.tokenizer, cfg.vocab_size, cfg.val_fraction)
    model_cfg = cfg.model_config(corpus.vocab_size)
    if model_cfg.vocab_size < corpus.vocab_size:
        raise ConfigError(
            f"model vocab_size={model_cfg.vocab_size} is smaller than the "
            f"tokenizer's {corpus.vocab_size}: raise it or drop it from the model"
        )
    check_divisible(model_cfg, cfg.grid)
    return corpus, model_cfg


def _preflight_on_rank0(cfg: TrainConfig) -> tuple[Corpus, ModelConfig]:
    """Rank 0 prepares the data first; the others then hit the cache. Errors reach every rank."""
    err: list = [None]
    result = None
    if dist.get_rank() == 0:
        try:
            result = preflight(cfg)
        except ValueError as e:
            err = [e]
    dist.broadcast_object_list(err, src=0)
    if err[0] is not None:
        raise err[0]
    return result if result is not None else preflight(cfg)


def train(cfg: TrainConfig) -> dict:
    """Train on this rank (call on every rank, e.g. under ``torchrun``); returns the summary.

    Writes ``RUN_DIR/config.json``, ``RUN_DIR/tokenizer.json``, ``RUN_DIR/metrics.jsonl`` (one
    JSON object per step: ``step, loss, lr, grad_norm, tokens_per_s, tokens_per_s_per_rank,
    mfu, peak_memory_bytes, step_time_s`` and ``val_loss`` where validation ran) and
    checkpoints under ``RUN_DIR/checkpoints``.
    """
    grid = Grid.build(cfg.grid, cfg.device)
    if grid.device.type == "cpu":
        torch.set_num_threads(threads_per_rank(grid.world_size))
    rank0 = dist.get_rank() == 0
    corpus, model_cfg = _preflight_on_rank0(cfg)
    run_dir = Path(cfg.run_dir)

    overlaps = parse_overlaps(cfg.overlap)
    if "domino" in overlaps and not domino_pays(cfg, model_cfg):
        overlaps -= {"domino"}
        if rank0:
            print(
                f"tetrad: the planner predicts no gain from the Domino split on "
                f"{cfg.machine}: left off"
            )
    model = ParallelLlama(
        model_cfg,
        grid,
        cfg.activation_checkpointing,
        overlaps,
        bucket_bytes=int(cfg.dp_bucket_mb * MiB),
        domino_min_rows=cfg.domino_min_rows,
    )
    init_parameters(model, cfg.seed, grid)
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    ckpt = Checkpointer(run_dir, grid)
    start = 0
    latest = latest_checkpoint(run_dir) if cfg.resume else None
    if latest is not None:
        start = ckpt.load(model, optimizer, latest)
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        meta = dataclasses.asdict(cfg) | {"model_config": dataclasses.asdict(model_cfg)}
        (run_dir / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        shutil.copyfile(corpus.tokenizer_path, run_dir / "tokenizer.json")
        if start == 0:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)

    tokens_per_step = cfg.global_batch * cfg.seq_len
    flops_per_step = model_cfg.flops_per_token(cfg.seq_len) * tokens_per_step
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", grid.world_size))
    peak = [cfg.peak_flops]
    if not peak[0]:  # measured by one rank while the others wait, then shared
        if rank0:
            peak = [peak_flops(grid.device, local_world)]
        dist.broadcast_object_list(peak, src=0)
    peak = peak[0]
    val = val_batches(corpus.val, cfg.val_batches, cfg.global_batch, cfg.seq_len)
    if rank0:
        print(
            f"tetrad: {model_cfg.num_params() / 1e6:.2f}M-parameter Llama on grid {grid} "
            f"({grid.world_size} ranks, {device_name(grid.device)}), {cfg.grad_accum} "
            f"micro-batch(es) of {cfg.micro_batch} per step, {tokens_per_step} tokens/step"
        )
        print(
            f"tetrad: corpus {corpus.n_files} files, {len(corpus.train):,} train tokens, "
            f"{len(corpus.val):,} val tokens; unigram entropy {corpus.unigram_entropy:.3f} nats"
        )
        if start:
            print(f"tetrad: resumed from step {start}")

    profiler = StepProfiler(cfg.profile_range(), run_dir, grid.device, rank0)
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        disable=not (rank0 and sys.stderr.isatty()),
        unit="step",
        dynamic_ncols=True,
    )
    metrics_file = (run_dir / "metrics.jsonl").open("a") if rank0 else None
    t_start, val_loss, loss = time.perf_counter(), float("nan"), float("nan")
    for step in range(start, cfg.steps):
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(corpus.train, step, cfg.global_batch, cfg.seq_len, cfg.seed)
        done = step + 1
        profiler.before(done)
        grid.comm.reset()
        model.overlap.counts.clear()
        t0 = time.perf_counter()
        loss, grad_norm = train_step(model, optimizer, grid, batch, cfg.micro_batch, cfg.grad_clip)
        dt = time.perf_counter() - t0
        comm = grid.comm.reset()
        profiler.after(done)
        row = {
            "step": done,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / dt,
            "tokens_per_s_per_rank": tokens_per_step / dt / grid.world_size,
            "mfu": flops_per_step / dt / (peak * grid.world_size) if peak else 0.0,
            "peak_memory_bytes": peak_memory_bytes(grid.device),
            "step_time_s": dt,
            "comm_bytes": {a: s.bytes for a, s in comm.items()},
            "comm_time_s": {a: s.time_s for a, s in comm.items()},
            "comm_exposed_s": {a: s.exposed_s for a, s in comm.items()},
            "overlaps_ran": dict(model.overlap.counts),
        }
        if done % cfg.val_every == 0 or done == cfg.steps:
            model.eval()
            val_loss = row["val_loss"] = evaluate(model, grid, val, cfg.micro_batch)
            model.train()
        if rank0:
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1)
            if done % cfg.log_every == 0 or done == cfg.steps or "val_loss" in row:
                bar.write(_log_line(row), file=sys.stdout)
        if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps:
            path = ckpt.save(model, optimizer, done)
            if rank0:
                bar.write(f"tetrad: checkpoint {path}")
    bar.close()
    profiler.close()
    summary = {
        "steps": cfg.steps,
        "final_loss": loss,
        "final_val_loss": val_loss,
        "unigram_entropy": corpus.unigram_entropy,
        "wall_time_s": time.perf_counter() - t_start,
        "run_dir": str(run_dir),
    }
    if rank0:
        metrics_file.close()
        print(
            "tetrad: done: "
            + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _log_line(row: dict) -> str:
    val = f" val_loss {row['val_loss']:.4f}" if "val_loss" in row else ""
    exposed = sum(row["comm_exposed_s"].values()) / row["step_time_s"]
    return (
        f"step {row['step']:>6} | loss {row['loss']:.4f}{val} | lr {row['lr']:.2e} | "
        f"{row['tokens_per_s']:,.0f} tok/s ({row['tokens_per_s_per_rank']:,.0f}/rank) | "
        f"MFU {100 * row['mfu']:.1f}% | mem {row['peak_memory_bytes'] / GiB:.2f} GiB | "
        f"comm exposed {100 * exposed:.0f}%"
    )


class StepProfiler:
    """``torch.profiler`` over steps ``A..B`` (1-based); rank 0 writes a Chrome trace
    ``RUN_DIR/trace_steps_A-B.json`` (open it in chrome://tracing or Perfetto)."""

    def __init__(
        self, steps: tuple[int, int] | None, run_dir: Path, device: torch.device, rank0: bool
    ):
        self.steps, self.run_dir, self.rank0, self.prof = steps, run_dir, rank0, None
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.activities = acts

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            self.prof = torch.profiler.profile(activities=self.activities)
            self.prof.__enter__()

    def after(self, step: int) -> None:
        if self.prof is not None and step == self.steps[1]:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        if self.rank0:
            a, b = self.steps
            path = self.run_dir / f"trace_steps_{a}-{b}.json"
            self.prof.export_chrome_trace(str(path))
            print(f"tetrad: profiler trace {path}")
        self.prof = None
