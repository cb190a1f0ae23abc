"""The machine description of ``tetrad calibrate``: the dict of a machine TOML, built from the
measurements by rank 0 (:func:`describe`), every number with its source in ``[sources]`` and
the raw measurements in ``[calibration]`` (which the planner ignores).

Compute figures (:func:`compute_figures`):

- CUDA: the peak is the datasheet dense bf16 figure of :data:`tetrad.device.GPU_PEAK_FLOPS`,
  looked up by name (the best measured rate when the GPU is not in the table); the GEMM and
  attention efficiencies are fractions of it.
- CPU: there is no datasheet to trust, so rank 0 times the GEMMs alone (the others wait) with the
  threads a training rank gets (:func:`tetrad.device.threads_per_rank`: ``cpu_count // world``,
  at least 1). With ``R`` its best rate, the **per-rank peak** is ``R * min(cores, world) /
  world``: ``min(cores, world)`` ranks can run at once and the world shares them. Efficiencies
  are ``rate / R``, so the best shape is 1.0 and a training rank's GEMM of ``F`` FLOPs is
  predicted to take ``F / (peak * efficiency(F))``, the time-sliced share of one rank. The
  memory bandwidth is shared the same way.

Network figures (:func:`network_table`, from :func:`tetrad.calibrate.fit.fit_network`): groups
inside one node fill ``intra_table`` (``stride, members, gbps``) and ``intra_node_gbps`` (the
stride-1 group of a whole node); groups spanning nodes give ``inter_node_gbps_per_member`` (the
worst layout) and ``latency_hop_inter_us``. On a single node both are set from the in-node
measurements, and ``[sources]`` says so (:func:`network_sources`).
"""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass

import torch

from tetrad.calibrate.fit import NetworkFit, efficiency_table, fit_network, sig
from tetrad.device import datasheet_flops, device_name, total_memory_bytes
from tetrad.spec.units import GiB


@dataclass(frozen=True)
class Run:
    """One calibration job, as rank 0 describes it.

    Attributes:
        dev: this rank's device.
        out: the TOML file to write (its stem names the machine).
        quick: the quick measurement set.
        world: ranks in the job.
        ranks_per_node: ranks on this node (``LOCAL_WORLD_SIZE``, else the world).
        cores: CPU cores this process may run on.
        threads: torch threads per rank.
    """

    dev: torch.device
    out: str
    quick: bool
    world: int
    ranks_per_node: int
    cores: int
    threads: int


def device_memory_bytes(dev: torch.device, ranks_per_node: int) -> tuple[int, str]:
    """Memory one rank may use (bytes) and how it was found: the GPU's total memory on CUDA; on
    CPU the physical memory divided among the ranks of the node."""
    if dev.type == "cuda":
        return total_memory_bytes(dev), "device total memory (torch)"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(1, ranks_per_node), f"physical memory / {ranks_per_node} ranks"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else :func:`platform.processor`, else ``CPU``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _device_names(run: Run) -> tuple[str, str]:
    """``(name, what)``: the machine's ``gpu`` entry and what the sources say was measured."""
    if run.dev.type == "cuda":
        name = device_name(run.dev)
        return name, f"{name}, bf16"
    cpu = cpu_model()
    return (
        f"CPU: {cpu} ({run.cores} cores, {run.threads} thread(s) per rank)",
        f"CPU {cpu}, fp32, {run.threads} thread(s) per rank",
    )


