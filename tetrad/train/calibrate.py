"""``tetrad calibrate``: measure this machine and write a machine TOML for the planner.

Every rank of a job calls :func:`calibrate` (under ``torchrun``, or in the workers that
:func:`run` starts with :func:`tetrad.train.launch.run_local`). It measures:

- **GEMMs** over square and skinny shapes (fp32 on CPU, bf16 on CUDA), each after a warm-up and
  timed over repeats sized to a minimum duration (best of a few trials). Achieved FLOP/s per GEMM
  divided by a peak gives the ``[compute] gemm_efficiency`` table (fraction of peak vs FLOPs
  of one GEMM, median per half decade).

  - CUDA: every rank times its own GPU at once (the slowest rank's figure is kept); the peak is
    the datasheet dense bf16 figure of :data:`tetrad.device.GPU_PEAK_FLOPS`, looked up by name
    (the best measured rate when the GPU is not in the table).
  - CPU: there is no datasheet to trust, so rank 0 times the GEMMs alone (the others wait) with
    the threads a training rank gets (``cpu_count // world``, at least 1). With ``R`` its best
    rate, the **per-rank peak** is ``R * min(cores, world) / world``: ``min(cores, world)``
    ranks can run at once and the world shares them. Efficiencies are ``rate / R``, so the
    best shape is 1.0 and a training rank's GEMM of ``F`` FLOPs is predicted to take
    ``F / (peak * efficiency(F))``, the time-sliced share of one rank.

- **Memory bandwidth** (``hbm_gbps``): a large tensor copy, ``2 * bytes / time`` (CPU: rank 0
  alone, shared like the peak).
- **Attention** (``attention_efficiency``): causal ``scaled_dot_product_attention`` forward and
  backward, counted as the planner does (forward ``2 b S^2 d a``, backward 2.5x), over the peak.
- **Collectives**: all-reduce and all-gather of several payloads over groups laid out like the
  grid's axes. For each group size ``G > 1`` dividing the world and each stride ``s`` with
  ``s * G`` dividing the world, the world is split into the groups ``{base + i * s : i < G}``
  (``s = 1``: consecutive ranks, an inner axis such as X; larger ``s``: strided, an outer axis
  such as Z or data), and all groups run their collective at once, as an axis of the grid does.
  Each payload is timed (mean over back-to-back calls, slowest rank, best of a few trials) and
  per layout the alpha-beta ring model of :mod:`tetrad.plan.network` is fitted by weighted
  least squares (relative error, coefficients kept non-negative)::

      t = alpha_kind + ring_bytes / bandwidth
      ring_bytes = 2 (G-1)/G * payload (all-reduce),  (G-1)/G * output (all-gather)

  one bus bandwidth per layout and one ``alpha`` per kind. The ``alpha`` values are then fitted
  to ``latency_base + hops * latency_hop`` with the planner's hop counts (all-reduce
  ``min(2 (G-1), 2 ceil(log2 G))``, all-gather ``G-1``).

  Groups inside one node (ranks ``0 .. LOCAL_WORLD_SIZE-1`` share a node) fill
  ``intra_table`` (``stride, members, gbps``) and ``intra_node_gbps`` (the stride-1 group of a
  whole node). Groups spanning nodes give ``inter_node_gbps_per_member`` (bandwidth over
  members per node, the worst layout) and ``latency_hop_inter_us``. On a single node nothing
  crosses nodes: ``inter_node_gbps_per_member`` is set to the worst measured in-node bandwidth
  and the inter-node hop latency to the in-node one, and ``[sources]`` says so.

Rank 0 writes the TOML (every number with its source in ``[sources]``, the raw measurements in
a ``[calibration]`` table that the planner ignores) and every rank returns the same dict. Load the
file with ``tetrad plan --machine FILE`` (:func:`tetrad.plan.machines.get_machine`).

The gloo backend emulates reduce-scatter with an all-reduce, and the planner sends every kind
of collective through one bandwidth, so reduce-scatter is not measured separately.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import tomli_w
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tetrad.device import (
    device_name,
    gpu_count,
    local_device,
    peak_flops,
    synchronize,
    total_memory_bytes,
)
from tetrad.grid import backend_for
from tetrad.plan.machines import parse_machine
from tetrad.plan.network import ALL_GATHER, ALL_REDUCE, placement, ring_bytes
from tetrad.spec import GiB, KiB, MiB, tomllib

KINDS = (ALL_REDUCE, ALL_GATHER)


class CalibrationError(ValueError):
    """A calibration that cannot run as asked (bad device, too few ranks, unwritable output)."""


@dataclass(frozen=True)
class Settings:
    """What to measure; :func:`settings` picks the quick or full set per device.

    Attributes:
        gemm_shapes: ``(m, n, k)`` of ``[m, k] @ [k, n]``.
        copy_bytes: bytes of the tensor copied for the memory bandwidth.
        attention: ``(batch, heads, seq_len, head_dim)`` of the attention measurement.
        payloads: collective payloads, bytes (rounded up to a multiple of ``4 * G``).
        min_time_s: each timed region lasts about this long (repeats are sized to it).
        trials: timed regions per measurement; the best is kept.
        max_iters: at most this many calls per timed region.
    """

    gemm_shapes: tuple[tuple[int, int, int], ...]
    copy_bytes: int
    attention: tuple[int, int, int, int]
    payloads: tuple[int, ...]
    min_time_s: float
    trials: int
    max_iters: int


def settings(device: str, quick: bool) -> Settings:
    """The measurement set for ``device`` (``cpu`` or ``cuda``); ``quick``: a few seconds."""
    kib, mib = KiB, MiB
    if device == "cuda":
        if quick:
            return Settings(
                ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 1024, 1024)),
                256 * mib,
                (2, 16, 1024, 128),
                (1 * kib, 1 * mib, 64 * mib),
                0.01,
                2,
                200,
            )
        squares = tuple((n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192))
        skinny = (
            (8192, 1024, 1024),
            (16384, 4096, 1024),
            (16384, 1024, 4096),
            (4096, 14336, 4096),
            (4096, 4096, 14336),
            (8192, 16032, 4096),
            (2048, 512, 4096),
            (65536, 128, 128),
        )
        return Settings(
            squares + skinny,
            GiB,
            (4, 32, 2048, 128),
            (1 * kib, 16 * kib, 256 * kib, 4 * mib, 32 * mib, 128 * mib, 512 * mib),
            0.05,
            3,
            1000,
        )
    if quick:
        return Settings(
            ((128, 128, 128), (256, 256, 256), (1024, 128, 128), (2048, 256, 256)),
            8 * mib,
            (1, 4, 128, 32),
            (256, 64 * kib, 1 * mib),
            0.01,
            2,
            200,
        )
    squares = tuple((n, n, n) for n in (64, 128, 256, 512, 1024, 2048))
    skinny = (
        (1024, 256, 256),
        (1024, 768, 256),
        (1024, 256, 768),
        (4096, 256, 256),
        (4096, 4096, 256),
        (8192, 128, 128),
        (256, 2048, 2048),
        (4096, 64, 64),
    )
    return Settings(
        squares + skinny,
        64 * mib,
        (4, 8, 512, 32),
        (64, 1 * kib, 16 * kib, 128 * kib, 1 * mib, 4 * mib, 16 * mib),
        0.1,
        3,
        2000,
    )


# ---- process group ---------------------------------------------------------------------------


def _init_process_group(device: str) -> bool:
    """Initialise the default group from the ``torchrun`` environment if needed (NCCL for
    cuda, gloo for cpu); returns whether this call created it."""
    if dist.is_initialized():
        return False
    local_device(device)
    dist.init_process_group(backend_for(device))
    return True


def _torch_device(device: str) -> torch.device:
    return local_device(device)


def _cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _sync(dev: torch.device) -> None:
    """Wait for the device's queued work (the timing helpers' only ``torch.cuda`` call)."""
    if dev.type == "cuda":
        synchronize(dev)


def _device_memory_bytes(dev: torch.device, ranks_per_node: int) -> tuple[int, str]:
    """Memory one rank may use and how it was found: the GPU's total memory on CUDA; on CPU
    the physical memory divided among the ranks of the node."""
    if dev.type == "cuda":
        return total_memory_bytes(dev), "device total memory (torch)"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(1, ranks_per_node), f"physical memory / {ranks_per_node} ranks"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _time_per_call(
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
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    once = agree(time.perf_counter() - t0)
    iters = max(1, min(s.max_iters, math.ceil(s.min_time_s / max(once, 1e-9))))
    best = math.inf
    for _ in range(s.trials):
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(dev)
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
        sec = _time_per_call(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), dev, s)
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
    sec = _time_per_call(lambda: dst.copy_(src), dev, s)
    return 2.0 * n * 4 / sec


def measure_attention(dev: torch.device, dtype: torch.dtype, s: Settings) -> tuple[float, dict]:
    """FLOP/s of causal attention forward + backward counted as the planner counts it
    (:func:`tetrad.plan.compute.attention_fwd_flops`: forward ``2 b S^2 d a``, backward 2.5x),
    and the shape used."""
    b, a, seq, d = s.attention
    q, k, v = (torch.randn(b, a, seq, d, device=dev).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(b, a, seq, d, device=dev).to(dtype)

    def step() -> None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(grad)
        q.grad = k.grad = v.grad = None

    sec = _time_per_call(step, dev, s)
    flops = 3.5 * 2.0 * b * seq * seq * d * a
    return flops / sec, {
        "batch": b,
        "heads": a,
        "seq_len": seq,
        "head_dim": d,
        "seconds": sec,
        "flops": flops,
    }


def efficiency_table(gemms: list[dict], peak: float) -> list[list[float]]:
    """``[[flops, fraction], ...]`` ascending: per half decade of GEMM FLOPs, the median
    fraction of ``peak`` (clamped to ``[0.001, 1]``) at the geometric mean of its FLOPs."""
    buckets: dict[float, list[dict]] = {}
    for g in gemms:
        buckets.setdefault(round(2.0 * math.log10(g["flops"])) / 2.0, []).append(g)
    table = []
    for key in sorted(buckets):
        rows = buckets[key]
        f = 10 ** statistics.fmean(math.log10(r["flops"]) for r in rows)
        e = statistics.median(r["flops_per_s"] for r in rows) / peak
        table.append([_sig(f), round(min(1.0, max(0.001, e)), 3)])
    return table


# ---- collectives -----------------------------------------------------------------------------


def layouts(world: int) -> list[tuple[int, int]]:
    """``(stride, size)`` of every grid-axis group layout of ``world`` ranks: ``size > 1`` and
    ``stride * size`` dividing ``world`` (stride 1 first)."""
    return [
        (st, g)
        for g in range(2, world + 1)
        if world % g == 0
        for st in range(1, world // g + 1)
        if (world // g) % st == 0
    ]


def group_ranks(stride: int, size: int, world: int) -> list[list[int]]:
    """The groups ``{base + i * stride : i < size}`` that partition ``range(world)``."""
    block = stride * size
    return [
        [outer * block + i * stride + inner for i in range(size)]
        for outer in range(world // block)
        for inner in range(stride)
    ]


def hops(kind: str, size: int) -> int:
    """Ring steps the planner charges latency for (:meth:`tetrad.plan.network.Link.time`)."""
    if kind == ALL_REDUCE:
        return min(2 * (size - 1), 2 * math.ceil(math.log2(size)))
    return size - 1


def measure_collectives(dev: torch.device, s: Settings) -> list[dict]:
    """Seconds per call of all-reduce and all-gather over every layout of :func:`layouts` and
    payload of ``s`` (every rank calls; all groups of a layout run at once; the slowest rank
    counts). Dicts with ``kind, stride, members, payload_bytes, ring_bytes, seconds``."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def world_max(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    out = []
    for stride, size in layouts(world):
        mine = None
        made = []
        for ranks in group_ranks(stride, size, world):
            pg = dist.new_group(ranks)
            made.append(pg)
            if rank in ranks:
                mine = pg
        warm = torch.zeros(size, dtype=torch.float32, device=dev)
        for _ in range(3):  # connect the new groups before timing anything
            dist.all_reduce(warm, group=mine)
        for kind in KINDS:
            for payload in s.payloads:
                elems = -(-payload // (4 * size)) * size
                buf = torch.zeros(elems, dtype=torch.float32, device=dev)
                if kind == ALL_REDUCE:

                    def fn(buf=buf, pg=mine):
                        dist.all_reduce(buf, group=pg)
                else:
                    inp = torch.zeros(elems // size, dtype=torch.float32, device=dev)

                    def fn(buf=buf, inp=inp, pg=mine):
                        dist.all_gather_single(buf, inp, group=pg)

                dist.barrier()
                sec = _time_per_call(fn, dev, s, world_max)
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


def _nnls(rows: list[list[float]], target: list[float]) -> list[float]:
    """Least squares ``rows @ x ~ target`` with ``x >= 0`` (drop the most negative coefficient
    and solve again until none is negative)."""
    ncol = len(rows[0])
    active = list(range(ncol))
    x = [0.0] * ncol
    while active:
        a = torch.tensor([[r[j] for j in active] for r in rows], dtype=torch.float64)
        b = torch.tensor(target, dtype=torch.float64).unsqueeze(1)
        sol = torch.linalg.lstsq(a, b, driver="gelsd").solution.squeeze(1).tolist()
        worst = min(range(len(active)), key=lambda i: sol[i])
        if sol[worst] >= 0.0:
            for i, j in enumerate(active):
                x[j] = sol[i]
            return x
        active.pop(worst)
    return x


def fit_alpha_beta(points: list[dict]) -> tuple[dict[str, float], float]:
    """Fit ``seconds = alpha[kind] + ring_bytes / bandwidth`` to measurements of one layout
    (dicts as from :func:`measure_collectives`), minimising relative error, coefficients
    non-negative. Returns ``({kind: alpha seconds}, bandwidth bytes/s)``; when the times do not
    grow with the bytes, the bandwidth is the best ``ring_bytes / seconds`` seen."""
    kinds = sorted({p["kind"] for p in points})
    rows, target = [], []
    for p in points:
        t = p["seconds"]
        rows.append([(1.0 if p["kind"] == k else 0.0) / t for k in kinds] + [p["ring_bytes"] / t])
        target.append(1.0)
    x = _nnls(rows, target)
    inv_bw = x[-1]
    if inv_bw <= 0.0:
        bw = max(p["ring_bytes"] / p["seconds"] for p in points)
    else:
        bw = 1.0 / inv_bw
    return dict(zip(kinds, x[:-1], strict=True)), bw


def fit_latency(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Fit ``alpha = base + hops * hop`` to ``(hops, alpha seconds)`` pairs, both ``>= 0``.
    Returns ``(base, hop)`` seconds; ``(0, 0)`` without points."""
    if not points:
        return 0.0, 0.0
    base, hop = _nnls([[1.0, float(h)] for h, _ in points], [a for _, a in points])
    return base, hop


# ---- the machine file ------------------------------------------------------------------------


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (keeps the TOML readable)."""
    return float(f"{x:.{digits}g}")


def to_toml(d: dict, header: str = "") -> str:
    """A TOML document of ``d`` (written by ``tomli_w``) under ``header`` as comments."""
    lines = [f"# {h}" if h else "#" for h in header.splitlines()]
    return "\n".join(lines) + ("\n" if lines else "") + tomli_w.dumps(d)


def _check_out(out: str) -> str:
    """The absolute output path; raises :class:`CalibrationError` if its folder is missing or
    not writable."""
    path = os.path.abspath(out)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise CalibrationError(
            f"output folder {folder!r} does not exist: create it or give another --out"
        )
    if not os.access(folder, os.W_OK):
        raise CalibrationError(f"output folder {folder!r} is not writable: give another --out")
    return path


def _check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise CalibrationError(f"device {device!r} is unknown: use cpu or cuda")
    if device == "cuda" and not gpu_count():
        raise CalibrationError("--device cuda but no CUDA device is visible: use --device cpu")


def calibrate(device: str = "cpu", out: str = "machine.toml", quick: bool = False) -> dict:
    """Measure this machine on every rank of a job and write a machine TOML (rank 0).

    Call on every rank; initialises the default process group from the ``torchrun``
    environment if none exists (NCCL for ``cuda``, gloo for ``cpu``) and destroys it again at
    the end in that case. On CPU each rank uses ``max(1, cpu_count // world)`` threads. See the
    module doc for what is measured and how the numbers are derived.

    Args:
        device: ``cpu`` or ``cuda``.
        out: the TOML file rank 0 writes (its folder must exist).
        quick: a few shapes and payloads (a few seconds; for tests).

    Returns:
        The machine description written, as a dict (same on every rank): the keys of
        :func:`tetrad.plan.machines.parse_machine` plus ``[sources]`` and the raw
        ``[calibration]`` data. Units: ``memory_gib`` GiB, ``peak_tflops`` TFLOP/s per rank,
        ``hbm_gbps`` and every bandwidth GB/s (1e9 bytes/s), latencies microseconds.

    Raises:
        CalibrationError: unknown device, CUDA asked for but absent, a single rank (nothing to
            measure the network with), or an output folder that is missing or not writable.
    """
    _check_device(device)
    owned = _init_process_group(device)
    try:
        return _calibrate(device, out, quick)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _calibrate(device: str, out: str, quick: bool) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    err: list = [None]
    if rank == 0:
        try:
            if world < 2:
                raise CalibrationError(
                    "calibrate needs at least 2 ranks to measure the network: use --nproc 2 or more"
                )
            _check_out(out)
        except CalibrationError as e:
            err = [str(e)]
    dist.broadcast_object_list(err, src=0)
    if err[0] is not None:
        raise CalibrationError(err[0])

    dev = _torch_device(device)
    cores = _cores()
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        threads = max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
    s = settings(dev.type, quick)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))

    # ---- compute: CUDA every GPU at once (slowest kept); CPU rank 0 alone ------------------
    comp: list = [None]
    if dev.type == "cuda" or rank == 0:
        gemms = measure_gemms(dev, dtype, s)
        copy_bps = measure_copy(dev, s)
        att_rate, att_shape = measure_attention(dev, dtype, s)
        comp = [
            {"gemms": gemms, "copy": copy_bps, "attention": att_rate, "attention_shape": att_shape}
        ]
    if dev.type == "cuda":
        rates = torch.tensor(
            [g["flops_per_s"] for g in comp[0]["gemms"]] + [comp[0]["copy"], comp[0]["attention"]],
            dtype=torch.float64,
            device=dev,
        )
        dist.all_reduce(rates, op=dist.ReduceOp.MIN)
        vals = rates.tolist()
        for g, r in zip(comp[0]["gemms"], vals, strict=False):
            g["flops_per_s"], g["seconds"] = r, g["flops"] / r
        comp[0]["copy"], comp[0]["attention"] = vals[-2], vals[-1]
    dist.broadcast_object_list(comp, src=0)
    comp = comp[0]

    # ---- collectives -----------------------------------------------------------------------
    colls = measure_collectives(dev, s)

    result: list = [None]
    if rank == 0:
        result = [_describe(dev, out, quick, world, ranks_per_node, cores, threads, comp, colls)]
        path = _check_out(out)
        text = to_toml(
            result[0],
            header=(
                "Machine description measured by `tetrad calibrate` (tetrad/train/calibrate.py).\n"
                "Use: tetrad plan --machine FILE ...   Sources of every number: [sources].\n"
                "[calibration] holds the raw measurements (the planner ignores it)."
            ),
        )
        stem = os.path.splitext(os.path.basename(path))[0]
        parse_machine(tomllib.loads(text), stem)  # the planner must accept what we write
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
        result[0]["calibration"]["path"] = path
    dist.broadcast_object_list(result, src=0)
    return result[0]


def _describe(
    dev: torch.device,
    out: str,
    quick: bool,
    world: int,
    ranks_per_node: int,
    cores: int,
    threads: int,
    comp: dict,
    colls: list[dict],
) -> dict:
    """The machine dict from the measurements (rank 0)."""
    date = datetime.date.today().isoformat()
    if dev.type == "cuda":
        name = device_name(dev)
        what = f"{name}, bf16"
    else:
        name = f"CPU: {_cpu_model()} ({cores} cores, {threads} thread(s) per rank)"
        what = f"CPU {_cpu_model()}, fp32, {threads} thread(s) per rank"
    pre = f"measured by tetrad calibrate on {date}, {world} ranks, {what}"
    src: dict[str, str] = {}

    gemms = comp["gemms"]
    best = max(gemms, key=lambda g: g["flops_per_s"])
    rate = best["flops_per_s"]
    shape = f"{best['m']}x{best['n']}x{best['k']}"
    if dev.type == "cuda":
        peak = peak_flops(dev)
        if peak:
            src["peak_tflops"] = (
                f"{name} datasheet dense bf16 (tetrad.device.GPU_PEAK_FLOPS); "
                f"{pre}: best GEMM {rate / 1e12:.1f} TFLOP/s ({shape})"
            )
        else:
            peak = rate
            src["peak_tflops"] = (
                f"{pre}: {name} is not in tetrad.device.GPU_PEAK_FLOPS, so "
                f"the best measured GEMM rate ({shape})"
            )
        share = 1.0
    else:
        share = min(cores, world) / world
        peak = rate * share
        src["peak_tflops"] = (
            f"{pre}: per-rank peak = best single-rank GEMM rate "
            f"{rate / 1e9:.2f} GFLOP/s ({shape}, rank 0 alone) x "
            f"min({cores} cores, {world} ranks) / {world} ranks"
        )
    table = efficiency_table(gemms, peak / share)
    src["gemm_efficiency"] = (
        f"{pre}: {len(gemms)} GEMM shapes (square and skinny), median fraction of "
        + ("the datasheet peak" if dev.type == "cuda" else "the best single-rank rate")
        + " per half decade of FLOPs"
    )
    att = min(1.0, max(0.001, comp["attention"] / (peak / share)))
    a = comp["attention_shape"]
    src["attention_efficiency"] = (
        f"{pre}: causal scaled_dot_product_attention forward+backward, b={a['batch']} "
        f"heads={a['heads']} S={a['seq_len']} d={a['head_dim']}, FLOPs as the planner counts "
        f"them (forward 2 b S^2 d a, backward 2.5x): {comp['attention'] / 1e9:.2f} GFLOP/s"
    )
    hbm = comp["copy"] * share
    src["hbm_gbps"] = f"{pre}: tensor copy, 2 x bytes / time = {comp['copy'] / 1e9:.1f} GB/s" + (
        "" if dev.type == "cuda" else " (rank 0 alone) x min(cores, ranks) / ranks"
    )
    mem, how = _device_memory_bytes(dev, ranks_per_node)
    src["memory_gib"] = f"{pre}: {how}"
    src["gpus_per_node"] = f"{pre}: ranks on this node (LOCAL_WORLD_SIZE, else the world)"

    # ---- network fits --------------------------------------------------------------------
    fits = []
    for stride, size in layouts(world):
        pts = [c for c in colls if c["stride"] == stride and c["members"] == size]
        alphas, bw = fit_alpha_beta(pts)
        q, nodes = placement(stride, size, ranks_per_node)
        fits.append(
            {
                "stride": stride,
                "members": size,
                "members_per_node": q,
                "nodes": nodes,
                "gbps": _sig(bw / 1e9),
                **{f"alpha_{k}_us": _sig(v * 1e6) for k, v in alphas.items()},
            }
        )
    intra = [f for f in fits if f["nodes"] == 1]
    inter = [f for f in fits if f["nodes"] > 1]
    lat_in = [(hops(k, f["members"]), f[f"alpha_{k}_us"] * 1e-6) for f in intra for k in KINDS]
    base, hop_in = fit_latency(lat_in)
    whole = [f for f in intra if f["stride"] == 1 and f["members"] == min(ranks_per_node, world)]
    intra_gbps = whole[0]["gbps"] if whole else max((f["gbps"] for f in intra), default=0.0)
    net_src = (
        f"{pre}: all-reduce and all-gather of {len(colls) // max(1, len(fits) * 2)} "
        "payloads per group layout, all groups at once, alpha-beta ring fit"
    )
    if intra:
        src["intra_node_gbps"] = (
            f"{net_src}: the stride-1 group of {whole[0]['members']} ranks"
            if whole
            else f"{net_src}: the best in-node group"
        )
        src["intra_table"] = f"{net_src}: each in-node (stride, members)"
    if inter:
        inter_pm = min(f["gbps"] / f["members_per_node"] for f in inter)
        lat_x = [
            (hops(k, f["members"]), f[f"alpha_{k}_us"] * 1e-6 - base) for f in inter for k in KINDS
        ]
        num = sum(h * a for h, a in lat_x)
        hop_x = max(0.0, num / sum(h * h for h, _ in lat_x))
        src["inter_node_gbps_per_member"] = (
            f"{net_src}: worst group spanning nodes, bandwidth over its members per node"
        )
        src["latency"] = (
            f"{net_src}: per-kind alpha fitted to base + hops x hop (in-node "
            "groups), inter-node hop from the groups spanning nodes"
        )
        if not intra:
            intra_gbps = max(f["gbps"] for f in inter)
            src["intra_node_gbps"] = f"{net_src}: no in-node group measured; the best group"
    else:
        inter_pm = min(f["gbps"] for f in fits)
        hop_x = hop_in
        src["inter_node_gbps_per_member"] = (
            f"{pre}: single node, nothing crosses nodes: set to the worst measured in-node "
            "bandwidth (not an inter-node measurement)"
        )
        src["latency"] = (
            f"{net_src}: per-kind alpha fitted to base + hops x hop; single node: "
            "the inter-node hop is set to the in-node one (not measured)"
        )
    network = {
        "intra_node_gbps": _sig(intra_gbps),
        "inter_node_gbps_per_member": _sig(inter_pm),
        "latency_base_us": _sig(base * 1e6),
        "latency_hop_intra_us": _sig(hop_in * 1e6),
        "latency_hop_inter_us": _sig(hop_x * 1e6),
        "intra_table": [
            {"stride": f["stride"], "members": f["members"], "gbps": f["gbps"]} for f in intra
        ],
    }
    stem = os.path.splitext(os.path.basename(out))[0]
    return {
        "name": stem,
        "description": f"{pre} ({'quick' if quick else 'full'} calibration)",
        "gpu": name,
        "gpus_per_node": ranks_per_node,
        "memory_gib": _sig(mem / GiB),
        "peak_tflops": _sig(peak / 1e12),
        "hbm_gbps": _sig(hbm / 1e9),
        "network": network,
        "compute": {"gemm_efficiency": table, "attention_efficiency": round(att, 3)},
        "sources": src,
        "calibration": {
            "date": date,
            "world": world,
            "device": dev.type,
            "device_name": name,
            "cores": cores,
            "threads_per_rank": threads,
            "quick": quick,
            "gemm": [
                {
                    "m": g["m"],
                    "n": g["n"],
                    "k": g["k"],
                    "flops": g["flops"],
                    "seconds": _sig(g["seconds"]),
                    "gflops": _sig(g["flops_per_s"] / 1e9),
                }
                for g in gemms
            ],
            "attention_gflops": _sig(comp["attention"] / 1e9),
            "copy_gbps": _sig(comp["copy"] / 1e9),
            "collectives": [
                {
                    "kind": c["kind"],
                    "stride": c["stride"],
                    "members": c["members"],
                    "payload_bytes": c["payload_bytes"],
                    "seconds": _sig(c["seconds"]),
                }
                for c in colls
            ],
            "fits": fits,
        },
    }


def summary(result: dict) -> str:
    """A few lines on what :func:`calibrate` found (for rank 0 to print)."""
    cal, net, comp = result["calibration"], result["network"], result["compute"]
    best = max(cal["gemm"], key=lambda g: g["gflops"])
    eff = comp["gemm_efficiency"]
    lines = [
        f"tetrad calibrate: {cal['world']} ranks, {result['gpu']}",
        f"  GEMM: best {best['gflops']:.4g} GFLOP/s ({best['m']}x{best['n']}x{best['k']}); "
        f"peak {result['peak_tflops'] * 1e3:.4g} GFLOP/s per rank; efficiency "
        f"{eff[0][1]:.2f} at {eff[0][0]:.2g} FLOPs .. {eff[-1][1]:.2f} at {eff[-1][0]:.2g}",
        f"  attention efficiency {comp['attention_efficiency']:.2f}; memory "
        f"{result['hbm_gbps']:.4g} GB/s per rank",
        "  collectives (bus bandwidth; alpha per call):",
    ]
    for f in cal["fits"]:
        where = "inner" if f["stride"] == 1 else "outer"
        lines.append(
            f"    G={f['members']} stride={f['stride']} ({where}): {f['gbps']:.4g} GB/s, "
            f"all-reduce {f.get('alpha_all_reduce_us', 0.0):.4g} us, "
            f"all-gather {f.get('alpha_all_gather_us', 0.0):.4g} us"
        )
    lines.append(
        f"  latency: {net['latency_base_us']:.4g} us + {net['latency_hop_intra_us']:.4g} "
        "us per ring step"
    )
    lines.append(f"  wrote {cal.get('path', result['name'])} (use: tetrad plan --machine FILE ...)")
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrateJob:
    """What the workers of :func:`run` are asked to do (picklable; ``device`` is read by
    :func:`tetrad.train.launch.run_local` to set ``OMP_NUM_THREADS``)."""

    device: str
    out: str
    quick: bool


def worker(job: CalibrateJob) -> None:
    """Worker entrypoint of :func:`run`: :func:`calibrate`, then the summary on rank 0."""
    result = calibrate(job.device, job.out, job.quick)
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary(result), flush=True)


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (gloo, fp32 GEMMs) or cuda (NCCL, bf16 GEMMs)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="ranks to start (default: the CUDA device count, or 4 on CPU); ignored under torchrun",
    )
    p.add_argument(
        "--out",
        default="machine.toml",
        metavar="FILE",
        help="machine TOML to write (default machine.toml)",
    )
    p.add_argument(
        "--quick", action="store_true", help="few shapes and payloads: seconds instead of a minute"
    )


