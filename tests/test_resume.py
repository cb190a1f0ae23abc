"""Checkpoints that survive anything: resharding across grids, SIGKILL during a save, elastic
restarts. Every resumed run is compared with an uninterrupted one.

Runs use the ``tiny`` model with the learning rate still in warm-up at the last step, so a run
stopped after ``k`` steps (``steps=k``) follows the same schedule as the full run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.distributed import run_distributed
from tests.test_train import config as train_config
from tetrad.train import trainer
from tetrad.train.launch import run_local, train_worker


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def config(corpus, run_dir, steps, grid, **extra):
    """``tests.test_train``'s configuration on ``grid``, validating only at the end, logging
    (so polling for asynchronous saves) every step, in warm-up throughout."""
    extra = {"val_every": 1000, "val_batches": 4, "log_every": 1, "warmup_steps": 100} | extra
    return train_config(corpus, run_dir, steps, grid=grid, **extra)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in rows(run_dir)]


def full_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, unsharded, read in this process."""
    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and not k.startswith("rng.")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


def _train(cfg):
    trainer.train(cfg)


def _run(cfg, world):
    trainer.preflight(cfg)
    run_distributed(_train, world, cfg)


# ---------------------------------------------------------------- resharding


GRIDS = [  # DATA,Z,Y,X or DATA,CONTEXT,Z,Y,X: G_context changes 1 -> 2 -> 1 -> 4 -> 1
    "1,1,2,2",
    "2,2,1,1",
    "1,2,1,1,2",
    "1,2,1,2",
    "1,4,1,1,1",
    "2,1,2,1",
    "1,1,1,1",
    "2,2,1,2",
]


@pytest.fixture(scope="module")
def whole(corpus, tmp_path_factory):
    """The uninterrupted run both chains below compare with: ``2 * len(GRIDS)`` steps on one
    rank, unsharded, a checkpoint every 2 steps (all kept). In warm-up throughout, so its first
    ``k`` steps and its step-``k`` checkpoint are those of a run of ``k`` steps."""
    run_dir = tmp_path_factory.mktemp("resume") / "whole"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TETRAD_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        cfg = config(corpus, run_dir, 2 * len(GRIDS), "1,1,1,1")
        assert cfg.checkpoint.checkpoint_every == 2 and cfg.checkpoint.keep_last == 0
        _run(cfg, 1)
    return run_dir


def test_resharding_chain_matches_uninterrupted(corpus, whole, tmp_path):
    """Two steps on each grid in turn, each resuming the previous grid's checkpoint (model and
    AdamW states resharded by DCP, also across a change of G_context; the data position is the
    step), against one run."""
    chain = tmp_path / "chain"
    n = 2 * len(GRIDS)
    for i, grid in enumerate(GRIDS):
        world = eval(grid.replace(",", "*"))
        _run(config(corpus, chain, 2 * i + 2, grid, resume=i > 0), world)
    assert [r["step"] for r in rows(chain)] == list(range(1, n + 1))
    assert losses(chain) == pytest.approx(losses(whole), abs=1e-5)
    name = f"checkpoints/step_{n:07d}"
    got, want = full_state(chain / name), full_state(whole / name)
    assert got.keys() == want.keys() and any(k.endswith("exp_avg_sq") for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)
    meta = json.loads((chain / name / "tetrad.json").read_text())
    assert meta["grid"] == [2, 1, 2, 1, 2] and meta["step"] == n


SHARDED = [  # (grid, shard_optimizer): sharded <-> unsharded, data 2 -> 4 -> 2 x context 2
    ("2,1,1,1", True),
    ("1,1,1,2", False),
    ("4,1,1,1", True),
    ("2,1,1,1", False),
    ("2,2,1,1,1", True),
    ("1,1,1,1", True),
]


def test_resharding_with_the_sharded_optimizer_matches_uninterrupted(corpus, whole, tmp_path):
    """Two steps on each grid in turn, the AdamW states sharded over data x context or not
    (``shard_optimizer``), each resuming the previous checkpoint, against one unsharded run
    (the first ``n`` steps of the resharding chain's): the same losses, and the same
    checkpoint at step ``n`` (states stored whole, whatever the sharding)."""
    chain = tmp_path / "chain"
    n = 2 * len(SHARDED)
    assert n <= 2 * len(GRIDS)
    for i, (grid, shard) in enumerate(SHARDED):
        world = eval(grid.replace(",", "*"))
        cfg = config(corpus, chain, 2 * i + 2, grid, resume=i > 0, shard_optimizer=shard)
        _run(cfg, world)
    assert losses(chain) == pytest.approx(losses(whole)[:n], abs=1e-5)
    name = f"checkpoints/step_{n:07d}"
    got, want = full_state(chain / name), full_state(whole / name)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