def _peak(run: Run, gemms: list[dict], name: str, pre: str) -> tuple[float, float, str]:
    """``(peak, share, source)``: the per-rank peak FLOP/s, the fraction of the measured rates
    one rank gets (1 on CUDA; ``min(cores, world) / world`` on CPU) and the source line (see
    the module doc)."""
    best = max(gemms, key=lambda g: g["flops_per_s"])
    rate = best["flops_per_s"]
    shape = f"{best['m']}x{best['n']}x{best['k']}"
    if run.dev.type == "cuda":
        peak = datasheet_flops(run.dev)
        if peak:
            return (
                peak,
                1.0,
                (
                    f"{name} datasheet dense bf16 (tetrad.device.GPU_PEAK_FLOPS); "
                    f"{pre}: best GEMM {rate / 1e12:.1f} TFLOP/s ({shape})"
                ),
            )
        return (
            rate,
            1.0,
            (
                f"{pre}: {name} is not in tetrad.device.GPU_PEAK_FLOPS, so "
                f"the best measured GEMM rate ({shape})"
            ),
        )
    share = min(run.cores, run.world) / run.world
    return (
        rate * share,
        share,
        (
            f"{pre}: per-rank peak = best single-rank GEMM rate "
            f"{rate / 1e9:.2f} GFLOP/s ({shape}, rank 0 alone) x "
            f"min({run.cores} cores, {run.world} ranks) / {run.world} ranks"
        ),
    )


def compute_figures(run: Run, comp: dict, name: str, pre: str) -> tuple[dict, dict[str, str]]:
    """The compute figures of the machine from :func:`tetrad.calibrate.measure.measure_compute`'s
    ``comp``, and their sources (``pre`` starts each source line).

    Returns:
        ``({memory_gib, peak_tflops, hbm_gbps, compute}, sources)``: ``memory_gib`` GiB per rank,
        ``peak_tflops`` TFLOP/s per rank, ``hbm_gbps`` GB/s per rank, ``compute`` the
        ``[compute]`` table (``gemm_efficiency``, ``attention_efficiency``).
    """
    gemms = comp["gemms"]
    peak, share, src_peak = _peak(run, gemms, name, pre)
    src = {"peak_tflops": src_peak}
    table = efficiency_table(gemms, peak / share)
    src["gemm_efficiency"] = (
        f"{pre}: {len(gemms)} GEMM shapes (square and skinny), median fraction of "
        + ("the datasheet peak" if run.dev.type == "cuda" else "the best single-rank rate")
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
        "" if run.dev.type == "cuda" else " (rank 0 alone) x min(cores, ranks) / ranks"
    )
    mem, how = device_memory_bytes(run.dev, run.ranks_per_node)
    src["memory_gib"] = f"{pre}: {how}"
    figures = {
        "memory_gib": sig(mem / GiB),
        "peak_tflops": sig(peak / 1e12),
        "hbm_gbps": sig(hbm / 1e9),
        "compute": {"gemm_efficiency": table, "attention_efficiency": round(att, 3)},
    }
    return figures, src


def network_table(net: NetworkFit) -> dict:
    """The ``[network]`` table of the machine: bandwidths GB/s, latencies microseconds."""
    return {
        "intra_node_gbps": sig(net.intra_gbps),
        "inter_node_gbps_per_member": sig(net.inter_gbps_per_member),
        "latency_base_us": sig(net.base * 1e6),
        "latency_hop_intra_us": sig(net.hop_intra * 1e6),
        "latency_hop_inter_us": sig(net.hop_inter * 1e6),
        "intra_table": [
            {"stride": f["stride"], "members": f["members"], "gbps": f["gbps"]} for f in net.intra
        ],
    }


