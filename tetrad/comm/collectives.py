"""Collectives over one axis of the process grid, and the one place they are counted.

Every collective of the runtime goes through these functions. Each call is recorded in the
grid's :class:`CommLog` per axis: calls, payload bytes, ring bytes sent per rank, time from issue
to completion, and the time the caller actually waited (exposed time). On an axis of size 1 each
function is a no-op that moves and records nothing. Tensors are split or concatenated along
dim 0. ``axis="world"`` means every rank.

The functions take the grid as :class:`Groups`, the little they need of it (its axis sizes,
process groups and :class:`CommLog`); :class:`tetrad.grid.Grid` is one, and this module does not
import it.

With ``async_op=True`` a function returns a :class:`Handle`; the result is valid after
``handle.wait()``. A blocking call is an async call waited at once, so all its time is exposed.

Times are read from the log's clock. With gloo the host waits for the transfer itself, so host
timers measure it (:class:`HostClock`). With NCCL ``wait()`` only makes the device's current
stream wait for the collective's stream and returns at once, so the times are taken from timing
events on that stream (:class:`DeviceClock`): the exposed time is how long the computation's
stream stalled at the wait. Events are read when the log's totals are read (:meth:`Taken.read`,
:meth:`CommLog.reset`: at logging time, after the step's results were read), never during the
step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from tetrad.spec.grid import Axis

# The single-tensor all-gather and reduce-scatter are named ``*_single`` from torch 2.13 (the older
# ``*_tensor`` names are deprecated there); older builds, such as GPU images with torch 2.11,
# have only the older names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class AxisStats:
    """Totals for one mesh axis since the last :meth:`CommLog.take` (or ``reset``).

    Attributes:
        calls: collectives issued.
        payload_bytes: bytes of the buffers (the larger of input and output).
        bytes: bytes each rank sends under the ring algorithm: all-reduce ``2(G-1)/G``
            of the payload, all-gather ``(G-1)/G`` of the output, reduce-scatter ``(G-1)/G``
            of the input (Thakur et al., "Optimization of Collective Communication Operations
            in MPICH", 2005, section 4).
        time_s: seconds from issue to completion. An async call's completion is stamped at the
            first collective event (an issue or a wait) that finds it done, or at the end of its
            wait: an upper bound, tight to the next communication event. With device events
            (NCCL), from the issue to the end of the wait on the computation's stream.
        exposed_s: seconds the caller was blocked (the whole call when blocking, the wait
            otherwise; none for a wait on a collective the host clock found complete): the
            host with gloo, the computation's stream with NCCL. At most ``time_s``.
    """

    calls: int = 0
    payload_bytes: int = 0
    bytes: float = 0.0
    time_s: float = 0.0
    exposed_s: float = 0.0


class HostClock:
    """Host time (``time.perf_counter``, seconds): what the host waited. Right where the host
    blocks until the transfer is done (gloo)."""

    deferred = False
    """Marks are numbers, read at once."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class DeviceClock:
    """Timing events recorded on ``device``'s current stream (``torch.Event``): the time that
    stream spent between two marks. Right where a wait makes the stream, not the host, wait
    (NCCL). Marks are read later (:attr:`deferred`): reading one waits for it."""

    deferred = True

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> torch.Event:
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.Event, end: torch.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def clock_for(device: torch.device, backend: str) -> HostClock | DeviceClock:
    """The clock that measures collectives of ``backend`` on ``device``: device events for
    NCCL, the host's timer otherwise (gloo, also with CUDA tensors: it blocks the host)."""
    return DeviceClock(device) if backend == "nccl" else HostClock()


@dataclass
class CommLog:
    """Per-axis communication record of one process (owned by its :class:`Grid`)."""

    axes: dict[str, AxisStats] = field(default_factory=lambda: defaultdict(AxisStats))
    enabled: bool = True
    in_flight: list = field(default_factory=list)  # issued, not yet seen complete
    names: dict[str, str] = field(default_factory=dict)
    """Role -> the mesh dimension it is recorded under (the grid's orientation); others as is."""
    clock: HostClock | DeviceClock = field(default_factory=HostClock)
    """What times the collectives (:func:`clock_for` the grid's device and backend)."""
    unread: list = field(default_factory=list)
    """``(stats, attribute, start, end)``: a deferred clock's marks, read by :meth:`Taken.read`
    (or :meth:`reset`)."""

    def add_time(self, stats: AxisStats, attribute: str, start, end) -> None:
        """Add the clock's seconds from mark ``start`` to mark ``end`` to ``stats.attribute``
        (``time_s`` or ``exposed_s``): now, or when taken totals are read for a deferred clock."""
        if self.clock.deferred:
            self.unread.append((stats, attribute, start, end))
        else:
            setattr(stats, attribute, getattr(stats, attribute) + self.clock.seconds(start, end))

    def stats(self, axis: str) -> AxisStats:
        """The totals of the collectives over role ``axis`` (recorded under its mesh name)."""
        return self.axes[self.names.get(axis, axis)]

    def sweep(self, now: float) -> None:
        """Stamp the completion time of in-flight collectives that have finished (host clock;
        with a deferred clock, completion is the end of the wait on the stream)."""
        if self.clock.deferred:
            self.in_flight = []
            return
        still = []
        for h in self.in_flight:
            if h.done_at is None and h.work is not None and h.work.is_completed():
                h.done_at = now
            if h.done_at is None and h.work is not None:
                still.append(h)
        self.in_flight = still

    def reset(self) -> dict[str, AxisStats]:
        """Return the totals so far and start counting from zero (reading a deferred clock's
        marks first: this waits for the collectives they follow)."""
        return self.take().read()

    def take(self) -> Taken:
        """The totals so far, their deferred marks unread (nothing waits), and start counting
        from zero: a training step's record, read at the next logging boundary."""
        out = Taken(dict(self.axes), self.unread, self.clock)
        self.axes, self.unread = defaultdict(AxisStats), []
        return out


@dataclass
class Taken:
    """Per-axis totals taken from a :class:`CommLog` (:meth:`CommLog.take`) whose deferred
    clock's marks (device events with NCCL) are read only by :meth:`read`."""

    axes: dict[str, AxisStats]
    unread: list
    clock: HostClock | DeviceClock

    def read(self) -> dict[str, AxisStats]:
        """The totals, the marks' seconds added first (reading a device event waits for the
        collective it follows)."""
        unread, self.unread = self.unread, []
        for stats, attribute, start, end in unread:
            seconds = self.clock.seconds(start, end)
            setattr(stats, attribute, getattr(stats, attribute) + seconds)
        return self.axes


class Handle:
    """An issued collective; :meth:`wait` blocks until it is done and returns its result."""

    def __init__(
        self,
        work,
        result: torch.Tensor,
        stats: AxisStats | None,
        issued,
        log: CommLog | None = None,
        post=None,
    ):
        self.work, self.result, self.stats, self.issued = work, result, stats, issued
        self.log, self.done_at, self.post = log, None, post

    def done(self) -> bool:
        """Whether :meth:`wait` would return at once (always, for a no-op on a size-1 axis)."""
        return self.work is None or self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            clock = self.log.clock if self.log is not None else HostClock()
            t0 = clock.mark()
            if not clock.deferred:
                if self.log is not None:
                    self.log.sweep(t0)
                if self.done_at is None and self.work.is_completed():
                    self.done_at = t0
            done_before = self.done_at is not None  # host clock: complete when asked
            self.work.wait()
            t1 = clock.mark()
            if self.stats is not None:
                if not done_before:  # else nothing blocked the caller, however long wait took
                    self.log.add_time(self.stats, "exposed_s", t0, t1)
                self.log.add_time(self.stats, "time_s", self.issued, self.done_at or t1)
            self.work = None
            if self.post is not None:
                self.result, self.post = self.post(self.result), None
        return self.result


class Groups(Protocol):
    """What the collectives need of a process grid (:class:`tetrad.grid.Grid` is one)."""

    comm: CommLog

    @property
    def world_size(self) -> int: ...

    def size(self, axis: Axis | str) -> int: ...

    def group(self, axis: Axis | str) -> dist.ProcessGroup: ...


def _axis_info(grid: Groups, axis: Axis | str) -> tuple[int, dist.ProcessGroup | None]:
    if axis == Axis.WORLD:
        return grid.world_size, None
    g = grid.size(axis)
    return g, (grid.group(axis) if g > 1 else None)


def _issue(
    grid: Groups,
    axis: Axis | str,
    payload: int,
    ring: float,
    launch: Callable[[], dist.Work],
    result: torch.Tensor,
    post: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Handle:
    stats = None
    if grid.comm.enabled:
        stats = grid.comm.stats(axis)
        stats.calls += 1
        stats.payload_bytes += payload
        stats.bytes += ring
    log = grid.comm if stats is not None else None
    issued = log.clock.mark() if log is not None else time.perf_counter()
    if log is not None:
        log.sweep(issued)
    h = Handle(launch(), result, stats, issued, log, post)
    if log is not None and not log.clock.deferred:
        log.in_flight.append(h)
    return h


def count_sends(grid: Groups, axis: Axis | str, tensors: list[torch.Tensor]) -> None:
    """Record point-to-point sends that another library issues (the pipeline schedule's
    activations and gradients between stages) on ``axis``: one call and the tensor's bytes,
    payload and sent alike, per tensor; no time (their waits are the schedule's)."""
    if not grid.comm.enabled or not tensors:
        return
    stats = grid.comm.stats(axis)
    for t in tensors:
        stats.calls += 1
        stats.payload_bytes += t.numel() * t.element_size()
        stats.bytes += t.numel() * t.element_size()


def all_reduce(
    t: torch.Tensor, grid: Groups, axis: Axis | str, op: str = "sum", async_op: bool = False
) -> torch.Tensor | Handle:
    """Reduce ``t`` in place over ``axis`` (``op``: ``"sum"`` or ``"max"``); returns ``t`` (or a
    :class:`Handle` to it). Ring traffic per rank: ``2 (G-1)/G * t.nbytes``."""
    g, group = _axis_info(grid, axis)
    if g == 1:
        return Handle(None, t, None, 0.0) if async_op else t
    red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    nbytes = t.numel() * t.element_size()
    h = _issue(
        grid,
        axis,
        nbytes,
        2 * (g - 1) / g * nbytes,
        lambda: dist.all_reduce(t, op=red, group=group, async_op=True),
        t,
    )
    return h if async_op else h.wait()


def all_gather(
    t: torch.Tensor, grid: Groups, axis: Axis | str, async_op: bool = False
) -> torch.Tensor | Handle:
    """Concatenate every rank's ``t`` along dim 0 in axis order: ``[G*d0, ...]``.

    Ring traffic per rank: ``(G-1)/G`` of the output's bytes.
    """
    g, group = _axis_info(grid, axis)
    if g == 1:
        return Handle(None, t, None, 0.0) if async_op else t
    t = t.contiguous()
    out = torch.empty((g * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    nbytes = out.numel() * out.element_size()
    h = _issue(
        grid,
        axis,
        nbytes,
        (g - 1) / g * nbytes,
        lambda: all_gather_single(out, t, group=group, async_op=True),
        out,
    )
    return h if async_op else h.wait()


def reduce_scatter(
    t: torch.Tensor, grid: Groups, axis: Axis | str, async_op: bool = False
) -> torch.Tensor | Handle:
    """Sum ``t`` over ``axis`` and keep this rank's dim-0 chunk: ``[d0/G, ...]``.

    Ring traffic per rank: ``(G-1)/G`` of the input's bytes; that is what is recorded. gloo has
    no reduce-scatter of its own (torch emulates it with an all-reduce, about twice the traffic,
    whose handle only completes inside ``wait``), so on gloo the all-reduce is issued here and
    this rank's chunk kept, which lets the record see when it completes.
    """
    g, group = _axis_info(grid, axis)
    if g == 1:
        return Handle(None, t, None, 0.0) if async_op else t
    nbytes = t.numel() * t.element_size()
    ring = (g - 1) / g * nbytes
    if dist.get_backend(group) == "gloo":
        buf = t.clone(memory_format=torch.contiguous_format)
        rank = dist.get_group_rank(group, dist.get_rank())

        def keep_chunk(full):
            return full.chunk(g)[rank].clone()

        h = _issue(
            grid,
            axis,
            nbytes,
            ring,
            lambda: dist.all_reduce(buf, group=group, async_op=True),
            buf,
            keep_chunk,
        )
    else:
        t = t.contiguous()
        out = torch.empty((t.shape[0] // g, *t.shape[1:]), dtype=t.dtype, device=t.device)
        h = _issue(
            grid,
            axis,
            nbytes,
            ring,
            lambda: reduce_scatter_single(out, t, group=group, async_op=True),
            out,
        )
    return h if async_op else h.wait()
