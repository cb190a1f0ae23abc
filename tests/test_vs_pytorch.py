"""benchmarks/vs_pytorch.py on a tiny model at 2 ranks: every run finishes, every first-step loss
matches tetrad's, the data-parallel payloads are one all-reduce of the gradients, and both
pipelines send the activations once (counted at the sender)."""

import json
import subprocess
import sys
from pathlib import Path

from tetrad.spec.presets import PRESETS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_pytorch.py"


def test_vs_pytorch_tiny(tmp_path):
    out = tmp_path / "vs.json"
    args = "--model tiny --seq 16 --batch 8 --steps 3 --warmup 1 --repeats 1 --worlds 2"
    args += " --modes ddp,fsdp2,tp,pp"
    args += " --start-method forkserver"  # the same fresh processes per run, started faster
    r = subprocess.run(
        [sys.executable, str(SCRIPT), *args.split(), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "world size 2" in r.stdout and "MISMATCH" not in r.stdout
    runs = {run["config"]: run for run in json.loads(out.read_text())["runs"]}
    assert len(runs) == 11  # 4 tetrad grids, DDP, FSDP2, TP(2); pipe=2 and PP(2), 1F1B and GPipe
    grad_bytes = 4 * PRESETS["tiny"].num_params()
    # Gradients all-reduced once, plus the loss (4 bytes) and, in tetrad, the squared norm.
    assert 0 <= runs["tetrad 2,1,1,1"]["bytes"]["data"] - grad_bytes <= 16
    assert runs["stock DDP"]["bytes"]["all_reduce"] - grad_bytes == 4
    assert runs["stock FSDP2"]["bytes"]["reduce_scatter"] == grad_bytes
    # Rank 0, the first stage, sends the activations [8, 16, 64] fp32; tetrad's pipe axis also
    # all-reduces the loss (4 bytes); the receives count nowhere.
    activations = 8 * 16 * PRESETS["tiny"].dim * 4
    for schedule in ("1F1B", "GPipe"):
        assert runs[f"tetrad pipe=2 {schedule}"]["bytes"]["pipe"] == activations + 4
        stock = runs[f"stock PP(2) {schedule}"]
        assert stock["bytes"]["send"] == activations and "recv" not in stock["bytes"]
        assert stock["calls"]["send"] == stock["calls"]["recv"] == 8  # micro-batches
