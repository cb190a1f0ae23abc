"""Checkpoint cost on the demo job: synchronous vs asynchronous save, the training stall, load.

The demo's model (``small``, 4096-token vocabulary) and grid (2,2,1,1: 4 gloo ranks, CPU fp32, a
thread each) with its AdamW state, checkpointed by :class:`tetrad.train.checkpoint.Checkpointer`.
Per repeat, seconds on rank 0 (from a barrier to a barrier: until the slowest rank is done):

- sync save: ``save()`` + ``wait()`` with ``async_save=False`` (the loop's stall without it);
- async stall: ``save()`` with ``async_save=True`` (the copy of the shards to host memory), and
  async complete: until ``wait()`` has committed the checkpoint (the main thread idle);
- load: ``load()`` of that checkpoint into a second model, SHA-256 verification included (files
  just written: page cache warm); every load is checked bit for bit against the saved state;
- loop stall: in a loop of ``--steps`` training steps with a save after the middle one
  (``poll()`` after the others, ``wait()`` at the end, as the trainer does; no barriers, the
  steps' collectives keep the ranks in step), the seconds of the steps from the save's to the one
  after its commit, minus as many times the median of the other steps: what a save costs the
  loop, the background write competing for the cores. The same figure for a loop without a save
  (window: the middle step and the next) is the noise floor.

An untimed round first warms up and checks that an async save keeps the state of ``save()``
while the next step changes it. Prints the median, min and max over repeats, ratios of medians,
the bytes on disk and the parameter count. From the repository root (2.5 minutes on 2 cores)::

    python benchmarks/checkpoint.py [--repeats 5] [--steps 8] [--model small] [--grid 2,2,1,1]
        [--dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tetrad, tests

import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tetrad.device import threads_per_rank
from tetrad.grid import Grid
from tetrad.train.checkpoint import Checkpointer, latest_checkpoint
from tetrad.train.config import load_config
from tetrad.train.sections import DEMO_GRID
from tetrad.train.step import build_optimizer, train_step
from tetrad.train.trainer import build_model

VOCAB = 4096  # the demo's BPE vocabulary (tetrad train's default --vocab-size)


def _timed(*fns) -> list[float]:
    """Seconds from a barrier to the barrier after each of ``fns()``, called in turn."""
    dist.barrier()
    t0, ends = time.perf_counter(), []
    for fn in fns:
        fn()
        dist.barrier()
        ends.append(time.perf_counter() - t0)
    return ends


def _clear(run_dir: Path) -> None:
    """Remove a run's checkpoints (rank 0, untimed): the disk holds one at a time."""
    if dist.get_rank() == 0:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    dist.barrier()


def _state(model, opt) -> list[torch.Tensor]:
    """Copies of this rank's parameters and AdamW moments."""
    return [t.clone() for p in model.parameters() for t in (p, *opt.state[p].values())]


class Bench:
    """One rank's model, optimizer and Checkpointers (``sync``, ``async``: one folder each)."""

    def __init__(self, a: dict):
        self.a = a
        cfg = load_config(None, {"model": a["model"], "grid": a["grid"]})
        self.cfg, self.grid = cfg, Grid.build(cfg.parallelism.grid)
        torch.set_num_threads(threads_per_rank(self.grid.world_size))
        self.model_cfg = cfg.model_config(VOCAB)
        meta = {"grid": list(self.grid.sizes), "model_config": dataclasses.asdict(self.model_cfg)}
        self.dirs = {k: Path(a["dir"]) / k for k in ("sync", "async")}
        self.ckpt = {
            k: Checkpointer(d, self.grid, meta=meta, async_save=k == "async")
            for k, d in self.dirs.items()
        }
        self.gen = torch.Generator().manual_seed(cfg.training.seed)  # same batches on all ranks
        self.model, self.opt = self.fresh()
        self.model2, self.opt2 = self.fresh()  # loaded into

    def fresh(self):
        """A newly initialised model and its AdamW (no state yet)."""
        t = self.cfg.training
        model = build_model(self.cfg, self.model_cfg, self.grid)
        return model, build_optimizer(model, t.lr, t.weight_decay, (t.beta1, t.beta2))

    def step(self) -> None:
        """One training step on a random global batch."""
        t = self.cfg.training
        batch = torch.randint(VOCAB, (t.global_batch, t.seq_len + 1), generator=self.gen)
        train_step(self.model, self.opt, self.grid, batch, t.micro_batch, t.grad_clip)

    def save(self, kind: str) -> list[float]:
        """Seconds of ``save()``, and until ``wait()`` has committed the checkpoint."""
        _clear(self.dirs[kind])
        ck = self.ckpt[kind]
        return _timed(lambda: ck.save(self.model, self.opt, 1), ck.wait)

    def load(self, want: list[torch.Tensor]) -> float:
        """Seconds of ``load()`` of the async folder's checkpoint; checks it holds ``want``."""
        path = latest_checkpoint(self.dirs["async"])
        [secs] = _timed(lambda: self.ckpt["sync"].load(self.model2, self.opt2, path))
        assert all(map(torch.equal, _state(self.model2, self.opt2), want)), "loaded state differs"
        return secs

    def loop(self, kind: str | None) -> tuple[float, float]:
        """``--steps`` steps with a ``kind`` save (None: none) after the middle one: the seconds
        of the steps from the save's to the one after its commit (plus a final ``wait()``)
        minus as many median steps of the others, and that median (seconds per step)."""
        ck, steps = self.ckpt.get(kind), self.a["steps"]
        save, commit = steps // 2 - 1, steps // 2 - 1  # the save follows step ``save`` (0-based)
        if ck is not None:
            _clear(self.dirs[kind])
        dist.barrier()
        ends = [time.perf_counter()]
        for i in range(steps):
            self.step()
            if ck is not None and i == save:
                ck.save(self.model, self.opt, i + 1)
                if not ck.async_save:
                    ck.wait()
            elif ck is not None and ck.poll() is not None:
                commit = i
            ends.append(time.perf_counter())
        tail = time.perf_counter()
        if ck is not None and ck.wait() is not None:  # not committed within the loop
            commit = steps
        tail = time.perf_counter() - tail
        dist.barrier()
        secs = [ends[i + 1] - ends[i] for i in range(steps)]
        window = range(save, min(commit + 2, steps))
        median = statistics.median(t for i, t in enumerate(secs) if i not in window)
        return sum(secs[i] for i in window) + tail - len(window) * median, median

    def repeat(self) -> dict[str, float]:
        """One timed round (seconds)."""
        r = {"sync": self.save("sync")[1]}
        r["async_stall"], r["async_total"] = self.save("async")
        r["load"] = self.load(_state(self.model, self.opt))
        r["loop_none"], r["step"] = self.loop(None)
        r["loop_sync"], r["loop_async"] = self.loop("sync")[0], self.loop("async")[0]
        return r


