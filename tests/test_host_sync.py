"""A training step never waits for the device: no ``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, tensor truth test or operator sized by tensor values (``bincount``, ``nonzero``...)
inside a step; the trainer reads losses only at logging steps. An MoE step reads only the one
count exchange per block and micro-batch that expert parallelism's uneven all-to-alls need.

On CPU every such read is still a call we can count: ``item()`` and truth tests reach the
dispatcher as ``aten._local_scalar_dense`` (counted by a dispatch mode), the others are patched.
The trainer's collectives are timed by a clock whose marks are read later, as NCCL's device
events are, and each read of a mark inside a step counts as one too. Not counted: AdamW's step
counters, which PyTorch keeps on the host by design except in the
fused (CUDA) and capturable paths, so reading them never waits for a device.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import run_distributed
from tests.test_model import CFG, OVERLAP_OPTIONS, batches
from tests.test_train import config, corpus  # noqa: F401 (the corpus fixture)
from tetrad import grid as grid_module
from tetrad.comm.collectives import HostClock
from tetrad.grid import Grid
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.spec.overlap import OVERLAPS
from tetrad.train import trainer
from tetrad.train.step import build_optimizer, train_step

aten = torch.ops.aten
SIZED_BY_VALUES = {
    aten.bincount.default: "bincount",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.unique_dim.default: "unique",
}
"""Operators whose output size depends on their input's values: on a GPU each one copies a
count to the host and waits for it (on CPU they read memory, so they are named here)."""


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values by the host while active (``self.reads``), and the
    operators that size their output from tensor values (:data:`SIZED_BY_VALUES`,
    ``repeat_interleave`` without ``output_size``, indexing by a boolean mask): host reads on a
    GPU."""

    PATCHED = ("tolist", "cpu", "numpy")

    def __init__(self, optimizer: torch.optim.Optimizer | None = None):
        super().__init__()
        self.reads: list[str] = []
        self.optimizer = optimizer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            state = self.optimizer.state.values() if self.optimizer is not None else ()
            steps = {s["step"].data_ptr() for s in state if "step" in s}
            if args[0].data_ptr() not in steps:
                self.reads.append("item")
        elif func in SIZED_BY_VALUES:
            self.reads.append(SIZED_BY_VALUES[func])
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.reads.append("repeat_interleave")
        elif func is aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        ):
            self.reads.append("boolean index")
        return func(*args, **kwargs)

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in self.PATCHED}
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, self._counted(name, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)

    def _counted(self, name, fn):
        def counted(t, *args, **kwargs):
            self.reads.append(name)
            return fn(t, *args, **kwargs)

        return counted


def _train_steps(out: str) -> None:
    grid = Grid.build((1, 1, 2, 2))
    model = ParallelLlama(CFG, grid, False, OVERLAPS, **OVERLAP_OPTIONS)
    init_parameters(model, 0, grid)
    opt = build_optimizer(model, 1e-3, 0.1)
    with HostReads(opt) as mode:
        for batch in batches()[:2]:
            loss, norm = train_step(model, opt, grid, batch, 2, 1.0)
    assert loss.dim() == 0 and norm.dim() == 0
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(mode.reads))


def test_train_step_reads_nothing_on_the_host(tmp_path):
    run_distributed(_train_steps, 4, str(tmp_path))
    for f in sorted(tmp_path.glob("rank*.json")):
        assert json.loads(f.read_text()) == [], f"{f.name}: host reads inside train_step"


class DeferredHostClock(HostClock):
    """The host's timer with its marks read later, as NCCL's device events are (reading one
    waits for the GPU): each read counted."""

    deferred = True
    reads = 0

    def seconds(self, start: float, end: float) -> float:
        DeferredHostClock.reads += 1
        return end - start


def _train_counting(cfg, out: str) -> None:
    """``tetrad train`` with every call of the per-step function watched, the collectives
    timed by :class:`DeferredHostClock` (a read of its marks is a host read on a GPU)."""
    per_step = []
    step = trainer._step
    grid_module.clock_for = lambda device, backend: DeferredHostClock()

    def watched(job, i, batch):
        before = DeferredHostClock.reads
        with HostReads(job.optimizer) as mode:
            record = step(job, i, batch)
        per_step.append(mode.reads + ["event"] * (DeferredHostClock.reads - before))
        return record

    trainer._step = watched
    trainer.train(cfg)
    Path(out, "reads.json").write_text(json.dumps(per_step))


def test_trainer_reads_losses_only_when_logging(corpus, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    cfg = config(corpus, tmp_path / "run", 6, log_every=3)
    trainer.preflight(cfg)
    run_distributed(_train_counting, 4, cfg, str(tmp_path))
    assert json.loads((tmp_path / "reads.json").read_text()) == [[]] * 6
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(sum(r["comm_time_s"].values()) > 0 for r in rows)  # the marks, read when logging
    # an MoE model with expert parallelism: the routing statistics are taken on the device;
    # the count exchange of its one MoE block, once per micro-batch (8 / 2 ranks / 2)
    moe = config(corpus, tmp_path / "moe", 3, model="moe-tiny,vocab_size=0", grid="data=2,expert=2")
    run_distributed(_train_counting, 2, moe, str(tmp_path))
    assert json.loads((tmp_path / "reads.json").read_text()) == [["tolist"] * 2] * 3
    rows = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").open()]
    assert all(r["moe_max_load"].keys() == {"1"} for r in rows)


def _moe_steps(out: str) -> None:
    """Two MoE training steps on ``data=2``, without and with expert parallelism (2): the
    host reads of each."""
    from tests.test_moe_parallel import CONFIGS

    cfg = CONFIGS["sigmoid-bias"]  # with selection biases: their counts too
    reads = {}
    for ep in (1, 2):
        grid = Grid.build((2, 1, 1, 1, 1), expert=ep)
        model = ParallelLlama(cfg, grid, overlaps=("dp_all_reduce", "expert"))
        init_parameters(model, 0, grid)
        opt = build_optimizer(model, 1e-3, 0.1)
        with HostReads(opt) as mode:
            for batch in batches()[:2]:
                train_step(model, opt, grid, batch % cfg.vocab_size, 2, 1.0)
        reads[ep] = mode.reads
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(reads))


def test_moe_step_reads_only_the_count_exchange(tmp_path):
    """Router, dispatch, experts, combine, load-balancing loss, routing statistics and the
    selection-bias update read nothing on the host; expert parallelism reads the split sizes
    of its all-to-alls once per MoE block and micro-batch (``tolist``), nothing else."""
    from tests.test_moe_parallel import CONFIGS

    cfg = CONFIGS["sigmoid-bias"]
    run_distributed(_moe_steps, 2, str(tmp_path))
    # 2 steps x (8 samples / 2 data ranks / micro-batches of 2) x MoE blocks
    per_step = 2 * 2 * cfg.moe_layers
    for f in sorted(tmp_path.glob("rank*.json")):
        reads = json.loads(f.read_text())
        assert reads == {"1": [], "2": ["tolist"] * per_step}, f"{f.name}: {reads}"
