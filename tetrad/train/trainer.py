"""The ``tetrad train`` job on one rank: data, model, optimizer, loop, metrics, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from collections import Counter

import torch
import torch.distributed as dist
from tqdm import tqdm

from tetrad.data.loader import sample_batch, val_batches
from tetrad.device import cpu_threads, peak_memory_bytes
from tetrad.grid import Grid
from tetrad.models.hf import read_config
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama, compile_blocks
from tetrad.parallel.zero import settle_parameters
from tetrad.pipeline.schedule import Pipeline
from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import FINE_CHUNKS
from tetrad.spec.units import MiB
from tetrad.train.announce import notes, print_resume, print_start, report_save
from tetrad.train.auto import (
    context_pieces,
    domino_pays,
    fine_chunks,
    pipeline_split,
    with_orientation,
)
from tetrad.train.checkpoint import Checkpointer
from tetrad.train.checkpoint_dir import (
    leftovers,
    step_dir,
    tokenizer_hash,
)
from tetrad.train.config import TrainConfig
from tetrad.train.job import Job, Runner, runner
from tetrad.train.metrics import MetricsLog, StepMeter, StepProfiler, log_line
from tetrad.train.peak import mfu_peak
from tetrad.train.preflight import init_from_hf, preflight, preflight_on_rank0
from tetrad.train.resume import (
    restart_count,
    start_checkpoint,
    tetrad_version,
    trim_metrics,
)
from tetrad.train.routing import RoutingWatch, routing_row, sum_routing, take_step_routing
from tetrad.train.step import build_optimizer, lr_at
from tetrad.train.stop import Stopped, StopSignals, signal_name

__all__ = ["build_model", "preflight", "train"]


def build_model(cfg: TrainConfig, model_cfg: ModelSpec, grid: Grid) -> Runner:
    """The initialised parallel Llama (or its pipeline stages) with the configured overlaps, as
    the loop runs it; the Domino split is left off where the planner predicts no gain on
    ``--machine`` (said on rank 0)."""
    par = cfg.parallelism
    overlaps = par.overlaps
    if "domino" in overlaps and not domino_pays(cfg, model_cfg):
        overlaps -= {"domino"}
        if dist.get_rank() == 0:
            print(
                f"tetrad: the planner predicts no gain from the Domino split on {par.machine}: "
                "left off"
            )
    chunks = fine_chunks(cfg, model_cfg)
    if "fine" in overlaps and not chunks:
        overlaps -= {"fine"}
        if dist.get_rank() == 0:
            why = (
                f"the planner predicts no gain on {par.machine}"
                if par.machine
                else "no --machine to predict a gain (name it in --overlap to force it)"
            )
            print(f"tetrad: fine-grained GEMM + reduce-scatter fusion left off: {why}")
    elif chunks and dist.get_rank() == 0:
        print(
            f"tetrad: fine-grained GEMM + reduce-scatter fusion on, {chunks} pieces per ring step"
        )
    kwargs = dict(
        activation_checkpointing=par.activation_checkpointing,
        overlaps=overlaps,
        bucket_bytes=int(par.dp_bucket_mb * MiB),
        domino_min_rows=par.domino_min_rows,
        fine_chunks=chunks or FINE_CHUNKS,
        context_pieces=context_pieces(cfg, model_cfg),
        sequence_parallel=par.sequence_parallel,
        sequence_parallel_regather=par.sequence_parallel_regather,
    )
    if grid.pipe > 1:
        micro_batches = cfg.grad_accum
        schedule, virtual = par.pipeline_schedule, par.virtual_stages
        split = pipeline_split(cfg, model_cfg)
        if split and dist.get_rank() == 0:
            stages = ", ".join(f"{b - a}" for a, b in split)
            whose = "as given" if cfg.parallelism.pipeline_split else "the planner's split"
            print(f"tetrad: pipeline stages of {stages} blocks ({whose})")
        model = Pipeline(model_cfg, grid, schedule, virtual, micro_batches, split, **kwargs)
    else:
        model = ParallelLlama(model_cfg, grid, **kwargs)
    run = runner(model, grid, cfg.training.micro_batch)
    for part in run.parts:
        init_parameters(part, cfg.training.seed, grid)
        if cfg.training.compile:
            compile_blocks(part)
    return run


def train(cfg: TrainConfig) -> dict:
    """Train on this rank (call on every rank, e.g. under ``torchrun``); returns the summary.

    Writes ``RUN_DIR/config.json``, ``RUN_DIR/tokenizer.json``, ``RUN_DIR/metrics.jsonl`` (one
    JSON object per step: see :meth:`tetrad.train.metrics.StepMeter.row`, and ``val_loss``
    where validation ran), with ``--tensorboard`` the same as TensorBoard scalars in
    ``RUN_DIR/tensorboard`` (:class:`tetrad.train.metrics.MetricsLog`), and checkpoints under
    ``RUN_DIR/checkpoints``.
    """
    stop = StopSignals(cfg.checkpoint.save_on_signal)  # first: a signal from now on is kept
    cfg = with_orientation(cfg)
    par = cfg.parallelism
    grid = Grid.build(par.grid, cfg.training.device, par.orientation, par.pipe, par.expert_parallel)
    if grid.device.type == "cpu":
        torch.set_num_threads(cpu_threads(grid.world_size))
    corpus, model_cfg = preflight_on_rank0(cfg)
    model = build_model(cfg, model_cfg, grid)
    t = cfg.training
    weights = model.weights
    path = start_checkpoint(cfg)
    if path is None and cfg.hf_folder is not None:  # before the optimizer copies the masters
        init_from_hf(weights, grid, cfg.hf_folder)
    shard = grid if par.shard_optimizer else None
    betas = (t.beta1, t.beta2)
    optimizer = build_optimizer(
        weights, t.lr, t.weight_decay, betas, shard=shard, policy=cfg.policy
    )
    tokens = t.global_batch * t.seq_len
    peak = mfu_peak(cfg, model_cfg, grid)
    meter = StepMeter(tokens, model_cfg.flops_per_token(t.seq_len) * tokens, peak, grid.world_size)
    ck = cfg.checkpoint
    meta = {
        "tetrad_version": tetrad_version(),
        "grid": list(grid.physical),
        "pipe": grid.pipe,
        "orientation": grid.orientation,
        "model_config": dataclasses.asdict(model_cfg),
        "tokenizer_sha256": tokenizer_hash(corpus.tokenizer_path),
        "data": {"seed": t.seed, "global_batch": t.global_batch, "seq_len": t.seq_len},
    }
    background = ck.async_save == "on" or (ck.async_save == "auto" and grid.device.type == "cuda")
    ckpt = Checkpointer(ck.run_dir, grid, meta=meta, keep_last=ck.keep_last, async_save=background)
    job = Job(cfg, grid, corpus, model, optimizer, ckpt, meter, dist.get_rank() == 0, stop)
    start = ckpt.load(weights, optimizer, path) if path is not None else 0
    if job.rank0:
        _write_run_files(job, model_cfg, start)
        print_start(job, model_cfg, start)
        if path is not None:
            print_resume(job, path)
        for old in leftovers(job.run_dir):
            print(f"tetrad: ignoring {old}: a save a crash interrupted (removed at the next save)")
    t_start = time.perf_counter()
    try:
        loss, val_loss = _loop(job, start)
    except Stopped as e:
        _stopped(job, e)
        raise
    finally:
        stop.close()
    report_save(job, ckpt.close())
    summary = {
        "steps": t.steps,
        "final_loss": loss,
        "final_val_loss": val_loss,
        "unigram_entropy": corpus.unigram_entropy,
        "wall_time_s": time.perf_counter() - t_start,
        "run_dir": str(job.run_dir),
    }
    if job.rank0:
        done = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items())
        print("tetrad: done: " + ", ".join(done))
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _stopped(job: Job, e: Stopped) -> None:
    """After the checkpoint of a signal's stop: the line and ``RUN_DIR/logs/stopped.json``
    (read by the launcher) on rank 0, then the process group's end."""
    if job.rank0:
        print(str(e), flush=True)
        record = {"signal": signal_name(e.signum), "step": e.step, "checkpoint": e.checkpoint}
        logs = job.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "stopped.json").write_text(json.dumps(record) + "\n")
    job.ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


