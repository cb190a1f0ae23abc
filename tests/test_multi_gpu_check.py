"""``benchmarks/multi_gpu_check.sh`` in its CPU smoke mode (gloo, 2 ranks, one of its cases):
the report says pass, with the planner's bytes equal; a planted loss difference and a planted
byte fail it; every case of the 4- and 8-GPU tables passes ``tetrad train``'s preflight."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import multi_gpu_check as mgc
from tetrad.cli import build_parser
from tetrad.spec.grid import with_context
from tetrad.spec.pipeline_split import balanced_split, check_schedule
from tetrad.train.config import load_config, overrides
from tetrad.train.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_mode_passes_and_planted_differences_fail(tmp_path):
    out = tmp_path / "out"
    env = os.environ | {
        "DEVICE": "cpu",
        "ONLY": "fine",  # Y with the fused rings (each case costs ~20 s of CPU)
        "PY": sys.executable,
        "TETRAD_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }
    script = ROOT / "benchmarks" / "multi_gpu_check.sh"
    done = subprocess.run(
        ["bash", str(script), str(out)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    cases = json.loads((out / "multi_gpu_check.json").read_text())["cases"]
    assert [(c["name"], c["verdict"], c["bytes_check"]) for c in cases] == [
        ("fine", "pass", "equal")
    ]
    assert cases[0]["bytes"].keys() == {"y", "world"}  # world: the gradient norm's sum
    assert "| fine | y=2 | 2 |" in (out / "multi_gpu_check.md").read_text()

    # Planted: the last step's loss off by 1e-4 relative, then its Y bytes made 1.
    case = next(c for c in mgc.CASES[2] if c.name == "fine")
    reference = mgc.read_metrics(out / "runs" / "reference-tiny")
    planted = tmp_path / "planted"
    shutil.copytree(out / "runs" / "fine", planted, ignore=shutil.ignore_patterns("checkpoints"))
    rows = mgc.read_metrics(planted)
    for change in ("loss", "bytes"):
        changed = [dict(r) for r in rows]
        if change == "loss":
            changed[-1]["loss"] *= 1 + 1e-4
        else:
            changed[-1]["comm_bytes"] = changed[-1]["comm_bytes"] | {"y": 1.0}
        text = "".join(json.dumps(r) + "\n" for r in changed)
        (planted / "metrics.jsonl").write_text(text)
        res = mgc.Result(case.name, case.grid, 2, "")
        mgc.judge(case, planted, reference, 1e-5, res)
        assert res.verdict == "fail", change
        assert res.problems[0].startswith(
            "losses differ" if change == "loss" else "step 2 axis y: 1 bytes, planner"
        ), res.problems


@pytest.mark.parametrize("nproc", [4, 8])
def test_every_case_of_the_larger_tables_passes_the_preflight(nproc, tmp_path, monkeypatch):
    """The grids of 4 and 8 GPUs cannot run here: their options, model sharding, batch split
    and expert axis pass the checks ``tetrad train`` makes before it starts workers, their
    pipelines those it makes when it builds the stages."""
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    corpus = mgc.write_corpus(tmp_path / "corpus")
    parser = build_parser()
    for case in mgc.CASES[nproc]:
        assert case.ranks == nproc, case
        cmd = mgc.train_command(case, nproc, "cpu", mgc.SIZES["cuda"], corpus, tmp_path / "r")
        args = parser.parse_args(cmd[cmd.index("train") :])
        cfg = load_config(args.config, overrides(args))
        _, model = preflight(cfg)
        par, t = cfg.parallelism, cfg.training
        if par.pipe > 1:  # what the runtime checks when it builds the stages
            data, _, z, _, _ = with_context(par.grid)
            m = t.global_batch // (data * z) // t.micro_batch
            check_schedule(par.pipeline_schedule, par.pipe, par.virtual_stages, m)
            balanced_split([1.0] * model.n_layers, 1.0, 1.0, par.pipe * par.virtual_stages)
