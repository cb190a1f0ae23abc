"""Machine descriptions: GPUs per node, memory, peak FLOP/s, HBM bandwidth, network, GEMM table.

A machine is a TOML file. Presets ship in ``tetrad/plan/machine/presets/*.toml`` (each number
there has its source next to it); ``--machine path/to/file.toml`` reads a user file with the
same keys::

    name = "my-cluster"
    gpu = "NVIDIA H100 SXM5 80GB"
    gpus_per_node = 8
    memory_gib = 79.6            # usable device memory, GiB
    peak_tflops = 989.0          # dense bf16 tensor-core peak per GPU, TFLOP/s
    peak_fp8_tflops = 1979.0     # optional: dense FP8 tensor-core peak (with fp8_gemm_efficiency)
    hbm_gbps = 3350.0            # HBM bandwidth per GPU, GB/s

    [network]
    intra_node_gbps = 360.0               # bus bandwidth of a group inside a node, GB/s
    inter_node_gbps_per_member = 45.0     # per group member on a node, across nodes, GB/s
    latency_base_us = 8.4                 # per collective call
    latency_hop_intra_us = 0.5            # per ring step inside a node
    latency_hop_inter_us = 2.5            # per ring step across nodes
    intra_table = [{stride = 1, members = 2, gbps = 129.0}]   # optional measured entries

    [compute]
    # fraction of peak reached by one GEMM of F FLOPs: [[F, fraction], ...], log-interpolated
    gemm_efficiency = [[1e8, 0.2], [1e10, 0.6], [1e12, 0.75]]
    fp8_gemm_efficiency = [[1e8, 0.1], [1e10, 0.4], [1e12, 0.7]]   # of peak_fp8_tflops
    attention_efficiency = 0.45  # FlashAttention, fraction of peak
    overlap_slowdown = 0.1       # optional: GEMM slowdown while a transfer runs beside it

    [sources]                    # free text: where each number comes from
    peak_tflops = "NVIDIA H100 datasheet"

Plain Python; nothing from the rest of tetrad.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from importlib import resources

from tetrad.plan.errors import PlanError
from tetrad.plan.machine.network import Network
from tetrad.spec.toml import tomllib
from tetrad.spec.units import GiB


@dataclass(frozen=True)
class Machine:
    """One machine type (all nodes alike).

    Attributes:
        name: preset name or file stem.
        gpu: the accelerator, in words.
        gpus_per_node: GPUs (GCDs on MI250X) per node.
        memory_bytes: usable memory per GPU, bytes.
        peak_flops: dense bf16 peak per GPU, FLOP/s.
        hbm_bytes_per_s: memory bandwidth per GPU, bytes/s.
        network: the :class:`~tetrad.plan.machine.network.Network`.
        gemm_table: ``((flops, fraction), ...)`` ascending in flops: fraction of ``peak_flops``
            one GEMM of that many FLOPs reaches.
        attention_efficiency: fraction of peak of the FlashAttention kernels.
        description: one line.
        sources: where each number comes from (key -> text).
        overlap_slowdown: fraction by which a GEMM slows while a collective's transfer runs
            beside it (compute and memory contention; ``[compute] overlap_slowdown``, measured by
            ``tetrad calibrate``; 0 when not given). Used by the ``fine`` overlap's model
            (:mod:`tetrad.plan.comm.fine`).
        fp8_peak_flops: dense FP8 (E4M3) tensor-core peak per GPU, FLOP/s (``peak_fp8_tflops``;
            0: the GPU has no FP8 GEMMs, e.g. A100, MI250X).
        fp8_gemm_table: as ``gemm_table`` for FP8 GEMMs, fractions of ``fp8_peak_flops``
            (``[compute] fp8_gemm_efficiency``; empty without FP8).
    """

    name: str
    gpu: str
    gpus_per_node: int
    memory_bytes: int
    peak_flops: float
    hbm_bytes_per_s: float
    network: Network
    gemm_table: tuple[tuple[float, float], ...]
    attention_efficiency: float
    description: str = ""
    sources: dict = field(default_factory=dict, compare=False, hash=False)
    overlap_slowdown: float = 0.0
    fp8_peak_flops: float = 0.0
    fp8_gemm_table: tuple[tuple[float, float], ...] = ()

    @property
    def has_fp8(self) -> bool:
        """Whether the machine describes FP8 GEMMs (a peak and an efficiency table)."""
        return self.fp8_peak_flops > 0 and bool(self.fp8_gemm_table)

    def fp8_gemm_efficiency(self, flops: float) -> float:
        """Fraction of :attr:`fp8_peak_flops` one FP8 GEMM of ``flops`` FLOPs reaches: the FP8
        table interpolated as :meth:`gemm_efficiency` does the bf16 one.

        Raises:
            PlanError: the machine has no FP8 table.
        """
        table = self.fp8_gemm_table
        if not table:
            raise PlanError(f"machine {self.name} describes no FP8 GEMMs (peak_fp8_tflops)")
        if flops <= table[0][0]:
            return table[0][1]
        if flops >= table[-1][0]:
            return table[-1][1]
        xs = self.__dict__.get("_fp8_log_x_cache")
        if xs is None:
            xs = [math.log10(f) for f, _ in table]
            object.__setattr__(self, "_fp8_log_x_cache", xs)
        lx = math.log10(flops)
        i = bisect.bisect_right(xs, lx)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = table[i - 1][1], table[i][1]
        return y0 + (y1 - y0) * (lx - x0) / (x1 - x0)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB

    def gemm_efficiency(self, flops: float) -> float:
        """Fraction of peak one GEMM of ``flops`` FLOPs reaches: the table interpolated linearly
        in ``log10(flops)``, clamped to its first and last entries."""
        table = self.gemm_table
        if flops <= table[0][0]:
            return table[0][1]
        if flops >= table[-1][0]:
            return table[-1][1]
        xs = self._log_x
        lx = math.log10(flops)
        i = bisect.bisect_right(xs, lx)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = table[i - 1][1], table[i][1]
        return y0 + (y1 - y0) * (lx - x0) / (x1 - x0)

    @property
    def _log_x(self) -> list[float]:
        got = self.__dict__.get("_log_x_cache")
        if got is None:
            got = [math.log10(f) for f, _ in self.gemm_table]
            object.__setattr__(self, "_log_x_cache", got)
        return got

    def with_gemm_efficiency(self, fraction: float) -> Machine:
        """This machine with every bf16 GEMM at ``fraction`` of peak (a calibrated constant; the
        FP8 table, a separate calibration, is kept)."""
        if not 0.0 < fraction <= 1.0:
            raise PlanError(
                f"GEMM efficiency {fraction} must lie in (0, 1]: give a fraction "
                "of peak such as 0.7"
            )
        return dataclasses.replace(
            self,
            gemm_table=((1.0, fraction), (2.0, fraction)),
            sources={**self.sources, "gemm_efficiency": f"constant {fraction} (given)"},
        )

    def summary(self) -> str:
        return (
            f"{self.name}: {self.gpus_per_node}x {self.gpu}, {self.memory_gib:.1f} GiB, "
            f"{self.peak_flops / 1e12:.0f} TFLOP/s bf16"
        )


def _presets_dir():
    return resources.files("tetrad.plan.machine").joinpath("presets")


def preset_names() -> list[str]:
    """Names of the shipped machine presets."""
    return sorted(p.name[:-5] for p in _presets_dir().iterdir() if p.name.endswith(".toml"))


def _num(raw: dict, key: str, where: str, *, positive: bool = True) -> float:
    if key not in raw:
        raise PlanError(
            f"machine {where} lacks {key!r}: add it (see tetrad/plan/machine/description.py)"
        )
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PlanError(f"machine {where}: {key}={v!r} is not a number")
    if positive and v <= 0:
        raise PlanError(f"machine {where}: {key}={v} must be positive")
    return float(v)


def _gemm_pairs(comp: dict, key: str, where: str) -> list[tuple[float, float]]:
    """The ``[[flops, fraction], ...]`` table ``comp[key]``, sorted by FLOPs (one entry is
    repeated ten times the FLOPs further, so the table has two points).

    Raises:
        PlanError: not a list of pairs, FLOPs not positive or a fraction outside (0, 1].
    """
    gemm = comp.get(key)
    if not isinstance(gemm, list) or not gemm:
        raise PlanError(f"machine {where}: compute.{key} must be a list of [flops, fraction] pairs")
    try:
        pairs = sorted((float(f), float(e)) for f, e in gemm)
    except (TypeError, ValueError):
        raise PlanError(
            f"machine {where}: compute.{key} must be a list of [flops, fraction] pairs"
        ) from None
    if any(f <= 0 or not 0 < e <= 1 for f, e in pairs):
        raise PlanError(f"machine {where}: {key} needs flops > 0 and fractions in (0, 1]")
    if len(pairs) == 1:
        pairs.append((pairs[0][0] * 10, pairs[0][1]))
    return pairs


def _fp8(raw: dict, comp: dict, where: str) -> tuple[float, tuple]:
    """``(fp8_peak_flops, fp8_gemm_table)``: both keys given, or neither (no FP8).

    Raises:
        PlanError: one of ``peak_fp8_tflops`` and ``compute.fp8_gemm_efficiency`` without the
            other, or a malformed one.
    """
    has_peak, has_table = "peak_fp8_tflops" in raw, "fp8_gemm_efficiency" in comp
    if has_peak != has_table:
        raise PlanError(
            f"machine {where}: give peak_fp8_tflops and compute.fp8_gemm_efficiency together "
            "(or neither: no FP8 GEMMs)"
        )
    if not has_peak:
        return 0.0, ()
    peak = _num(raw, "peak_fp8_tflops", where) * 1e12
    return peak, tuple(_gemm_pairs(comp, "fp8_gemm_efficiency", where))


def parse_machine(raw: dict, name: str) -> Machine:
    """Build a :class:`Machine` from a parsed TOML table.

    Raises:
        PlanError: a missing or malformed key (one line naming it).
    """
    where = repr(name)
    net = raw.get("network")
    comp = raw.get("compute")
    if not isinstance(net, dict) or not isinstance(comp, dict):
        raise PlanError(f"machine {where} needs [network] and [compute] tables")
    gpn = _num(raw, "gpus_per_node", where)
    if not gpn.is_integer():
        raise PlanError(f"machine {where}: gpus_per_node={gpn} is not a whole number")
    table = []
    for e in net.get("intra_table", []):
        if not isinstance(e, dict) or "members" not in e or "gbps" not in e:
            raise PlanError(
                f"machine {where}: each network.intra_table entry needs members "
                "and gbps (and optionally stride)"
            )
        table.append((int(e.get("stride", 0)), int(e["members"]), float(e["gbps"])))
    network = Network(
        gpus_per_node=int(gpn),
        intra_node_gbps=_num(net, "intra_node_gbps", where),
        inter_node_gbps_per_member=_num(net, "inter_node_gbps_per_member", where),
        intra_table=tuple(table),
        latency_base_us=_num(net, "latency_base_us", where, positive=False),
        latency_hop_intra_us=_num(net, "latency_hop_intra_us", where, positive=False),
        latency_hop_inter_us=_num(net, "latency_hop_inter_us", where, positive=False),
    )
    pairs = _gemm_pairs(comp, "gemm_efficiency", where)
    fp8_peak, fp8_table = _fp8(raw, comp, where)
    att = _num(comp, "attention_efficiency", where)
    if att > 1:
        raise PlanError(f"machine {where}: attention_efficiency={att} must be at most 1")
    slow = (
        _num(comp, "overlap_slowdown", where, positive=False) if "overlap_slowdown" in comp else 0.0
    )
    if slow < 0:
        raise PlanError(f"machine {where}: overlap_slowdown={slow} must be at least 0")
    return Machine(
        name=str(raw.get("name", name)),
        gpu=str(raw.get("gpu", "GPU")),
        gpus_per_node=int(gpn),
        memory_bytes=int(_num(raw, "memory_gib", where) * GiB),
        peak_flops=_num(raw, "peak_tflops", where) * 1e12,
        hbm_bytes_per_s=_num(raw, "hbm_gbps", where) * 1e9,
        network=network,
        gemm_table=tuple(pairs),
        attention_efficiency=att,
        description=str(raw.get("description", "")),
        sources=dict(raw.get("sources", {})),
        overlap_slowdown=slow,
        fp8_peak_flops=fp8_peak,
        fp8_gemm_table=fp8_table,
    )


_LOADED: dict[str, Machine] = {}


def get_machine(text: str) -> Machine:
    """A preset by name (``perlmutter``, ``frontier``, ``dgx-a100-80gb``, ``dgx-h100``,
    ``h200-node``) or a TOML file path.

    Raises:
        PlanError: unknown name (with the closest preset), unreadable or malformed file.
    """
    text = str(text).strip()
    if text in _LOADED:
        return _LOADED[text]
    names = preset_names()
    if text in names:
        raw_text = _presets_dir().joinpath(f"{text}.toml").read_text(encoding="utf-8")
        name = text
    elif text.endswith(".toml") or os.path.sep in text or os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as fh:
                raw_text = fh.read()
        except OSError as e:
            raise PlanError(
                f"cannot read machine file {text!r} ({e.strerror}): give a "
                f"readable TOML file or one of {', '.join(names)}"
            ) from None
        name = os.path.splitext(os.path.basename(text))[0]
    else:
        near = difflib.get_close_matches(text, names, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise PlanError(
            f"unknown machine {text!r}{hint}: use one of {', '.join(names)} or a TOML file"
        )
    try:
        raw = tomllib.loads(raw_text)
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"machine file {text!r} is not valid TOML: {e}") from None
    machine = parse_machine(raw, name)
    _LOADED[text] = machine
    return machine
