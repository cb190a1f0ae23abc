"""The measurements of ``tetrad calibrate``, on every rank of a job.

- **GEMMs** (:func:`measure_gemms`): ``[m, k] @ [k, n]`` over the shapes of
  :class:`~tetrad.calibrate.settings.Settings` (fp32 on CPU, bf16 on CUDA), each after a warm-up
  and timed over repeats sized to a minimum duration (best of a few trials).
- **Memory bandwidth** (:func:`measure_copy`): a large tensor copy, ``2 * bytes / time``.
- **Attention** (:func:`measure_attention`): causal ``scaled_dot_product_attention`` forward and
  backward, counted as the planner does (forward ``2 b S^2 d a``, backward 2.5x).
- **Contention** (:func:`measure_overlap_slowdown`): a GEMM timed alone and while an
  all-reduce over the world is in flight, on every rank at once; the ratio minus one is the
  ``fine`` overlap's ``overlap_slowdown`` (:mod:`tetrad.plan.comm.fine`).
- **Collectives** (:func:`measure_collectives`): all-reduce and all-gather of several payloads
  over groups laid out like the grid's axes (:func:`~tetrad.calibrate.settings.layouts`), all
  groups of a layout at once, as an axis of the grid does; mean over back-to-back calls, slowest
  rank, best of a few trials.

:func:`measure_compute` runs the first three where the device asks for it: on CUDA every rank
times its own GPU at once (the slowest rank's figures are kept); on CPU rank 0 times alone (the
others wait) with the threads a training rank gets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tetrad.calibrate.settings import KINDS, Settings, group_ranks, layouts
from tetrad.comm.collectives import all_gather_single
from tetrad.device import synchronize
from tetrad.plan.machine.network import ALL_REDUCE, ring_bytes


def time_per_call(
    fn: Callable[[], object],
    dev: torch.device,
    s: Settings,
    agree: Callable[[float], float] = float,
) -> float:
    """Seconds per call of ``fn``: one warm-up call, one call to size the repeats (so that a
    timed region lasts ``min_time_s``), then the best of ``trials`` timed regions.

    ``agree`` maps a local number to the one every rank uses (for collectives: the maximum over
    ranks, so that every rank makes the same number of calls).
    """
    fn()
    synchronize(dev)
    t0 = time.perf_counter()
    fn()
    synchronize(dev)
    once = agree(time.perf_counter() - t0)
    iters = max(1, min(s.max_iters, math.ceil(s.min_time_s / max(once, 1e-9))))
    best = math.inf
    for _ in range(s.trials):
        synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        synchronize(dev)
        best = min(best, agree((time.perf_counter() - t0) / iters))
    return best


# ---- compute ---------------------------------------------------------------------------------


def measure_gemms(dev: torch.device, dtype: torch.dtype, s: Settings) -> list[dict]:
    """Achieved FLOP/s of ``[m, k] @ [k, n]`` for each shape of ``s``: dicts with ``m, n, k,
    flops`` (``2 m n k``), ``seconds`` (one GEMM) and ``flops_per_s``."""
    out = []
    for m, n, k in s.gemm_shapes:
        a = torch.randn(m, k, device=dev).to(dtype)
        b = torch.randn(k, n, device=dev).to(dtype)
        c = torch.empty(m, n, device=dev, dtype=dtype)
        sec = time_per_call(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), dev, s)
        flops = 2.0 * m * n * k
        out.append(
            {"m": m, "n": n, "k": k, "flops": flops, "seconds": sec, "flops_per_s": flops / sec}
        )
        del a, b, c
    return out


def measure_copy(dev: torch.device, s: Settings) -> float:
    """Memory bandwidth, bytes/s: ``2 * bytes / time`` of a copy of ``copy_bytes``."""
    n = s.copy_bytes // 4
    src = torch.ones(n, device=dev)
    dst = torch.empty_like(src)
    sec = time_per_call(lambda: dst.copy_(src), dev, s)
    return 2.0 * n * 4 / sec


def measure_attention(dev: torch.device, dtype: torch.dtype, s: Settings) -> tuple[float, dict]:
    """FLOP/s of causal attention forward + backward counted as the planner counts it
    (:func:`tetrad.plan.comm.context_parallel.attention_fwd_flops`: forward ``2 b S^2 d a``,
    backward 2.5x), and the shape used."""
    b, a, seq, d = s.attention
    q, k, v = (torch.randn(b, a, seq, d, device=dev).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(b, a, seq, d, device=dev).to(dtype)

    def step() -> None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(grad)
        q.grad = k.grad = v.grad = None

    sec = time_per_call(step, dev, s)
    flops = 3.5 * 2.0 * b * seq * seq * d * a
    return flops / sec, {
        "batch": b,
        "heads": a,
        "seq_len": seq,
        "head_dim": d,
        "seconds": sec,
        "flops": flops,
    }


def measure_compute(dev: torch.device, dtype: torch.dtype, s: Settings) -> dict:
    """GEMMs, memory bandwidth and attention, the same dict on every rank (call on every rank).

    CUDA: every rank times its own GPU at once and the slowest rank's figures are kept. CPU: rank
    0 times alone (the others wait) and sends its figures to the others.

    Returns:
        ``gemms`` (dicts of :func:`measure_gemms`), ``copy`` (bytes/s of :func:`measure_copy`),
        ``attention`` (FLOP/s) and ``attention_shape`` (of :func:`measure_attention`).
    """
    comp: list = [None]
    if dev.type == "cuda" or dist.get_rank() == 0:
        gemms = measure_gemms(dev, dtype, s)
        copy_bps = measure_copy(dev, s)
        att_rate, att_shape = measure_attention(dev, dtype, s)
        comp = [
            {"gemms": gemms, "copy": copy_bps, "attention": att_rate, "attention_shape": att_shape}
        ]
    if dev.type == "cuda":
        _keep_slowest(comp[0], dev)
    dist.broadcast_object_list(comp, src=0)
    return comp[0]


def _keep_slowest(comp: dict, dev: torch.device) -> None:
    """Replace the rates of ``comp`` (as built by :func:`measure_compute`) by their minimum over
    the ranks, in place (GEMM seconds follow their rate)."""
    rates = torch.tensor(
        [g["flops_per_s"] for g in comp["gemms"]] + [comp["copy"], comp["attention"]],
        dtype=torch.float64,
        device=dev,
    )
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)
    vals = rates.tolist()
    for g, r in zip(comp["gemms"], vals, strict=False):
        g["flops_per_s"], g["seconds"] = r, g["flops"] / r
    comp["copy"], comp["attention"] = vals[-2], vals[-1]


# ---- collectives -----------------------------------------------------------------------------


def _world_max(x: float, dev: torch.device) -> float:
    """The maximum of ``x`` over all ranks (every rank calls)."""
    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _new_groups(
    stride: int, size: int, world: int
) -> tuple[dist.ProcessGroup | None, list[dist.ProcessGroup]]:
    """Create the groups of one layout (every rank creates every group, as
    ``torch.distributed.new_group`` requires); returns this rank's group and all of them."""
    rank = dist.get_rank()
    mine = None
    made = []
    for ranks in group_ranks(stride, size, world):
        pg = dist.new_group(ranks)
        made.append(pg)
        if rank in ranks:
            mine = pg
    return mine, made


