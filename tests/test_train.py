"""``tetrad train`` end to end on a small corpus: metrics, checkpoint, exact resume, generate."""

import json

import pytest
import torch

from benchmarks.multi_gpu_check import write_corpus
from tests.distributed import run_distributed
from tetrad.train import trainer
from tetrad.train.config import load_config


def _train(cfg):
    trainer.train(cfg)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), files=12)


def config(corpus, run_dir, steps, resume=False, **extra):
    return load_config(
        None,
        {
            "model": "tiny,vocab_size=0",
            "grid": "1,2,1,2",
            "steps": steps,
            "global_batch": 8,
            "micro_batch": 2,
            "seq_len": 32,
            "data": [str(corpus)],
            "vocab_size": 300,
            "run_dir": str(run_dir),
            "val_every": 2,
            "val_batches": 1,
            "checkpoint_every": 2,
            "warmup_steps": 2,
            "resume": resume,
            "peak_flops": 1e9,
        }
        | extra,
    )


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, [r["loss"] for r in rows]


def test_train_resume_and_generate(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    whole, split = tmp_path / "whole", tmp_path / "split"
    cfg = config(corpus, whole, 4, profile_steps="3:3")
    trainer.preflight(cfg)
    run_distributed(_train, 4, cfg)
    rows, expected = losses(whole)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("loss", "lr", "tokens_per_s", "mfu", "peak_memory_bytes"):
        assert all(key in r for r in rows), key
    assert "val_loss" in rows[1] and "val_loss" in rows[3] and "val_loss" not in rows[0]
    assert (whole / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    assert (whole / "trace_steps_3-3.json").stat().st_size > 0
    # the grid 1,2,1,2 communicates over Z and X; every step records both
    assert all({"z", "x"} <= set(r["comm_bytes"]) for r in rows)
    assert all(r["overlaps_ran"].get("prefetch_hits", 0) > 0 for r in rows[1:])

    from tetrad.train.report import report

    text = report(whole)
    assert "exposed communication" in text and (whole / "report.png").stat().st_size > 0

    # Interrupted after step 2 (inside warm-up, so the LR schedule does not depend on the
    # total), then resumed: the same losses (same data, same state).
    run_distributed(_train, 4, config(corpus, split, 2))
    run_distributed(_train, 4, config(corpus, split, 4, resume=True))
    _, got = losses(split)
    assert got == expected  # bit-exact: the same data, state and reductions
    from tests.test_resume import full_state

    final = "checkpoints/step_0000004"
    a, b = full_state(whole / final), full_state(split / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from tetrad.train.generate import generate

    text = generate(str(whole), "def ", 20, 0.8, 10, 0, "cpu")
    assert text.startswith("def ") and len(text) > 4


def test_mfu_never_exceeds_one():
    """A step faster than the peak raises the peak to the step's rate instead of MFU > 100%."""
    from tetrad.train.metrics import StepMeter
    from tetrad.train.peak import Peak

    meter = StepMeter(tokens=1000, flops=4e9, peak=Peak(1e9, "test"), world_size=2)
    kw = dict(loss=1.0, lr=1e-3, grad_norm=1.0, peak_memory=0, comm={}, overlaps_ran={})
    assert meter.row(1, 4.0, **kw)["mfu"] == pytest.approx(0.5)  # 0.5 GFLOP/s per rank
    assert meter.row(2, 1.0, **kw)["mfu"] == 1.0  # 2 GFLOP/s per rank beats the peak
    assert meter.peak.flops == 2e9 and "raised" in meter.peak.source
    assert meter.row(3, 4.0, **kw)["mfu"] == pytest.approx(0.25)