def worker(a: dict, out: str) -> None:
    """One rank: every repeat; rank 0 writes the results to ``out`` (JSON)."""
    b = Bench(a)
    b.step()  # untimed: warm up, and check that an async save keeps the state of save()
    b.save("sync")  # although the next step changes it before the commit
    before = _state(b.model, b.opt)
    b.ckpt["async"].save(b.model, b.opt, 1)
    b.step()
    b.ckpt["async"].wait()
    b.load(before)
    rows: dict[str, list[float]] = {}
    for rep in range(a["repeats"]):
        for k, v in b.repeat().items():
            rows.setdefault(k, []).append(v)
        if dist.get_rank() == 0:
            done = " ".join(f"{k} {v[-1]:.3f}" for k, v in rows.items())
            print(f"[{rep + 1}/{a['repeats']}] {done}", file=sys.stderr)
    size = sum(f.stat().st_size for f in latest_checkpoint(b.dirs["async"]).iterdir())
    for ck in b.ckpt.values():
        ck.close()
    if dist.get_rank() == 0:
        res = {"rows": rows, "bytes": size, "params": b.model_cfg.num_params()}
        Path(out).write_text(json.dumps(res))


LABELS = {  # the rows of the table
    "sync": "sync save: save()+wait()",
    "async_stall": "async stall: save()",
    "async_total": "async complete: save()..wait()",
    "load": "load (SHA-256 verify + read)",
    "step": "training step (median, no save)",
    "loop_none": "loop stall, no save (noise)",
    "loop_sync": "loop stall, sync save",
    "loop_async": "loop stall, async save",
}


RATIOS = {
    "async stall / sync save": ("async_stall", "sync"),
    "async complete / sync save": ("async_total", "sync"),
    "loop stall: async / sync": ("loop_async", "loop_sync"),
}


def table(res: dict) -> str:
    """Per figure the median, min and max over repeats (seconds), the ratios of the medians,
    and the checkpoint's size on disk (bytes)."""
    med = {k: statistics.median(v) for k, v in res["rows"].items()}
    lines = [f"{'seconds (rank 0)':<34} {'median':>8} {'min':>8} {'max':>8}"]
    for k, label in LABELS.items():
        v = res["rows"][k]
        lines.append(f"{label:<34} {med[k]:>8.3f} {min(v):>8.3f} {max(v):>8.3f}")
    lines += [f"{name:<34} {med[a] / med[b]:>8.2f}" for name, (a, b) in RATIOS.items()]
    n, size = res["params"], res["bytes"]
    lines.append(
        f"checkpoint on disk: {size:,} bytes ({size / n:.2f} per parameter, "
        f"{size / 1e6 / med['sync']:.0f} MB/s sync save); {n:,} parameters"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="preset[,key=value...] (default small)")
    p.add_argument("--grid", default=",".join(map(str, DEMO_GRID)), help="G_DATA,G_Z,G_Y,G_X")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="training steps per timed loop")
    p.add_argument("--dir", help="where checkpoints go (default: a temporary folder, removed)")
    args = p.parse_args()
    if args.steps < 6 or args.repeats < 1:
        p.error("--steps must be at least 6 and --repeats at least 1")
    world = math.prod(int(g) for g in args.grid.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        a = vars(args) | {"dir": args.dir or tmp}
        run_distributed(worker, world, a, str(Path(tmp) / "result.json"))
        res = json.loads((Path(tmp) / "result.json").read_text())
    print(
        f"model {args.model} ({res['params']:,} parameters), grid {args.grid} ({world} gloo "
        f"ranks, CPU fp32), model + AdamW state; {args.repeats} interleaved repeats"
    )
    print(table(res))


if __name__ == "__main__":
    main()
