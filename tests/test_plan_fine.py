"""The planner's model of the fused GEMM + collective rings (tetrad.plan.comm.fine) and
``tetrad plan --sublayers``: closed forms where the replay has one, and the CLI (no processes)."""

import random

import pytest

from tetrad.cli import main
from tetrad.plan.comm.fine import (
    CHUNK_CANDIDATES,
    reduce_scatter_ring_seconds,
    replay_reduce_scatter,
    ring_all_gather_seconds,
    ring_reduce_scatter_seconds,
    sublayer_seconds,
)
from tetrad.plan.machine.description import get_machine, preset_names
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
    """Compute-bound (transfer of a piece shorter than its GEMM): with many pieces every transfer
    hides behind the next piece's GEMM and the ring takes the GEMM's time (exactly, at a GEMM
    speed independent of its size: ``a G q``), far below serial."""
    flops, payload = 4e10, 4e5
    serial = ring_reduce_scatter_seconds(linear_gemm, flops, payload, LINK, 1)
    piecewise = ring_reduce_scatter_seconds(linear_gemm, flops, payload, LINK, 8)
    gemm = linear_gemm(flops)
    assert piecewise == pytest.approx(gemm, rel=1e-12) and piecewise < serial
    assert piecewise - gemm < 0.5 * (serial - gemm)


def test_reduce_scatter_closed_form_equals_the_replay():
    """The closed form against the event-by-event replay (the oracle) on 20,000 rings: every
    ring size and chunk count the planner meets, compute-bound, transfer-bound, balanced and
    exactly tied pieces."""
    rng = random.Random(31)
    sizes = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64, 128)
    for _ in range(20_000):
        g, q = rng.choice(sizes), rng.choice((*CHUNK_CANDIDATES, 3, 16))
        a = 10 ** rng.uniform(-7, -1)
        b = rng.choice(
            (a * 10 ** rng.uniform(-3, 3), a, a * (q - 1), a / max(1, q - 1), a * rng.randint(1, 4))
        )
        want = replay_reduce_scatter(a, b, g, q)
        assert reduce_scatter_ring_seconds(a, b, g, q) == pytest.approx(want, rel=1e-12, abs=0)


@pytest.mark.parametrize("machine", preset_names())
def test_ring_seconds_equal_the_replay_on_machine_tables(machine):
    """Through each preset's GEMM table, contention and network: sublayer shapes of 1e6 to 1e13
    FLOPs and 1 KB to 10 GB, every ring of the node and beyond."""
    m = get_machine(machine)

    def gemm_s(f: float) -> float:
        return f / (m.peak_flops * m.gemm_efficiency(f))

    slow = m.overlap_slowdown
    for g in (2, 4, 8, 16, 64):
        for stride in (1, 8):
            link = m.network.link(stride, g)
            for flops in (1e6, 3e8, 1e10, 2e11, 1e13):
                for payload in (1e3, 1e6, 3e7, 1e10):
                    for q in CHUNK_CANDIDATES:
                        n = g * q
                        a = gemm_s(flops / n) * (1.0 + slow)
                        b = link.base_latency + payload / n / link.bandwidth
                        got = ring_reduce_scatter_seconds(gemm_s, flops, payload, link, q, slow)
                        want = replay_reduce_scatter(a, b, g, q)
                        assert got == pytest.approx(want, rel=1e-12, abs=0)


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