def add_command(subparsers) -> None:
    """Register ``calibrate`` on an ``add_subparsers()`` object; dispatch with :func:`run`."""
    p = subparsers.add_parser(
        "calibrate",
        help="measure GEMMs and collectives; write a machine TOML for tetrad plan",
        description="Measure GEMM throughput, memory bandwidth, attention and collective "
        "bandwidth/latency over grid-like rank groups on this machine, and write a machine "
        "TOML that `tetrad plan --machine FILE` reads. Without torchrun, starts --nproc local "
        "workers.",
    )
    _add_options(p)


def run(args: argparse.Namespace) -> int:
    """Run ``tetrad calibrate``: under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) calibrate
    in this process; otherwise start ``--nproc`` local workers.

    Returns:
        0 on success, 2 for a mistake in the inputs (one line ``tetrad: error: ...`` on
        stderr).

    Raises:
        SystemExit(1): a worker failed (from :func:`tetrad.train.launch.run_local`).
    """
    try:
        _check_device(args.device)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            worker(CalibrateJob(args.device, args.out, args.quick))
            return 0
        out = _check_out(args.out)
        nproc = args.nproc
        if nproc is None:
            nproc = gpu_count() if args.device == "cuda" else 4
        if nproc < 2:
            raise CalibrationError(
                f"--nproc {nproc}: calibrate needs at least 2 ranks to measure the network"
            )
        if args.device == "cuda" and gpu_count() < nproc:
            raise CalibrationError(
                f"--nproc {nproc} needs {nproc} GPUs, but {gpu_count()} are visible"
            )
    except CalibrationError as e:
        print(f"tetrad: error: {e}", file=sys.stderr)
        return 2
    from tetrad.train.launch import run_local

    print(f"tetrad: calibrating with {nproc} workers ({args.device})", file=sys.stderr, flush=True)
    run_local(CalibrateJob(args.device, out, args.quick), nproc, entrypoint=worker)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tetrad.train.calibrate [--device ...] [--nproc N] [--out FILE] [--quick]``."""
    p = argparse.ArgumentParser(prog="tetrad calibrate", description=__doc__.splitlines()[0])
    _add_options(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    # Import by the package name so that the workers unpickle `tetrad.train.calibrate.worker`.
    from tetrad.train.calibrate import main as _main

    sys.exit(_main())