def _collective(
    kind: str, elems: int, size: int, dev: torch.device, pg: dist.ProcessGroup | None
) -> Callable[[], None]:
    """One call of ``kind`` over ``pg`` on ``elems`` fp32 elements (the all-reduce buffer, or
    the all-gather output, each rank sending ``elems / size``)."""
    buf = torch.zeros(elems, dtype=torch.float32, device=dev)
    if kind == ALL_REDUCE:

        def fn(buf=buf, pg=pg):
            dist.all_reduce(buf, group=pg)
    else:
        inp = torch.zeros(elems // size, dtype=torch.float32, device=dev)

        def fn(buf=buf, inp=inp, pg=pg):
            all_gather_single(buf, inp, group=pg)

    return fn


def measure_collectives(dev: torch.device, s: Settings) -> list[dict]:
    """Seconds per call of all-reduce and all-gather over every layout of
    :func:`~tetrad.calibrate.settings.layouts` and payload of ``s`` (every rank calls; all
    groups of a layout run at once; the slowest rank counts). Dicts with ``kind, stride,
    members, payload_bytes, ring_bytes, seconds``; payloads are rounded up to a multiple of
    ``4 * G`` bytes."""
    world = dist.get_world_size()
    out = []
    for stride, size in layouts(world):
        mine, made = _new_groups(stride, size, world)
        warm = torch.zeros(size, dtype=torch.float32, device=dev)
        for _ in range(3):  # connect the new groups before timing anything
            dist.all_reduce(warm, group=mine)
        for kind in KINDS:
            for payload in s.payloads:
                elems = -(-payload // (4 * size)) * size
                fn = _collective(kind, elems, size, dev, mine)
                dist.barrier()
                sec = time_per_call(fn, dev, s, lambda x: _world_max(x, dev))
                nbytes = elems * 4
                out.append(
                    {
                        "kind": kind,
                        "stride": stride,
                        "members": size,
                        "payload_bytes": nbytes,
                        "ring_bytes": ring_bytes(kind, nbytes, size),
                        "seconds": sec,
                    }
                )
        dist.barrier()
        for pg in made:
            dist.destroy_process_group(pg)
    return out


# ---- contention ------------------------------------------------------------------------------


def _gemm_seconds(fn: Callable[[], object], dev: torch.device, reps: int) -> float:
    """Seconds of ``reps`` calls of ``fn`` on the compute stream (CUDA events: a collective on
    its own stream is not waited for)."""
    if dev.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t0


def measure_overlap_slowdown(
    dev: torch.device,
    dtype: torch.dtype,
    s: Settings,
    shape: tuple[int, int, int] = (1024, 1024, 1024),
    group: dist.ProcessGroup | None = None,
) -> dict:
    """How much a GEMM ``[m, k] @ [k, n]`` slows while an all-reduce over ``group`` (default:
    the world) runs beside it: the GEMMs are timed alone, then again while one all-reduce sized
    to outlast them is in flight (best of ``s.trials``; the slowest rank counts).

    Returns:
        ``{"slowdown": t_with / t_alone - 1 (at least 0), "gemm_s": one GEMM alone (seconds),
        "gemm_with_comm_s", "payload_bytes": the all-reduce's buffer}``.
    """
    m, n, k = shape
    a = torch.randn(m, k, device=dev).to(dtype)
    b = torch.randn(k, n, device=dev).to(dtype)
    c = torch.empty(m, n, device=dev, dtype=dtype)

    def gemm() -> None:
        torch.matmul(a, b, out=c)

    one = _world_max(time_per_call(gemm, dev, s), dev)
    reps = max(2, math.ceil(s.min_time_s / max(one, 1e-9)))
    buf = torch.zeros(1 << 20, device=dev, dtype=torch.float32)  # 4 MiB, grown to outlast
    while True:
        synchronize(dev)
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        synchronize(dev)
        comm = _world_max(time.perf_counter() - t0, dev)
        if comm >= 1.5 * reps * one or buf.numel() >= 1 << 28:
            break
        buf = torch.zeros(buf.numel() * 4, device=dev, dtype=torch.float32)
    alone = with_comm = math.inf
    for _ in range(s.trials):
        synchronize(dev)
        dist.barrier(group=group)
        alone = min(alone, _world_max(_gemm_seconds(gemm, dev, reps), dev) / reps)
        synchronize(dev)
        dist.barrier(group=group)
        work = dist.all_reduce(buf, group=group, async_op=True)
        t = _gemm_seconds(gemm, dev, reps) / reps
        work.wait()
        with_comm = min(with_comm, _world_max(t, dev))
    return {
        "slowdown": max(0.0, with_comm / alone - 1.0),
        "gemm_s": alone,
        "gemm_with_comm_s": with_comm,
        "payload_bytes": buf.numel() * buf.element_size(),
    }
