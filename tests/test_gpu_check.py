"""benchmarks/gpu_check.py on CPU (tiny sizes): every part runs and the equivalence checks pass.

The script runs in a subprocess, as on a GPU machine, with its output and the tokenised corpus
in temporary folders.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = os.environ | {"TETRAD_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(
        # 10 steps (the CPU profile runs 20): two logging intervals of 5, so the medians still
        # leave out the first interval (torch.compile's compilation)
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), "--steps", "10"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    for section in ("environment", "equivalence", "training", "memory", "planner"):
        assert section in result, section
    assert result["ok"] and not result["problems"]

    eq = result["equivalence"]
    assert eq["passed"]
    assert {r["precision"] for r in eq["layers"]} == {"fp32", "bf16"}
    assert len(eq["layers"]) == 2 * 7 and all(r["passed"] for r in eq["layers"])
    runs = {(r["mode"], r["compiled"]) for r in eq["runs"]}
    assert runs == {("fp32", False), ("trainer", False), ("trainer", True)}
    assert all(r["passed"] and r["loss_rel"] <= 1e-5 for r in eq["runs"])
    assert eq["compile_stats"]["graphs"] > 0
    assert [r["policy"] for r in eq["resume"]] == ["fp32 weights", "bf16 weights"]
    assert all(r["passed"] for r in eq["resume"]), eq["resume"]

    train = result["training"]["runs"]
    for name in ("eager", "compile"):
        run = train[name]
        assert run["ok"], run
        assert run["steps_logged"] == 10 and run["steps_in_median"] == 5, run
        assert run["tokens_per_s"] > 0 and 0 < run["mfu"] <= 1 and run["peak_memory_bytes"] > 0
        assert Path(run["log"]).is_file()
        assert not (out / f"run_{name}" / "checkpoints").exists()
    assert "graph breaks" in train["compile"]["compile_line"]

    mem = result["memory"]
    assert mem["predicted_bytes"] > 0 and set(mem["runs"]) == {"eager", "compile"}
    compiled = mem["runs"]["compile"]["predicted_bytes"]
    # tetrad memory --compile (equal when the peak phase holds no block activations, as here)
    assert 0 < compiled <= mem["runs"]["eager"]["predicted_bytes"]

    planner = result["planner"]
    assert planner["calibrate"]["ok"], planner["calibrate"]
    sources = [p["source"] for p in planner["predictions"]]
    assert sources[0] == "calibrated" and len(sources) == 3
    for p in planner["predictions"]:
        assert p["step_s"] > 0 and set(p["measured"]) == {"eager", "compile"}

    table = (out / "gpu_check.md").read_text()
    assert table.startswith("# tetrad gpu_check") and "| check |" in table
    assert table in r.stdout