# ---------------------------------------------------------------- SIGKILL during a save


GRID2 = "1,1,1,2"


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The uninterrupted 6-step run on the 2-rank grid: its run directory."""
    run_dir = tmp_path_factory.mktemp("reference")
    _run(config(corpus, run_dir, 6, GRID2), 2)
    return run_dir


def _kill_all(pid_dir: Path) -> None:
    """SIGKILL every rank of the job (their pids are in ``pid_dir``), this one last."""
    me = os.getpid()
    for f in pid_dir.iterdir():
        if int(f.read_text()) != me:
            os.kill(int(f.read_text()), signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def _train_until_killed(cfg, point: str, pid_dir: Path) -> None:
    """Train, and SIGKILL all ranks at ``point`` of the save of step 4."""
    import torch.distributed as dist

    import tetrad.train.checkpoint as ck

    rank = dist.get_rank()
    (pid_dir / str(rank)).write_text(str(os.getpid()))
    target = "step_0000004"
    real_async, real_save = dcp.async_save, dcp.save
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def writer(real):
        def save(state, *, checkpoint_id, **kw):
            if target not in str(checkpoint_id) or point not in ("before_write", "mid_write"):
                return real(state, checkpoint_id=checkpoint_id, **kw)
            crash(state, checkpoint_id, kw["process_group"])

        return save

    def crash(state, checkpoint_id, group):
        if point == "before_write" and rank == 0:
            _kill_all(pid_dir)
        real_save(state, checkpoint_id=checkpoint_id, process_group=group)
        shard = Path(checkpoint_id) / f"__{rank}_0.distcp"
        with shard.open("r+b") as f:  # a write cut short
            f.truncate(shard.stat().st_size // 2)
        dist.barrier()
        if rank == 0:
            _kill_all(pid_dir)
        time.sleep(60)

    calls = []

    def replace(src, dst):
        if str(src).endswith(f"{target}.tmp/tetrad.json.tmp") or calls:
            calls.append(src)
            kill_at = {"before_meta": 1, "before_rename": 2, "before_pointer": 3}.get(point)
            if len(calls) == kill_at:
                _kill_all(pid_dir)
        return real_replace(src, dst)

    def rmtree(path, *a, **kw):
        pointer = Path(path).parent / "latest"
        if point == "before_prune" and pointer.is_file() and pointer.read_text() == target + "\n":
            _kill_all(pid_dir)
        return real_rmtree(path, *a, **kw)

    ck.dcp.async_save, ck.dcp.save = writer(real_async), writer(real_save)
    os.replace, shutil.rmtree = replace, rmtree
    trainer.train(cfg)


POINTS = ["before_write", "mid_write", "before_meta", "before_rename", "before_pointer"]


@pytest.mark.parametrize(
    "point,mode",
    [(p, "on") for p in [*POINTS, "before_prune"]]
    + [("mid_write", "off"), ("before_pointer", "off")],
)
def test_sigkill_during_save_leaves_a_loadable_checkpoint(corpus, tmp_path, reference, point, mode):
    """All ranks SIGKILLed at ``point`` of the save of step 4 (asynchronous save: ``mode``)."""
    run_dir, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    cfg = config(corpus, run_dir, 6, GRID2, keep_last=1, async_save=mode)
    trainer.preflight(cfg)
    with pytest.raises(Exception, match="SIGKILL|signal 9"):
        run_distributed(_train_until_killed, 2, cfg, point, pids)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == ("step_0000004" if point == "before_prune" else "step_0000002")
    _run(config(corpus, run_dir, 6, GRID2, keep_last=1, resume=True), 2)
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert losses(run_dir) == losses(reference)
    got = full_state(run_dir / "checkpoints/step_0000006")
    want = full_state(reference / "checkpoints/step_0000006")
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step_0000006",
    ]


# ---------------------------------------------------------------- elastic restart


def _train_killing_rank1_in_step_5(cfg) -> None:
    """The worker entrypoint, with rank 1 SIGKILLed during step 5 of the first attempt."""
    if os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        real = trainer._step

        def step(job, s, batch):
            if s == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(job, s, batch)

        trainer._step = step
    train_worker(cfg)


def test_worker_killed_under_max_restarts_completes_the_run(corpus, tmp_path, reference, capfd):
    run_dir = tmp_path / "run"
    cfg = config(corpus, run_dir, 6, GRID2, max_restarts=1, async_save="off")
    trainer.preflight(cfg)
    run_local(cfg, 2, entrypoint=_train_killing_rank1_in_step_5)
    out = capfd.readouterr().out
    assert "tetrad: restart 1 of 1: resuming from" in out
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # the lost step 5 is not repeated
    assert [r["restarts"] for r in got] == [0, 0, 0, 0, 1, 1]
    assert losses(run_dir) == losses(reference)
