"""``tetrad calibrate``: a quick calibration on gloo ranks writes a machine TOML the planner
loads and plans with; the fitting helpers recover known alpha-beta parameters."""

import math

import pytest

from tests.distributed import run_distributed
from tetrad import cli
from tetrad.calibrate import calibrate
from tetrad.calibrate.fit import fit_alpha_beta, fit_latency
from tetrad.calibrate.machine_file import to_toml
from tetrad.calibrate.settings import group_ranks, layouts
from tetrad.plan.machine.description import get_machine
from tetrad.plan.machine.network import ALL_GATHER, ALL_REDUCE, ring_bytes, ring_hops
from tetrad.plan.search.plan import plan
from tetrad.spec.presets import get_model
from tetrad.spec.toml import tomllib

TINY = "dim=64,n_layers=2,n_heads=4,n_kv_heads=2,ffn_dim=128,vocab_size=256"


def _calibrate_on_ranks(out: str) -> None:
    got = calibrate("cpu", out, quick=True)
    # every rank returns the dict rank 0 wrote
    assert got["calibration"]["world"] == 4
    assert got["network"]["intra_table"]


@pytest.fixture(scope="module")
def machine_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibrate") / "here.toml"
    run_distributed(_calibrate_on_ranks, 4, str(path))
    return path


def test_quick_calibration_loads_and_is_sane(machine_file):
    m = get_machine(str(machine_file))
    raw = tomllib.loads(machine_file.read_text())
    assert m.name == "here" and m.gpus_per_node == 4
    # a CPU core does between 0.1 and 1000 GFLOP/s fp32; 4 ranks share <= 4 cores
    assert 1e8 < m.peak_flops < 1e12
    assert 1e8 < m.hbm_bytes_per_s < 1e12
    assert m.memory_bytes > 0
    net = m.network
    # loopback TCP between processes: between 1 MB/s and 100 GB/s
    assert 1e-3 < net.intra_node_gbps < 100
    assert 0 < net.inter_node_gbps_per_member <= net.intra_node_gbps
    assert {(s, g) for s, g, _ in net.intra_table} == {(1, 2), (2, 2), (1, 4)}
    assert net.inter_node_gbps_per_member == min(g for _, _, g in net.intra_table)
    assert 0 <= net.latency_base_us < 1e5 and 0 <= net.latency_hop_intra_us < 1e5
    assert net.latency_base_us + net.latency_hop_intra_us > 0
    assert all(0 < e <= 1 for _, e in m.gemm_table) and max(e for _, e in m.gemm_table) > 0.3
    assert [f for f, _ in m.gemm_table] == sorted(f for f, _ in m.gemm_table)
    assert 0 < m.attention_efficiency <= 1
    # every number says where it came from
    for key in (
        "peak_tflops",
        "gemm_efficiency",
        "intra_node_gbps",
        "intra_table",
        "inter_node_gbps_per_member",
        "latency",
        "hbm_gbps",
        "memory_gib",
        "attention_efficiency",
    ):
        assert (
            "measured by tetrad calibrate on" in m.sources[key] or "datasheet" in m.sources[key]
        ), key
    assert "4 ranks" in m.sources["intra_node_gbps"]
    assert "single node" in m.sources["inter_node_gbps_per_member"]
    cal_tab = raw["calibration"]
    assert len(cal_tab["collectives"]) == 3 * 2 * 3  # layouts x kinds x payloads
    assert all(c["seconds"] > 0 for c in cal_tab["collectives"])
    # the time of a 1 MiB all-reduce predicted by the file is close to the measured one
    link = net.link(1, 4)
    meas = next(
        c
        for c in cal_tab["collectives"]
        if c["kind"] == ALL_REDUCE
        and c["stride"] == 1
        and c["members"] == 4
        and c["payload_bytes"] == 1 << 20
    )
    pred = link.time(ALL_REDUCE, meas["payload_bytes"])
    assert 0.2 < pred / meas["seconds"] < 5


def test_planner_runs_with_calibrated_machine(machine_file):
    m = get_machine(str(machine_file))
    res = plan(
        get_model(TINY), m, gpus=4, global_batch=8, seq_len=64, top=3, dtype="fp32", classic=False
    )
    assert res.rows and all(r.step_s > 0 and math.isfinite(r.step_s) for r in res.rows)


def test_fit_alpha_beta_recovers_parameters():
    alpha = {ALL_REDUCE: 50e-6, ALL_GATHER: 30e-6}
    bw = 2e9
    pts = []
    for kind in (ALL_REDUCE, ALL_GATHER):
        for payload in (64, 4096, 1 << 16, 1 << 20, 1 << 24):
            rb = ring_bytes(kind, payload, 4)
            pts.append({"kind": kind, "ring_bytes": rb, "seconds": alpha[kind] + rb / bw})
    got_alpha, got_bw = fit_alpha_beta(pts)
    assert got_bw == pytest.approx(bw, rel=1e-6)
    for k, v in alpha.items():
        assert got_alpha[k] == pytest.approx(v, rel=1e-6)
    # times that do not grow with bytes: alpha only, bandwidth the best bytes/seconds seen
    flat = [
        {"kind": ALL_REDUCE, "ring_bytes": b, "seconds": 1e-3 * (1.1 if b < 100 else 1.0)}
        for b in (10, 1000)
    ]
    a, b = fit_alpha_beta(flat)
    assert a[ALL_REDUCE] >= 0 and b == pytest.approx(1000 / 1e-3)
    # times that grow with bytes by less than the noise (latency-bound sizes): a slope that
    # explains under 10% of the largest time is not trusted; the best bytes/seconds is used
    noisy = [
        {"kind": ALL_REDUCE, "ring_bytes": b, "seconds": 1e-3 + b * 1e-14}
        for b in (10, 1000, 100_000)
    ]
    _, b = fit_alpha_beta(noisy)
    assert b == pytest.approx(100_000 / (1e-3 + 100_000 * 1e-14))


def test_fit_latency_and_layouts():
    base, hop = fit_latency([(1, 12e-6), (2, 14e-6), (3, 16e-6)])
    assert base == pytest.approx(10e-6) and hop == pytest.approx(2e-6)
    # a decreasing trend is clamped: no negative hop
    base, hop = fit_latency([(1, 20e-6), (2, 10e-6)])
    assert hop == 0.0 and base == pytest.approx(15e-6)
    assert layouts(4) == [(1, 2), (2, 2), (1, 4)]
    assert layouts(8) == [(1, 2), (2, 2), (4, 2), (1, 4), (2, 4), (1, 8)]
    assert group_ranks(2, 2, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ring_hops(ALL_REDUCE, 8) == 6 and ring_hops(ALL_GATHER, 8) == 7


def test_command_line_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    missing = str(tmp_path / "missing" / "m.toml")
    args = cli.build_parser().parse_args(["calibrate", "--out", missing])
    assert args.nproc is None and args.device == "cpu" and not args.quick
    assert cli.main(["calibrate", "--out", missing]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["calibrate", "--nproc", "1", "--out", str(tmp_path / "m.toml")]) == 2
    assert "at least 2 ranks" in capsys.readouterr().err


def test_toml_writer_round_trips():
    d = {
        "name": "x",
        "n": 3,
        "f": 1e-05,
        "ok": True,
        "pairs": [[1e8, 0.5], [1e9, 0.75]],
        "t": {"s": 'a "quoted" \\ path', "rows": [{"a": 1, "b": 2.5}]},
    }
    assert tomllib.loads(to_toml(d, header="hello\nworld")) == d
