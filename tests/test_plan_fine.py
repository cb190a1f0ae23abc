"""The planner's model of the fused GEMM + collective rings (tetrad.plan.comm.fine) and
``tetrad plan --sublayers``: closed forms where the replay has one, and the CLI (no processes)."""

import pytest

from tetrad.cli import main
from tetrad.plan.comm.fine import (
    ring_all_gather_seconds,
    ring_reduce_scatter_seconds,
    sublayer_seconds,
)
from tetrad.plan.machine.network import Link

LINK = Link(4, 1, 4, 1, bandwidth=1e9, hop_latency=0.0, base_latency=1e-6)


def linear_gemm(flops: float) -> float:
    return flops / 1e12  # 1 TFLOP/s whatever the size


def test_one_piece_reduce_scatter_is_serial():
    """q = 1: each step's addmm waits for the running sum, so G GEMM pieces and G-1 transfers."""
    flops, payload = 4e9, 4e6
    a, b = flops / 4 / 1e12, 1e-6 + payload / 4 / 1e9
    got = ring_reduce_scatter_seconds(linear_gemm, flops, payload, LINK, 1)
    assert got == pytest.approx(4 * a + 3 * b)


def test_pieces_hide_transfers_behind_compute():
    """Compute-bound (transfer of a piece shorter than its GEMM): with many pieces the ring
    approaches the GEMM plus one piece's transfer per step boundary, far below serial."""
    flops, payload = 4e10, 4e5
    serial = ring_reduce_scatter_seconds(linear_gemm, flops, payload, LINK, 1)
    piecewise = ring_reduce_scatter_seconds(linear_gemm, flops, payload, LINK, 8)
    gemm = linear_gemm(flops)
    assert gemm < piecewise < serial
    assert piecewise - gemm < 0.5 * (serial - gemm)


def test_all_gather_forwards_before_multiplying():
    """All-gather -> GEMM, transfer-bound: the ring's G-1 transfers, then the last GEMM piece."""
    flops, payload = 4e6, 4e7
    a, b = flops / 4 / 1e12, 1e-6 + payload / 4 / 1e9
    got = ring_all_gather_seconds(linear_gemm, flops, payload, LINK, 1)
    assert got == pytest.approx(3 * b + a)


def test_contention_slows_only_the_fused_path():
    flops, payload = 4e9, 4e6
    base = sublayer_seconds(linear_gemm, flops, payload, LINK, 2)
    slow = sublayer_seconds(linear_gemm, flops, payload, LINK, 2, slowdown=0.5)
    assert slow["fused"] > base["fused"] and slow["sequential"] == base["sequential"]
    assert base["ideal"] == max(base["gemm"], base["collective"])


def test_plan_sublayers_prints_t3_table(capsys):
    assert (
        main(["plan", "--model", "mega-gpt-2", "--machine", "t3-sim", "--sublayers", "8,16"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("OP fwd") == 2 and "T3-MCA (reported" in out and "geomean" in out


def test_plan_without_gpus_says_what_to_add(capsys):
    assert main(["plan", "--model", "llama-1b", "--machine", "dgx-h100"]) != 0
    assert "--gpus and --global-batch" in capsys.readouterr().err
