"""--tensorboard: the rows of metrics.jsonl as TensorBoard scalars, and a resume's purge."""

from __future__ import annotations

import json

import pytest

from tetrad.train.metrics import MetricsLog, scalars


def _row(step: int, loss: float) -> dict:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 1000.0,
        "tokens_per_s_per_rank": 250.0,
        "mfu": 0.3,
        "peak_memory_bytes": 2**20,
        "step_time_s": 0.25,
        "comm_bytes": {"x": 4096, "z": 100},
        "comm_time_s": {"x": 0.01, "z": 0.02},
        "comm_exposed_s": {"x": 0.005, "z": 0.0},
        "overlaps_ran": {},
    } | ({"val_loss": loss + 0.1} if step % 2 == 0 else {})


def _read(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), {"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_rows_become_scalars_and_a_resume_purges_later_steps(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=True, start=0)
    log.write([_row(s, 5.0 - s) for s in (1, 2, 3, 4)])
    log.close()  # a run stopped after step 4, its last checkpoint at step 2
    log = MetricsLog(tmp_path, tensorboard=True, start=2)
    log.write([_row(s, 10.0 + s) for s in (3, 4)])
    log.close()
    got = _read(tmp_path / "tensorboard")
    assert set(got) == set(scalars(_row(2, 0.0)))
    assert {"comm_exposed_s/x", "comm_bytes/z", "val/loss", "memory/peak_bytes"} <= set(got)
    assert got["train/loss"] == [(1, 4.0), (2, 3.0), (3, 13.0), (4, 14.0)]
    assert got["val/loss"] == [(2, pytest.approx(3.1)), (4, pytest.approx(14.1))]
    assert got["comm_bytes/x"] == [(s, 4096.0) for s in (1, 2, 3, 4)]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 3, 4]  # trimmed elsewhere


def test_moe_rows_give_routing_scalars_per_block():
    row = _row(1, 4.0) | {
        "aux_loss": 0.02,
        "moe_max_load": {"1": 1.25, "3": 1.5},
        "moe_balance": {"1": 1.01, "3": 1.02},
    }
    got = scalars(row)
    assert got["train/aux_loss"] == 0.02
    assert got["moe/max_load/block_3"] == 1.5 and got["moe/balance/block_1"] == 1.01
    assert sum(tag.startswith("moe/") for tag in got) == 4


def test_no_tensorboard_writes_only_metrics_jsonl(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False, start=0)
    log.write([_row(1, 1.0)])
    log.close()
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_missing_tensorboard_is_one_line(monkeypatch):
    import sys

    from tetrad.train.config import ConfigError
    from tetrad.train.preflight import check_tensorboard

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ConfigError, match="needs the tensorboard package: pip install"):
        check_tensorboard()
