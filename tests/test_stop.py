"""Preemption and leftovers: a signal stops a run at a step boundary with a checkpoint, one run
per run directory, and the inputs a killed or finished run leaves behind.

The signalled runs are real launches (``python -m tetrad.cli train`` in a subprocess of its own
session, 2 CPU ranks splitting the weights over Z, the ``tiny`` model) signalled once their
first logging interval is written, so the signal lands mid-interval. Learning rates stay in
warm-up, so a run of ``--steps 1000`` follows the schedule of a shorter one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tetrad.cli import main
from tetrad.train.stop import REPEAT_S, StopSignals

REPO = Path(__file__).resolve().parents[1]
GRID = "1,1,2,1"  # two ranks, Z over both: the weights and the checkpoint sharded


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def args(corpus, run_dir, steps, *extra) -> list[str]:
    return [
        "train",
        *("--model", "tiny", "--grid", GRID, "--steps", str(steps)),
        *("--global-batch", "8", "--micro-batch", "2", "--seq-len", "32"),
        *("--data", str(corpus), "--vocab-size", "300", "--run-dir", str(run_dir)),
        *("--warmup-steps", "100", "--log-every", "3", "--val-every", "1000"),
        *("--val-batches", "1", "--peak-flops", "1e9"),
        *extra,
    ]


def launch(cache, argv) -> subprocess.Popen:
    env = os.environ | {"TETRAD_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "tetrad.cli", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: SIGINT reaches it as Ctrl-C would
    )


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def signal_mid_interval(proc: subprocess.Popen, run_dir: Path, sig: int) -> tuple[int, str]:
    """Send ``sig`` once the first logging interval is written; ``(exit code, output)``."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "no logging interval within 240 s"
        time.sleep(0.2)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C
    else:
        os.kill(proc.pid, sig)  # the launcher alone, as SLURM or kill would
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


def stopped_step(out: str, sig: int) -> int:
    name = signal.Signals(sig).name
    lines = [ln for ln in out.splitlines() if ln.startswith(f"tetrad: stopped by {name}")]
    assert len(lines) == 1, out
    step = int(lines[0].split(" at step ")[1].split(";")[0])
    assert lines[0] == (
        f"tetrad: stopped by {name} at step {step}; checkpoint step_{step:07d} saved; "
        "continue with --resume"
    )
    return step


def run_to_end(cache, argv, monkeypatch) -> None:
    """A run to its end, launched from this process (its ranks are spawned all the same: the
    launcher's own start, importing torch again, is the only thing left out)."""
    monkeypatch.setenv("TETRAD_CACHE", str(cache))
    assert main(argv) == 0


def test_sigterm_saves_stops_and_resumes_exactly(corpus, cache, tmp_path, monkeypatch):
    """SIGTERM to the launcher: the step finishes, its checkpoint is saved, the line, exit 143;
    meanwhile a second run on the directory is refused; a resume at the checkpoint's step is
    refused; the resumed run's losses equal the uninterrupted run's bit for bit."""
    run_dir = tmp_path / "run"
    proc = launch(cache, args(corpus, run_dir, 1000))
    while not (run_dir / "metrics.jsonl").is_file():
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.2)
    assert main(args(corpus, run_dir, 1000)) == 2  # the lock: one line, nothing touched
    before = (run_dir / "metrics.jsonl").read_text()
    code, out = signal_mid_interval(proc, run_dir, signal.SIGTERM)
    assert code == 143, out
    assert "Traceback" not in out and "leaked" not in out, out
    step = stopped_step(out, signal.SIGTERM)
    assert [r["step"] for r in rows(run_dir)] == list(range(1, step + 1))  # its last interval
    assert (run_dir / "metrics.jsonl").read_text().startswith(before)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:07d}"
    assert main(args(corpus, run_dir, step, "--resume")) == 2  # nothing left to train
    run_to_end(cache, args(corpus, run_dir, step + 2, "--resume"), monkeypatch)
    run_to_end(cache, args(corpus, tmp_path / "whole", step + 2), monkeypatch)
    assert [r["loss"] for r in rows(run_dir)] == [r["loss"] for r in rows(tmp_path / "whole")]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT])
def test_sigusr1_and_ctrl_c_stop_at_a_step_with_a_checkpoint(corpus, cache, tmp_path, sig):
    """SIGUSR1 (SLURM's early warning) to the launcher, or one Ctrl-C to the process group
    (the launcher forwards it again: the same key press): the same stop; exit 143 or 130."""
    run_dir = tmp_path / "run"
    code, out = signal_mid_interval(launch(cache, args(corpus, run_dir, 1000)), run_dir, sig)
    assert code == (130 if sig == signal.SIGINT else 143), out
    assert "Traceback" not in out and "leaked" not in out, out
    step = stopped_step(out, sig)
    assert [r["step"] for r in rows(run_dir)] == list(range(1, step + 1))
    assert (run_dir / "checkpoints" / f"step_{step:07d}" / "tetrad.json").is_file()


def test_a_repeated_ctrl_c_is_the_same_key_press_within_the_window():
    """The handler alone (no process group needed for noting signals): the first signal is
    kept, a SIGINT within :data:`REPEAT_S` does nothing more."""
    before = signal.getsignal(signal.SIGINT)
    stop = StopSignals(True)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # forwarded again by the launcher
        time.sleep(0.05)
        assert stop.signum == signal.SIGINT
        assert time.monotonic() - stop.first_at < REPEAT_S
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are given back


def test_no_save_on_signal_installs_nothing():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignals(False)
    assert signal.getsignal(signal.SIGTERM) is before and stop.agreed() == 0


# ---------------------------------------------------------------- leftovers of other runs


def test_a_corrupt_safetensors_file_is_one_line(corpus, cache, tmp_path, monkeypatch, capsys):
    """``--init-from hf:DIR`` whose ``model.safetensors`` is random bytes (a broken download)."""
    from tests.run_dirs import bpe_tokenizer
    from tetrad.models.hf import hf_config
    from tetrad.spec.presets import PRESETS

    folder = tmp_path / "hf"
    folder.mkdir()
    cfg = hf_config(PRESETS["tiny"], 300, None, "float32")
    (folder / "config.json").write_text(json.dumps(cfg))
    bpe_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    monkeypatch.setenv("TETRAD_CACHE", str(cache))
    argv = args(corpus, tmp_path / "run", 2, "--init-from", f"hf:{folder}")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert str(folder / "model.safetensors") in err[0] and "not a readable safetensors" in err[0]


def test_report_skips_and_counts_a_torn_last_line(tmp_path, capsys):
    """A run killed while writing ``metrics.jsonl`` leaves its last line cut short."""
    row = {
        "step": 1,
        "step_time_s": 0.5,
        "tokens_per_s": 100.0,
        "mfu": 0.1,
        "comm_bytes": {"data": 10.0},
        "comm_time_s": {"data": 0.1},
        "comm_exposed_s": {"data": 0.05},
    }
    lines = [json.dumps(row | {"step": s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "loss": 1.0')
    assert main(["report", str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "steps 2-3 (mean of 2)" in out and "skipped 1 line(s)" in out, out