def network_sources(net: NetworkFit, n_colls: int, pre: str) -> dict[str, str]:
    """Where each ``[network]`` number came from, for ``n_colls`` collective measurements
    (``pre`` starts each source line)."""
    net_src = (
        f"{pre}: all-reduce and all-gather of {n_colls // max(1, len(net.layouts) * 2)} "
        "payloads per group layout, all groups at once, alpha-beta ring fit"
    )
    src: dict[str, str] = {}
    if net.intra:
        src["intra_node_gbps"] = (
            f"{net_src}: the stride-1 group of {net.whole['members']} ranks"
            if net.whole
            else f"{net_src}: the best in-node group"
        )
        src["intra_table"] = f"{net_src}: each in-node (stride, members)"
    if net.inter:
        src["inter_node_gbps_per_member"] = (
            f"{net_src}: worst group spanning nodes, bandwidth over its members per node"
        )
        src["latency"] = (
            f"{net_src}: per-kind alpha fitted to base + hops x hop (in-node "
            "groups), inter-node hop from the groups spanning nodes"
        )
        if not net.intra:
            src["intra_node_gbps"] = f"{net_src}: no in-node group measured; the best group"
    else:
        src["inter_node_gbps_per_member"] = (
            f"{pre}: single node, nothing crosses nodes: set to the worst measured in-node "
            "bandwidth (not an inter-node measurement)"
        )
        src["latency"] = (
            f"{net_src}: per-kind alpha fitted to base + hops x hop; single node: "
            "the inter-node hop is set to the in-node one (not measured)"
        )
    return src


def raw_calibration(
    run: Run, date: str, name: str, comp: dict, colls: list[dict], fits: list[dict]
) -> dict:
    """The ``[calibration]`` table: the raw measurements and per-layout fits (the planner
    ignores it)."""
    return {
        "date": date,
        "world": run.world,
        "device": run.dev.type,
        "device_name": name,
        "cores": run.cores,
        "threads_per_rank": run.threads,
        "quick": run.quick,
        "gemm": [
            {
                "m": g["m"],
                "n": g["n"],
                "k": g["k"],
                "flops": g["flops"],
                "seconds": sig(g["seconds"]),
                "gflops": sig(g["flops_per_s"] / 1e9),
            }
            for g in comp["gemms"]
        ],
        "attention_gflops": sig(comp["attention"] / 1e9),
        "copy_gbps": sig(comp["copy"] / 1e9),
        "collectives": [
            {
                "kind": c["kind"],
                "stride": c["stride"],
                "members": c["members"],
                "payload_bytes": c["payload_bytes"],
                "seconds": sig(c["seconds"]),
            }
            for c in colls
        ],
        "fits": fits,
    }


def describe(run: Run, comp: dict, colls: list[dict]) -> dict:
    """The machine dict from the measurements (rank 0): the keys of
    :func:`tetrad.plan.machine.description.parse_machine` plus ``[sources]`` and ``[calibration]``.

    Args:
        run: the job.
        comp: the compute measurements of :func:`tetrad.calibrate.measure.measure_compute`.
        colls: the collective measurements of
            :func:`tetrad.calibrate.measure.measure_collectives`.
    """
    date = datetime.date.today().isoformat()
    name, what = _device_names(run)
    pre = f"measured by tetrad calibrate on {date}, {run.world} ranks, {what}"
    figures, src = compute_figures(run, comp, name, pre)
    if "overlap" in comp:
        ov = comp["overlap"]
        figures["compute"]["overlap_slowdown"] = round(ov["slowdown"], 3)
        src["overlap_slowdown"] = (
            f"{pre}: a GEMM {ov['gemm_s'] * 1e3:.3f} ms alone, {ov['gemm_with_comm_s'] * 1e3:.3f} "
            f"ms while a {ov['payload_bytes'] / 2**20:.0f} MiB all-reduce over all ranks ran "
            "beside it (slowest rank)"
        )
    src["gpus_per_node"] = f"{pre}: ranks on this node (LOCAL_WORLD_SIZE, else the world)"
    net = fit_network(colls, run.world, run.ranks_per_node)
    src.update(network_sources(net, len(colls), pre))
    return {
        "name": os.path.splitext(os.path.basename(run.out))[0],
        "description": f"{pre} ({'quick' if run.quick else 'full'} calibration)",
        "gpu": name,
        "gpus_per_node": run.ranks_per_node,
        "memory_gib": figures["memory_gib"],
        "peak_tflops": figures["peak_tflops"],
        "hbm_gbps": figures["hbm_gbps"],
        "network": network_table(net),
        "compute": figures["compute"],
        "sources": src,
        "calibration": raw_calibration(run, date, name, comp, colls, net.layouts),
    }
