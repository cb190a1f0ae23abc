"""``tetrad report`` on synthetic ``metrics.jsonl`` files (no training): every axis the rows
record is shown (pipe and expert too), the exposed total equals the rows' sum, and a run
resumed on another grid is reported one grid per segment."""

from __future__ import annotations

import json
import re

import pytest

from tetrad.train.report import report, segments, summarize


def _row(step: int, grid: str | None, exposed: dict, time_s: dict | None = None) -> dict:
    time_s = time_s or {a: 2 * v for a, v in exposed.items()}
    row = {
        "step": step,
        "loss": 5.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 1000.0,
        "tokens_per_s_per_rank": 500.0,
        "mfu": 0.1,
        "peak_memory_bytes": 1,
        "step_time_s": 0.065,
        "comm_bytes": {a: 1e6 for a in exposed},
        "comm_time_s": time_s,
        "comm_exposed_s": exposed,
        "overlaps_ran": {},
        "restarts": 0,
    }
    return row if grid is None else row | {"grid": grid}


def _write(run, rows) -> None:
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _exposed_sum(rows) -> float:
    """The mean over the reported steps (the first is warm-up) of each row's exposed sum."""
    use = rows[1:]
    return sum(sum(r["comm_exposed_s"].values()) for r in use) / len(use)


@pytest.mark.parametrize(
    "grid,exposed",
    [
        ("data=2 z=1 y=1 x=1 expert=2", {"data": 0.004, "expert": 0.018, "expert_data": 0.0027}),
        ("pipe=2 data=1 z=1 y=1 x=2", {"x": 0.003, "pipe": 0.011}),
    ],
    ids=["expert", "pipe"],
)
def test_every_axis_and_the_exposed_total(tmp_path, grid, exposed):
    rows = [_row(s, grid, {a: v * (1 + s / 10) for a, v in exposed.items()}) for s in range(1, 6)]
    _write(tmp_path, rows)
    s = summarize(rows)
    assert set(s["axes"]) == set(exposed)
    assert s["exposed_s"] == pytest.approx(_exposed_sum(rows))
    text = report(tmp_path, plot=False)
    for axis in exposed:
        assert any(line.split()[:1] == [axis] for line in text.splitlines()), (axis, text)
    shown = re.search(r"exposed communication +([\d.]+) ms", text)
    assert float(shown.group(1)) == pytest.approx(_exposed_sum(rows) * 1e3, abs=0.05), text


def test_a_resume_on_another_grid_is_one_summary_per_grid(tmp_path):
    first = [_row(s, "data=4 z=1 y=1 x=1", {"data": 0.01}) for s in range(1, 5)]
    second = [_row(s, "data=2 z=1 y=1 x=2", {"data": 0.005, "x": 0.02}) for s in range(5, 9)]
    rows = first + second
    _write(tmp_path, rows)
    assert [len(g) for g in segments(rows)] == [4, 4]
    text = report(tmp_path, plot=True)
    assert "changed grid 1 time(s)" in text
    assert "grid data=4 z=1 y=1 x=1, steps 2-4" in text
    assert "grid data=2 z=1 y=1 x=2, steps 6-8" in text
    parts = [summarize(g) for g in segments(rows)]
    assert parts[0]["exposed_s"] == pytest.approx(_exposed_sum(first))
    assert parts[1]["exposed_s"] == pytest.approx(_exposed_sum(second))
    assert (tmp_path / "report.png").stat().st_size > 0


def test_rows_without_a_grid_are_one_segment(tmp_path):
    rows = [_row(s, None, {"z": 0.001, "x": 0.002}) for s in range(1, 4)]
    _write(tmp_path, rows)
    text = report(tmp_path, plot=False)
    assert "changed grid" not in text and text.startswith("steps 2-3")
