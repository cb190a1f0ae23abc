"""What ``benchmarks/pipeline.py`` times on each pipeline rank, the step's CPU clock, and the
per-rank model of a step it is compared with.

:func:`instrument` wraps, for the whole process, ``TetradStage.forward_one_chunk`` and
``backward_one_chunk`` (``torch.distributed.pipelining`` waits for a chunk's receives before
calling them and posts its sends after, so neither is inside), ``Pipeline._loss`` (the last
stage's LM head and loss, which the schedule calls after the forward) and ``Pipeline.step``
(the schedule's step: every micro-batch's forward and backward, the receives and sends; not the
gradient reductions or the optimizer after it). Per step each rank records (:data:`FIELDS`):

- ``fwd_wall``, ``bwd_wall``, ``fwd_cpu``, ``bwd_cpu``: its stages' forwards (with the loss)
  and backwards, in wall seconds and in CPU seconds of the rank's thread
  (``time.thread_time``: not counting the time the thread waits or another process holds its
  core; all of the rank's compute, as the ranks run one intra-op thread,
  ``torch.set_num_threads(1)``, and CPU autograd runs on the calling thread);
- ``step_wall``: the schedule's step, wall seconds;
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
from tetrad.plan.pipe.schedule import bubble_seconds

FIELDS = ("fwd_wall", "bwd_wall", "fwd_cpu", "bwd_cpu", "step_wall", "step_clock")


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


def _timed(method, kind: str, stamp: str | None = None):
    """``method`` timed into ``TOTALS[kind + "_wall"]`` and ``[kind + "_cpu"]``; first, the
    clock joins the stamp received with chunk ``stamp``-``chunk``, if any."""

    def run(self, chunk, *args, **kwargs):
        if stamp is not None:
            got = self._stamps.pop((stamp, chunk), None)
            if got is not None:
                CLOCK.join(float(got))
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return method(self, chunk, *args, **kwargs)
        finally:
            TOTALS[kind + "_cpu"] += time.thread_time() - c0
            TOTALS[kind + "_wall"] += time.perf_counter() - t0

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
        t0 = time.perf_counter()
        CLOCK.reset()
        try:
            return method(self, *args, **kwargs)
        finally:
            TOTALS["step_clock"] = CLOCK.now()
            TOTALS["step_wall"] = time.perf_counter() - t0

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


def rank_model_step(schedule: str, fwd: list[float], bwd: list[float], m: int) -> float | None:
    """The step that per-rank forward and backward seconds per micro-batch (``fwd[r]`` with
    the loss, ``bwd[r]``, ``T_r`` their sum) give when transfers take no time (None for
    interleaved 1F1B):

    - GPipe, all forwards then all backwards, each phase a pipeline of identical micro-batches
      paced by its own slowest rank: ``sum_r T_r + (m-1) (max_r fwd_r + max_r bwd_r)``;
    - 1F1B, paced by the slowest rank ``s``: the work of the ranks before it on the first
      micro-batch's way in and its gradient's way out, ``m T_s``, and the wait of ``s`` for its
      first gradient beyond its ``p-s-1`` further warm-up forwards; the largest over ``s``:
      ``max_s sum_{r<s} T_r + m T_s + max(0, sum_{r>s} T_r - (p-s-1) fwd_s)``.

    Both are ``(m + p - 1) T`` on ``p`` equal ranks, the planner's."""
    t = [f + b for f, b in zip(fwd, bwd, strict=True)]
    if schedule == "gpipe":
        return sum(t) + (m - 1) * (max(fwd) + max(bwd))
    if schedule == "1f1b":
        p = len(t)
        return max(
            sum(t[:s]) + m * t[s] + max(0.0, sum(t[s + 1 :]) - (p - s - 1) * fwd[s])
            for s in range(p)
        )
    return None


def step_numbers(ranks: list, case: tuple, m: int, clock: str) -> dict:
    """One step's numbers from every rank's records ``ranks[r]`` (:data:`FIELDS`), in ``clock``
    (``cpu`` or ``wall``) seconds: ``step`` (the latest rank's end), ``busy`` (the busiest
    rank's forwards, loss and backwards, ``m t_fb``), ``planned`` (the planner's bubble for that
    ``t_fb``), ``measured`` (``step - busy``), ``model`` (:func:`rank_model_step` minus
    ``busy``, or None), ``fwd`` and ``bwd`` (each rank's per micro-batch)."""
    pipe, schedule, virtual = case
    col = {k: i for i, k in enumerate(FIELDS)}
    fwd = [r[col["fwd_" + clock]] / m for r in ranks]
    bwd = [r[col["bwd_" + clock]] / m for r in ranks]
    t_fb = max(f + b for f, b in zip(fwd, bwd, strict=True))
    step = max(r[col["step_clock" if clock == "cpu" else "step_wall"]] for r in ranks)
    model = rank_model_step(schedule, fwd, bwd, m)
    return dict(
        step=step,
        busy=m * t_fb,
        planned=bubble_seconds(schedule, pipe, virtual, t_fb),
        measured=step - m * t_fb,
        model=None if model is None else model - m * t_fb,
        fwd=fwd,
        bwd=bwd,
    )


def summary(runs: list, case: tuple, m: int, clock: str) -> dict:
    """Medians over each run's steps, then over the runs, of :func:`step_numbers` (per rank for
    ``fwd`` and ``bwd``); ``ratios``: each run's measured over planned bubble, sorted."""
    per_run = [[step_numbers(ranks, case, m, clock) for ranks in run] for run in runs]

    def med(get) -> float:
        return statistics.median(statistics.median(get(s) for s in run) for run in per_run)

    out = {k: med(lambda s, k=k: s[k]) for k in ("step", "busy", "planned", "measured")}
    if per_run[0][0]["model"] is not None:
        out["model"] = med(lambda s: s["model"])
    for k in ("fwd", "bwd"):
        out[k] = [med(lambda s, k=k, r=r: s[k][r]) for r in range(case[0])]
    out["ratios"] = sorted(
        statistics.median(s["measured"] for s in run) / statistics.median(s["planned"] for s in run)
        for run in per_run
    )
    return out
