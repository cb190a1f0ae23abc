"""benchmarks/vs_transformers.py on CPU (tiny sizes): both variants run on both sides, the two
models have the same parameter count and every side trains at a positive rate; without
transformers the script says so in one line and exits with 2.

The script runs in a subprocess, as on a GPU machine, with its output in a temporary folder.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tetrad.spec.presets import PRESETS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_transformers.py"


def test_vs_transformers_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "vs_transformers.json").read_text())
    assert not result["problems"] and not result["skipped"]

    models = result["models"]
    assert models["tetrad_params"] == models["hf_params"] == PRESETS["tiny"].num_params()
    assert not models["config_mismatches"]
    assert models["hf_attn_implementation"] == "sdpa"
    # HF's SDPA call can take the flash kernels: no mask, causal, grouped-query heads
    assert models["hf_sdpa"]["mask"] is False and models["hf_sdpa"]["is_causal"]

    assert {r["variant"] for r in result["results"]} == {"eager", "compiled"}
    for rec in result["results"]:
        assert rec["time_ratio"] > 0
        for side in ("tetrad", "hf"):
            s = rec[side]
            assert "error" not in s, s
            assert s["tokens_per_s"] > 0 and s["median_step_s"] > 0
            assert s["mfu"] is None and s["peak_memory_bytes"] is None  # CPU: no datasheet peak
            for rd in s["rounds"]:
                assert rd["loss_first"] > rd["loss_last"] > 0  # it trains

    table = (tmp_path / "vs_transformers.md").read_text()
    assert table.startswith("# tetrad vs transformers") and table in r.stdout


HIDE_TRANSFORMERS = """
import runpy, sys

class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformers":
            raise ImportError(f"{name} is hidden in this test")

sys.meta_path.insert(0, Hidden())
sys.argv = [sys.argv[1], "--device", "cpu", "--out", sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_vs_transformers_without_transformers(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", HIDE_TRANSFORMERS, str(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines() == [
        "vs_transformers: transformers is not installed (pip install transformers): "
        "nothing to compare against"
    ]
    assert not (tmp_path / "vs_transformers.json").exists()
