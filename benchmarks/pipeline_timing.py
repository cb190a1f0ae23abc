"""What ``benchmarks/pipeline.py`` times on each pipeline rank, the step's CPU clock, and the
planner's step for the per-stage times measured (:func:`step_numbers`).

:func:`instrument` wraps, for the whole process, ``TetradStage.forward_one_chunk`` and
``backward_one_chunk`` (``torch.distributed.pipelining`` waits for a chunk's receives before
calling them and posts its sends after, so neither is inside), ``Pipeline._loss`` (the last
stage's LM head and loss, which the schedule calls after the forward) and ``Pipeline.step``
(the schedule's step: every micro-batch's forward and backward, the receives and sends; not the
gradient reductions or the optimizer after it). Per step each rank records (:data:`FIELDS`):

- ``fwd_wall_k``, ``bwd_wall_k``, ``fwd_cpu_k``, ``bwd_cpu_k``: the forwards (the last stage's
  with the loss) and backwards of its local stage ``k`` (stage ``r + k p``; ``k`` below
  :data:`MAX_CHUNKS`), in wall seconds and in CPU seconds of the rank's thread
  (``time.thread_time``: not counting the time the thread waits or another process holds its
  core; all of the rank's compute, as the ranks run one intra-op thread,
  ``torch.set_num_threads(1)``, and CPU autograd runs on the calling thread);
- ``step_wall``: the schedule's step, wall seconds; ``step_cpu``: its thread-CPU seconds (the
  stages' forwards and backwards and the schedule's own work between them: its Python, posting
  and completing sends and receives);
- ``step_clock``: the rank's CPU clock at the end of the step. Each rank's clock starts at 0
  with the step and runs with its thread's CPU time (compute, the schedule's Python, posting
  sends and receives; nothing while blocked). Every activation or gradient a stage sends
  carries the sender's clock in an extra 8-byte message on the same pair (one per boundary,
  micro-batch and direction), and before a stage computes with a received tensor its rank's clock
  becomes the later of its own and the sender's (Lamport's rule with CPU seconds as ticks).
  The largest end clock is then the length of the run's longest chain of CPU work and
  receives: the step the schedule that ran takes when each rank has a core of its own, however
  many processes shared the cores. It leaves out the transfer itself (gloo's threads
  copying the bytes and waking the receiver: about 0.2 ms one way for this model's 256 KiB
  tensors between two idle processes) and a send's wait for the
  peer's receive, which in these schedules is not on the longest chain (a rank waits for the
  same peer's next tensor anyway).
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from tetrad.pipeline.schedule import Pipeline
from tetrad.pipeline.stage import TetradStage
from tetrad.plan.pipe.critical_path import rank_seconds, schedule_step
from tetrad.plan.pipe.schedule import bubble_seconds

MAX_CHUNKS = 2
"""Local stages per rank recorded (the benchmark's interleaved cases run ``v = 2``)."""
FIELDS = tuple(
    f"{kind}_{clock}_{k}"
    for kind in ("fwd", "bwd")
    for clock in ("wall", "cpu")
    for k in range(MAX_CHUNKS)
) + ("step_wall", "step_clock", "step_cpu")


class StepClock:
    """This rank's CPU clock of a step (module doc)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.value, self.cpu0 = 0.0, time.thread_time()

    def now(self) -> float:
        return self.value + time.thread_time() - self.cpu0

    def join(self, stamp: float) -> None:
        """A tensor sent at the sender's clock ``stamp`` is used here."""
        if math.isnan(stamp):
            raise RuntimeError("a clock stamp was read before its receive finished")
        if stamp > self.now():
            self.value, self.cpu0 = stamp, time.thread_time()


CLOCK = StepClock()
TOTALS = dict.fromkeys(FIELDS, 0.0)
"""This rank's records of the current step (reset by :func:`reset`)."""


def reset() -> None:
    for k in TOTALS:
        TOTALS[k] = 0.0


def _local(obj) -> int:
    """The local stage index ``k`` of a stage (``stage_index // p``), or of a pipeline's last
    stage (the loss's)."""
    stage = obj.stages[-1] if isinstance(obj, Pipeline) else obj
    return stage.stage_index // stage.group_size


def _timed(method, kind: str, stamp: str | None = None):
    """``method`` timed into ``TOTALS[f"{kind}_wall_{k}"]`` and ``[f"{kind}_cpu_{k}"]`` (``k``:
    :func:`_local`); first, the clock joins the stamp received with chunk ``stamp``-``chunk``,
    if any."""

    def run(self, chunk, *args, **kwargs):
        if stamp is not None:
            got = self._stamps.pop((stamp, chunk), None)
            if got is not None:
                CLOCK.join(float(got))
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return method(self, chunk, *args, **kwargs)
        finally:
            k = _local(self)
            TOTALS[f"{kind}_cpu_{k}"] += time.thread_time() - c0
            TOTALS[f"{kind}_wall_{k}"] += time.perf_counter() - t0

    return run


def _sends(method):
    def ops(self, chunk: int) -> list[dist.P2POp]:
        out = method(self, chunk)
        if out:
            stamp = torch.tensor([CLOCK.now()], dtype=torch.float64)
            out.append(dist.P2POp(dist.isend, stamp, out[-1].peer, out[-1].group))
        return out

    return ops


def _receives(method, key: str):
    def ops(self, chunk: int) -> list[dist.P2POp]:
        out = method(self, chunk)
        if out:
            stamp = torch.full((1,), math.nan, dtype=torch.float64)
            self._stamps[(key, chunk)] = stamp
            out.append(dist.P2POp(dist.irecv, stamp, out[-1].peer, out[-1].group))
        return out

    return ops


def _step(method):
    def run(self, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        CLOCK.reset()
        try:
            return method(self, *args, **kwargs)
        finally:
            TOTALS["step_clock"] = CLOCK.now()
            TOTALS["step_wall"] = time.perf_counter() - t0
            TOTALS["step_cpu"] = time.thread_time() - c0

    return run


def instrument() -> None:
    """Wrap tetrad's stage and pipeline for the records above (once per process)."""
    if getattr(TetradStage, "_instrumented", False):
        return
    TetradStage._instrumented = True
    TetradStage._stamps = None
    init = TetradStage.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._stamps = {}

    TetradStage.__init__ = __init__
    stage = TetradStage
    stage.forward_one_chunk = _timed(stage.forward_one_chunk, "fwd", "f")
    stage.backward_one_chunk = _timed(stage.backward_one_chunk, "bwd", "b")
    stage.get_fwd_send_ops = _sends(stage.get_fwd_send_ops)
    stage.get_bwd_send_ops = _sends(stage.get_bwd_send_ops)
    stage.get_fwd_recv_ops = _receives(stage.get_fwd_recv_ops, "f")
    stage.get_bwd_recv_ops = _receives(stage.get_bwd_recv_ops, "b")
    Pipeline._loss = _timed(Pipeline._loss, "fwd")
    Pipeline.step = _step(Pipeline.step)


def stage_seconds(ranks: list, case: tuple, m: int, clock: str) -> tuple[list, list]:
    """``(fwd, bwd)`` per stage ``s`` and micro-batch, ``clock`` seconds: its forwards (with
    the loss) and backwards; on the CPU clock, with its rank's share of the schedule's own work
    (``step_cpu`` less the rank's forwards and backwards, spread evenly over its ``2 m v``
    operations: the per-operation cost of ``torch.distributed.pipelining``'s Python and P2P
    posting, which the CPU clock counts on the critical path; the wall clock has no such
    figure)."""
    pipe, _, virtual = case
    col = {k: i for i, k in enumerate(FIELDS)}
    n = pipe * virtual
    fwd = [ranks[s % pipe][col[f"fwd_{clock}_{s // pipe}"]] / m for s in range(n)]
    bwd = [ranks[s % pipe][col[f"bwd_{clock}_{s // pipe}"]] / m for s in range(n)]
    if clock == "cpu":
        for r in range(pipe):
            work = sum(fwd[r::pipe]) + sum(bwd[r::pipe])
            extra = max(0.0, ranks[r][col["step_cpu"]] / m - work) / (2 * virtual)
            for s in range(r, n, pipe):
                fwd[s] += extra
                bwd[s] += extra
    return fwd, bwd


def step_numbers(ranks: list, case: tuple, m: int, clock: str) -> dict:
    """One step's numbers from every rank's records ``ranks[r]`` (:data:`FIELDS`), in ``clock``
    (``cpu`` or ``wall``) seconds: ``step`` (the latest rank's end), ``busy`` (the busiest
    rank's work, ``m max_r T_r`` on :func:`stage_seconds`), ``planned`` (the planner's bubble
    for those stage times: :func:`tetrad.plan.pipe.critical_path.schedule_step`, the step
    :func:`tetrad.plan.pipe.pipeline_step.pipeline_estimate` takes, minus ``busy``), ``classic``
    (the even-rank ``(p - 1) max_r T_r / v``), ``measured`` (``step - busy``), ``fwd`` and
    ``bwd`` (each rank's per micro-batch)."""
    pipe, schedule, virtual = case
    fwd, bwd = stage_seconds(ranks, case, m, clock)
    t_fb = max(rank_seconds(pipe, fwd, bwd))
    col = FIELDS.index("step_clock" if clock == "cpu" else "step_wall")
    step = max(r[col] for r in ranks)
    planned = schedule_step(schedule, pipe, virtual, m, fwd, bwd)
    return dict(
        step=step,
        busy=m * t_fb,
        planned=planned - m * t_fb,
        classic=bubble_seconds(schedule, pipe, virtual, t_fb),
        measured=step - m * t_fb,
        fwd=[sum(fwd[r::pipe]) for r in range(pipe)],
        bwd=[sum(bwd[r::pipe]) for r in range(pipe)],
    )


def summary(runs: list, case: tuple, m: int, clock: str) -> dict:
    """Medians over each run's steps, then over the runs, of :func:`step_numbers` (per rank for
    ``fwd`` and ``bwd``); ``ratios``: each run's measured over planned bubble, sorted."""
    per_run = [[step_numbers(ranks, case, m, clock) for ranks in run] for run in runs]

    def med(get) -> float:
        return statistics.median(statistics.median(get(s) for s in run) for run in per_run)

    keys = ("step", "busy", "planned", "classic", "measured")
    out = {k: med(lambda s, k=k: s[k]) for k in keys}
    for k in ("fwd", "bwd"):
        out[k] = [med(lambda s, k=k, r=r: s[k][r]) for r in range(case[0])]
    out["ratios"] = sorted(
        statistics.median(s["measured"] for s in run) / statistics.median(s["planned"] for s in run)
        for run in per_run
    )
    return out