def _write_run_files(job: Job, model_cfg: ModelSpec, start: int) -> None:
    """``config.json`` (the sections and the resolved ``model_config``), ``tokenizer.json``;
    ``metrics.jsonl`` keeps only the rows of steps up to ``start``."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    meta = dataclasses.asdict(job.cfg) | {"model_config": dataclasses.asdict(model_cfg)}
    if job.cfg.hf_folder is not None:  # what `tetrad export --to hf` starts from
        meta["hf_config"] = read_config(job.cfg.hf_folder)[1]
    tmp = job.run_dir / "config.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, job.run_dir / "config.json")
    shutil.copyfile(job.corpus.tokenizer_path, job.run_dir / "tokenizer.json")
    trim_metrics(job.run_dir, start)


def _step(job: Job, step: int, batch: torch.Tensor) -> dict:
    """Optimizer step ``step`` (0-based) on the global ``batch`` (host memory), with no host
    synchronisation: its record, whose ``loss`` and ``grad_norm`` are still device tensors
    (read by :func:`_rows`)."""
    t, grid, model = job.cfg.training, job.grid, job.model
    lr = lr_at(step, t.lr, t.min_lr, t.warmup_steps, t.steps)
    for group in job.optimizer.param_groups:
        group["lr"] = lr
    grid.comm.take()  # start counting; marks left by work between steps are dropped unread
    overlaps = [part.overlap for part in model.parts]
    for overlap in overlaps:
        overlap.counts.clear()
    loss, aux, grad_norm = model.train_step(job.optimizer, batch, t.grad_clip)
    cfg = model.parts[0].cfg
    extra = {"aux_loss": aux, "routing": take_step_routing(model.parts, cfg)} if cfg.is_moe else {}
    return extra | {
        "step": step + 1,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "comm": grid.comm.take(),  # NCCL's event marks read by _rows, not here
        "overlaps_ran": dict(sum((o.counts for o in overlaps), Counter())),
    }


def _rows(job: Job, pending: list[dict], since: float) -> list[dict]:
    """The ``metrics.jsonl`` rows of the steps run since ``since`` (a ``perf_counter`` time):
    one device-to-host read of their losses and gradient norms (this waits for them), with an
    MoE model's load-balancing terms and routing statistics (summed over the grid first: every
    rank calls this), then each step's time is the interval's wall time over its steps, so
    tokens/s and MFU are exact for the interval."""
    n, moe = len(pending), "routing" in pending[0]
    keys = ("loss", "grad_norm", "aux_loss") if moe else ("loss", "grad_norm")
    flat = [torch.stack([p[k].double() for p in pending for k in keys])]
    if moe:
        routing = sum_routing(torch.stack([p["routing"] for p in pending]), job.grid)
        flat.append(routing.double().flatten())
    read = torch.cat(flat).tolist()
    got = [
        dict(zip(keys, read[i * len(keys) : (i + 1) * len(keys)], strict=True)) for i in range(n)
    ]
    if moe:
        cfg, sequences = job.model.parts[0].cfg, job.cfg.training.global_batch
        stats = torch.tensor(read[n * len(keys) :], dtype=torch.float64).view(routing.shape)
        for g, s in zip(got, stats, strict=True):
            g |= routing_row(s, cfg, sequences)
    seconds = (time.perf_counter() - since) / len(pending)
    peak = peak_memory_bytes(job.grid.device)
    # every step's marks first: a collective waited in the next step (the sharded optimizer's
    # all-gathers) adds its time to the step that issued it
    comms = [p["comm"].read() for p in pending]
    rows = [
        job.meter.row(
            p["step"],
            seconds,
            loss=g.pop("loss"),
            lr=p["lr"],
            grad_norm=g.pop("grad_norm"),
            peak_memory=peak,
            comm=comm,
            overlaps_ran=p["overlaps_ran"],
        )
        | {"restarts": restart_count(), "grid": str(job.grid)}
        | g
        for p, g, comm in zip(pending, got, comms, strict=True)
    ]
    return rows


def _loop(job: Job, start: int) -> tuple[float, float]:
    """Steps ``start+1 .. steps`` with validation, logging and checkpoints; returns the last
    training and validation losses (nats per token).

    Steps run back to back; the host waits for the device only at a logging, validation,
    checkpoint or profiler boundary, where the pending steps' rows are written."""
    t, log, rank0 = job.cfg.training, job.cfg.logging, job.rank0
    val = val_batches(job.corpus.val, log.val_batches, t.global_batch, t.seq_len)
    profile = log.profile_range()
    profiler = StepProfiler(profile, job.run_dir, job.grid.device, rank0)
    # tqdm's default lock is a multiprocessing one (a named semaphore); a worker that exits
    # without interpreter teardown would leave it to the resource tracker's leak warning.
    tqdm.set_lock(threading.RLock())
    bar = tqdm(
        total=t.steps,
        initial=start,
        disable=not (rank0 and sys.stderr.isatty()),
        unit="step",
        dynamic_ncols=True,
    )
    metrics = MetricsLog(job.run_dir, log.tensorboard, start) if rank0 else None
    watch = RoutingWatch(job.model.parts[0].cfg)
    every = job.cfg.checkpoint.checkpoint_every
    loss = val_loss = float("nan")
    pending: list[dict] = []
    since = time.perf_counter()
    for step in range(start, t.steps):
        done = step + 1
        batch = sample_batch(job.corpus.train, step, t.global_batch, t.seq_len, t.seed)
        profiler.before(done)
        pending.append(_step(job, step, batch))
        profiler.after(done)
        stop = job.stop.agreed()
        last, validate = done == t.steps, done % log.val_every == 0
        save = (every and done % every == 0) or last or stop
        edge = profile is not None and done + 1 in (profile[0], profile[1] + 1)
        if not (done % log.log_every == 0 or last or validate or save or edge):
            continue
        if validate or save or last:  # evaluation, checkpoint, the end: parameters whole
            settle_parameters(job.optimizer)
        peak = job.meter.peak
        rows, pending = _rows(job, pending, since), []
        loss = rows[-1]["loss"]
        if validate or last:
            val_loss = rows[-1]["val_loss"] = _evaluate(job, val)
        if rank0:
            for note in notes(job, first=done - len(rows) == start, peak=peak):
                bar.write(note, file=sys.stdout)
            metrics.write(rows)
            for line in watch.update(rows):  # a collapsing MoE block, named
                bar.write(line, file=sys.stdout)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rows[-1]['tokens_per_s']:.0f}")
            bar.update(len(rows))
            if done % log.log_every == 0 or last or validate:
                bar.write(log_line(rows[-1]), file=sys.stdout)
        report_save(job, job.ckpt.poll())
        if save:
            t0 = time.perf_counter()
            job.ckpt.save(job.model.weights, job.optimizer, done)
            if stop or not job.ckpt.async_save:
                report_save(job, job.ckpt.wait())
            if rank0:
                bar.write(
                    f"tetrad: checkpoint step {done}: the loop waited "
                    f"{time.perf_counter() - t0:.2f} s",
                    file=sys.stdout,
                )
        if stop:
            _close_loop(bar, profiler, metrics)
            raise Stopped(stop, done, step_dir(job.run_dir, done).name)
        since = time.perf_counter()
    _close_loop(bar, profiler, metrics)
    return loss, val_loss


def _evaluate(job: Job, val: list[torch.Tensor]) -> float:
    """Validation loss (nats per token) over the ``val`` batches, in eval mode."""
    weights = job.model.weights
    weights.eval()
    loss = job.model.evaluate(val)
    weights.train()
    return loss


def _close_loop(bar: tqdm, profiler: StepProfiler, metrics: MetricsLog | None) -> None:
    bar.close()
    profiler.close()
    if metrics is not None:
        metrics.close()
