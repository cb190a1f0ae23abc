"""What a training step reports: the ``metrics.jsonl`` row, the log line, TensorBoard scalars,
the profiler window."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tetrad.comm import AxisStats
from tetrad.spec.units import GiB
from tetrad.train import trace
from tetrad.train.peak import Peak
from tetrad.train.routing import routing_summary


@dataclass
class StepMeter:
    """The throughput figures of a run, and its ``metrics.jsonl`` rows.

    Attributes:
        tokens: tokens per optimizer step (``global_batch * seq_len``).
        flops: model FLOPs per optimizer step (``flops_per_token * tokens``).
        peak: peak FLOP/s of one rank and its source (flops 0: unknown, MFU reported as 0);
            raised to a step's achieved rate per rank when a step beats it, so MFU <= 1 (a
            measured CPU peak can be beaten; see :mod:`tetrad.train.peak`).
        world_size: ranks.
    """

    tokens: int
    flops: float
    peak: Peak
    world_size: int

    def row(
        self,
        step: int,
        seconds: float,
        *,
        loss: float,
        lr: float,
        grad_norm: float,
        peak_memory: int,
        comm: dict[str, AxisStats],
        overlaps_ran: dict[str, int],
    ) -> dict:
        """The row of optimizer step ``step`` (1-based) that took ``seconds``.

        Keys: ``step, loss, lr, grad_norm, tokens_per_s, tokens_per_s_per_rank, mfu,
        peak_memory_bytes, step_time_s``, per axis ``comm_bytes`` (ring bytes sent per rank),
        ``comm_time_s`` and ``comm_exposed_s`` (seconds), and ``overlaps_ran`` (counts).
        MFU = ``flops / seconds / (peak * world_size)``.
        """
        achieved = self.flops / seconds / self.world_size
        if self.peak.flops and achieved > self.peak.flops:
            self.peak = Peak(achieved, f"raised to a step's achieved rate (was {self.peak.source})")
        return {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": self.tokens / seconds,
            "tokens_per_s_per_rank": self.tokens / seconds / self.world_size,
            "mfu": achieved / self.peak.flops if self.peak.flops else 0.0,
            "peak_memory_bytes": peak_memory,
            "step_time_s": seconds,
            "comm_bytes": {a: st.bytes for a, st in comm.items()},
            "comm_time_s": {a: st.time_s for a, st in comm.items()},
            "comm_exposed_s": {a: st.exposed_s for a, st in comm.items()},
            "overlaps_ran": overlaps_ran,
        }


def read_rows(path: str | Path) -> tuple[list[dict], int]:
    """The rows of a ``metrics.jsonl`` and the number of lines skipped: a line a crash cut
    short (typically the last one, without its newline) or that is otherwise not a JSON
    object. Blank lines are neither rows nor skipped."""
    rows, skipped = [], 0
    for line in Path(path).read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


TENSORBOARD = "tensorboard"
"""The folder of ``RUN_DIR`` that ``--tensorboard`` writes its event files to."""


def scalars(row: dict) -> dict[str, float]:
    """The TensorBoard scalars of a :meth:`StepMeter.row` (``val_loss`` where it has one): tag ->
    value. Tags: ``train/loss, train/lr, train/grad_norm, val/loss`` (nats per token),
    ``train/aux_loss`` (an MoE model's load-balancing term), per MoE block ``i``
    ``moe/max_load/block_i``, ``moe/balance/block_i`` and (with the router z-loss)
    ``moe/z_loss/block_i`` (:mod:`tetrad.train.routing`),
    ``perf/tokens_per_s, perf/tokens_per_s_per_rank, perf/mfu, perf/step_time_s`` (seconds),
    ``memory/peak_bytes``, and per mesh axis ``A``: ``comm_exposed_s/A, comm_time_s/A``
    (seconds) and ``comm_bytes/A`` (bytes sent per rank)."""
    out = {
        "train/loss": row["loss"],
        "train/lr": row["lr"],
        "train/grad_norm": row["grad_norm"],
        "perf/tokens_per_s": row["tokens_per_s"],
        "perf/tokens_per_s_per_rank": row["tokens_per_s_per_rank"],
        "perf/mfu": row["mfu"],
        "perf/step_time_s": row["step_time_s"],
        "memory/peak_bytes": row["peak_memory_bytes"],
    }
    if "val_loss" in row:
        out["val/loss"] = row["val_loss"]
    if "aux_loss" in row:
        out["train/aux_loss"] = row["aux_loss"]
    for key in ("moe_max_load", "moe_balance", "moe_z_loss"):  # per MoE block
        out |= {f"moe/{key[4:]}/block_{b}": v for b, v in row.get(key, {}).items()}
    for key in ("comm_exposed_s", "comm_time_s", "comm_bytes"):
        out |= {f"{key}/{axis}": v for axis, v in row[key].items()}
    return out


class MetricsLog:
    """Where rank 0 writes the rows of the steps: ``RUN_DIR/metrics.jsonl`` (appended) and,
    with ``tensorboard``, TensorBoard scalars (:func:`scalars`) in ``RUN_DIR/tensorboard``
    through ``torch.utils.tensorboard.SummaryWriter``, flushed at every write so a stopped or
    failed run keeps them. A run resumed from step ``start`` purges the TensorBoard events of
    steps after ``start`` (TensorBoard's ``purge_step``), as ``metrics.jsonl`` is trimmed.

    Raises (on creation):
        ImportError: ``tensorboard`` requested but the tensorboard package is missing
            (:func:`tetrad.train.preflight.check_tensorboard` says so first, in one line).
    """

    def __init__(self, run_dir: Path, tensorboard: bool, start: int):
        self.file = (run_dir / "metrics.jsonl").open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(
                str(run_dir / TENSORBOARD), purge_step=start + 1 if start else None
            )

    def write(self, rows: list[dict]) -> None:
        """Append ``rows`` (and their scalars, at their ``step``)."""
        self.file.write("".join(json.dumps(row) + "\n" for row in rows))
        self.file.flush()
        if self.tb is not None:
            for row in rows:
                for tag, value in scalars(row).items():
                    self.tb.add_scalar(tag, value, row["step"])
            self.tb.flush()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def log_line(row: dict) -> str:
    """The one-line progress report of a :func:`step_row`."""
    val = f" val_loss {row['val_loss']:.4f}" if "val_loss" in row else ""
    val += routing_summary(row)  # an MoE model's routing: the worst block
    exposed = sum(row["comm_exposed_s"].values()) / row["step_time_s"]
    return (
        f"step {row['step']:>6} | loss {row['loss']:.4f}{val} | lr {row['lr']:.2e} | "
        f"{row['tokens_per_s']:,.0f} tok/s ({row['tokens_per_s_per_rank']:,.0f}/rank) | "
        f"MFU {100 * row['mfu']:.1f}% | mem {row['peak_memory_bytes'] / GiB:.2f} GiB | "
        f"comm exposed {100 * exposed:.0f}%"
    )


class StepProfiler:
    """``torch.profiler`` over steps ``A..B`` (1-based); rank 0 writes a Chrome trace
    ``RUN_DIR/trace_steps_A-B.json`` (open it in chrome://tracing or Perfetto) and its summary
    ``trace_steps_A-B.txt`` (device time by kernel category, :mod:`tetrad.train.trace`)."""

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
            text = trace.summary(path, b - a + 1)
            path.with_suffix(".txt").write_text(text)
            print(f"tetrad: profiler trace {path}; device time by kernel category:\n{text}")
        self.prof = None
