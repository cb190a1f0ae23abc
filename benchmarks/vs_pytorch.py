"""tetrad against what users would pick instead: stock PyTorch on the same model and batch.

For each world size (default 2 and 4 processes, CPU, gloo, fp32) this runs, side by side, tetrad's
real training step on several ``G_data,G_z,G_y,G_x`` grids and stock ``torch.distributed`` on the
same Llama (:class:`tetrad.models.reference.Llama`, plain ``torch.nn`` layers), from the same
weights (:func:`tetrad.parallel.init_parameters`, same seed) and the same global batch, and
prints one table per world size: seconds per step, payload bytes per step and first-step losses,
with tetrad/stock ratios, then tetrad's best grid against the best stock mode.

Stock modes, parallelised only with stock APIs:

- ``DDP``: ``DistributedDataParallel``, data parallel over all ranks.
- ``FSDP2``: ``fully_shard`` on each block, then on the root.
- ``TP(n)``: ``parallelize_module`` (1D tensor parallel, Megatron style): ``ColwiseParallel``
  for the q, k, v, gate (w1) and up (w3) projections, ``RowwiseParallel`` for wo and the down
  projection w2; the embedding ``RowwiseParallel`` (vocabulary-sharded); the LM head
  ``ColwiseParallel`` with vocabulary-sharded logits and ``loss_parallel``. tetrad's Llama may
  fuse q, k, v into ``wqkv`` and gate, up into ``w13``; their output features are ordered so
  that contiguous column shards hold whole KV-head groups and matching gate/up pairs, so the
  same plan applies to them. ``PrepareModuleInput`` makes each block's attention and
  feed-forward input one replicated DTensor, so separate projections sum their input gradients
  locally and all-reduce them once (without it each would all-reduce its own). The RMSNorm
  weights become replicated DTensors (``distribute_module``), which ``clip_grad_norm_`` needs:
  it cannot mix DTensor and plain-tensor gradients.
- ``FSDP2xTP(n)``: a 2D mesh ``("dp", "tp")``: TP as above on ``tp``, then ``fully_shard`` on
  ``dp``.

Both sides: AdamW (lr 3e-3, betas (0.9, 0.95), weight decay 0.1 on matrices only, torch's fused
kernel, ``fused=True``, as tetrad's trainer and torchtitan's default use it),
gradient clipping at 1.0, the loss is the mean cross-entropy over all tokens of the global batch,
each data rank takes its share of the batch as one micro-batch (tetrad's data ranks are
``G_data G_z``). Every run is its own set of fresh processes, one thread each (spawned; or with
``--start-method forkserver``, forked from a server that imported this script once).

Timing: ``time.perf_counter()`` around each step, ``float(loss)`` included (CPU ops are
synchronous), the ranks started together by a barrier; per step the maximum over ranks; the
median over steps ``warmup+1..steps`` of all repeats. Repeats are interleaved: each repeat runs
every row, tetrad then stock, every other repeat in reverse order (ABBA).

Bytes (per step, rank 0, one extra step after the timed ones): the PAYLOAD of each collective
call, the larger of its input and output buffers (the nccl-tests "size" convention: the tensor
of an all-reduce or broadcast, the gathered output of an all-gather, the unreduced input of a
reduce-scatter), summed over calls. It is not wire traffic (a ring all-reduce sends
``2(p-1)/p`` of it per rank, a ring all-gather or reduce-scatter ``(p-1)/p``). tetrad's figures
come from its own record (:class:`tetrad.comm.collectives.CommLog`, ``payload_bytes`` per
axis); stock figures from a ``TorchDispatchMode`` that sees every c10d op (plain ``dist.*``,
DDP's reducer, FSDP2) and every functional collective (DTensor redistributions,
``loss_parallel``) after DTensor has lowered itself to plain tensors.

Run from the repository root (several minutes on 2 cores)::

    python benchmarks/vs_pytorch.py [--model small] [--seq 256] [--batch 16] [--steps 12]
        [--warmup 3] [--repeats 2] [--worlds 2,4] [--modes ddp,fsdp2,tp,fsdp2-tp]
        [--orientation auto|xy|both] [--json FILE] [--start-method spawn|forkserver]

The exit status is 1 if a first-step loss differs from tetrad's by more than 1e-4 relative (the
comparison would not be apples to apples) or a run failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.multiprocessing.spawn import ProcessException
from torch.utils._python_dispatch import TorchDispatchMode

from tetrad.grid import Grid
from tetrad.models.config import ModelConfig, parse_model
from tetrad.models.reference import Llama
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.plan.comm.context import Context
from tetrad.plan.comm.estimate import best_orientation
from tetrad.plan.machine.spec import get_machine
from tetrad.spec import GridShape
from tetrad.train.step import build_optimizer, train_step

LOSS_TOLERANCE = 1e-4
MB = 1e6

# ---- what runs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stock:
    """A stock PyTorch mode: ``kind`` (ddp, fsdp2, tp, fsdp2-tp) and its tensor-parallel size."""

    kind: str
    tp: int = 1

    def __str__(self) -> str:
        names = {"ddp": "DDP", "fsdp2": "FSDP2", "tp": "TP({})", "fsdp2-tp": "FSDP2xTP({})"}
        return names[self.kind].format(self.tp)


STOCK_KINDS = ("ddp", "fsdp2", "tp", "fsdp2-tp")

ROWS: dict[int, list[tuple[GridShape, Stock]]] = {
    2: [
        ((2, 1, 1, 1), Stock("ddp")),
        ((1, 2, 1, 1), Stock("fsdp2")),
        ((1, 1, 2, 1), Stock("tp", 2)),
        ((1, 1, 1, 2), Stock("tp", 2)),
    ],
    4: [
        ((4, 1, 1, 1), Stock("ddp")),
        ((1, 4, 1, 1), Stock("fsdp2")),
        ((1, 1, 2, 2), Stock("tp", 4)),
        ((1, 1, 1, 4), Stock("tp", 4)),
        ((1, 1, 4, 1), Stock("tp", 4)),
        ((1, 2, 2, 1), Stock("fsdp2-tp", 2)),
        ((2, 1, 2, 1), Stock("fsdp2-tp", 2)),
        ((1, 2, 1, 2), Stock("fsdp2-tp", 2)),
        ((2, 1, 1, 2), Stock("fsdp2-tp", 2)),
        ((1, 1, 2, 2), Stock("fsdp2-tp", 2)),
    ],
}
"""Per world size: (tetrad grid, the stock mode it is compared with)."""


@dataclass(frozen=True)
class Settings:
    """What every run shares: model, batch, steps, optimizer."""

    cfg: ModelConfig
    seq: int = 256
    batch: int = 16
    steps: int = 12
    warmup: int = 3
    seed: int = 0
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def global_batch(self) -> torch.Tensor:
        """The global batch ``[batch, seq+1]`` of token ids, the same in every run and step."""
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.cfg.vocab_size, (self.batch, self.seq + 1), generator=gen)


@dataclass(frozen=True)
class Job:
    """One run: tetrad on ``grid`` or stock PyTorch in ``stock`` mode, on ``world`` ranks."""

    world: int
    settings: Settings
    grid: GridShape | None = None
    stock: Stock | None = None
    orientation: str = "xy"

    def label(self) -> str:
        return (
            f"tetrad {fmt_grid(self.grid, self.orientation)}"
            if self.grid
            else f"stock {self.stock}"
        )


def fmt_grid(sizes: GridShape, orientation: str = "xy") -> str:
    return ",".join(map(str, sizes)) + (" yx" if orientation == "yx" else "")


def auto_orientation(s: Settings, grid: GridShape) -> str:
    """The orientation ``tetrad train`` runs ``grid`` in without ``--machine`` (fewer bytes on
    the X and Y roles: :func:`tetrad.plan.comm.estimate.best_orientation`)."""
    ctx = Context(s.cfg.spec(), get_machine("dgx-h100"), s.seq, s.batch, compute_bytes=4)
    return best_orientation(ctx, grid, s.batch // (grid[0] * grid[1]), "none")


def tetrad_jobs(world: int, s: Settings, grid: GridShape, how: str) -> list[Job]:
    """The tetrad runs of one row: ``how`` = ``auto`` (the orientation tetrad train picks),
    ``xy`` (the pairs never turned: the runtime before orientations), or ``both`` (xy, and the
    auto one where it differs: before and after, side by side)."""
    turns = {"auto": [auto_orientation(s, grid)], "xy": ["xy"]}.get(how)
    if turns is None:
        turns = list(dict.fromkeys(["xy", auto_orientation(s, grid)]))
    return [Job(world, s, grid=grid, orientation=t) for t in turns]


# ---- spawning ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, job: Job, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(job.world),
        LOCAL_RANK=str(rank),
    )
    # DTensor's note that clip_grad_norm_ on a 2D mesh all-reduces twice: stock behaviour.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=job.world)
    try:
        result = run_tetrad(job) if job.grid else run_stock(job)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "tetrad.models.reference",
    "tetrad.parallel.model",
    "tetrad.train.step",
]


def spawn(job: Job, start_method: str = "spawn") -> dict:
    """Run ``job`` on ``job.world`` fresh processes; rank 0's result, or ``{"error": ...}``.

    ``start_method``: ``spawn`` (each process imports torch and this script) or ``forkserver``
    (processes forked from a server that imported this script once: the same fresh processes,
    started in a fraction of the time; what the test suite uses)."""
    if start_method == "forkserver":  # by name: Python 3.11's server cannot preload __main__
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        try:
            mp.start_processes(
                _worker,
                args=(job, _free_port(), str(out)),
                nprocs=job.world,
                start_method=start_method,
            )
        except ProcessException as e:
            return {"error": str(e).strip().splitlines()[-1]}
        return json.loads(out.read_text())


# ---- measuring (inside a worker) ---------------------------------------------------------------


def measure(step: Callable[[], float], steps: int) -> dict:
    """Run ``step`` (returns the loss) ``steps`` times: per-step seconds (maximum over ranks)
    and losses. A barrier before each step starts every rank's clock together, so a rank's
    lag in one step is not counted in the next."""
    times, losses = [], []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"times": t.tolist(), "losses": losses}


def run_tetrad(job: Job) -> dict:
    """tetrad's training step on ``job.grid``; bytes from the grid's :class:`CommLog`."""
    s = job.settings
    grid = Grid.build(job.grid, "cpu", job.orientation)
    model = ParallelLlama(s.cfg, grid)
    init_parameters(model, s.seed, grid)
    opt = build_optimizer(model, s.lr, s.weight_decay)
    batch, micro_batch = s.global_batch(), s.batch // grid.batch_shards

    def step() -> float:
        return float(train_step(model, opt, grid, batch, micro_batch, s.grad_clip)[0])

    result = measure(step, s.steps)
    grid.comm.reset()
    step()
    stats = grid.comm.reset()
    result["bytes"] = {str(a): st.payload_bytes for a, st in stats.items() if st.calls}
    result["calls"] = {str(a): st.calls for a, st in stats.items() if st.calls}
    return result


def run_stock(job: Job) -> dict:
    """Stock PyTorch in ``job.stock`` mode; bytes from a :class:`CollectiveCounter`."""
    s = job.settings
    run = build_stock(job.stock, s, job.world)
    opt = stock_optimizer(run.model, s)
    share = s.global_batch().chunk(run.dp_size)[run.dp_rank]
    tokens, targets = share[:, :-1].contiguous(), share[:, 1:].contiguous()

    def step() -> float:
        return stock_step(run, opt, tokens, targets, s.grad_clip)

    result = measure(step, s.steps)
    with CollectiveCounter() as counter:
        step()
    result["bytes"], result["calls"] = dict(counter.bytes), dict(counter.calls)
    return result


# ---- stock PyTorch -----------------------------------------------------------------------------


@dataclass
class StockModel:
    """A parallelised reference model and its data-parallel layout."""

    model: nn.Module
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: dist.ProcessGroup | None = None  # None: the whole world
    parallel_loss: bool = False  # vocabulary-sharded logits: the loss needs ``loss_parallel``


def build_stock(mode: Stock, s: Settings, world: int) -> StockModel:
    """The reference Llama, initialised as tetrad's, parallelised in ``mode``."""
    model = Llama(s.cfg)
    init_parameters(model, s.seed)
    rank = dist.get_rank()
    if mode.kind == "ddp":
        return StockModel(nn.parallel.DistributedDataParallel(model), world, rank)
    if mode.kind == "fsdp2":
        apply_fsdp(model, init_device_mesh("cpu", (world,)))
        return StockModel(model, world, rank)
    if mode.kind == "tp":
        apply_tp(model, init_device_mesh("cpu", (world,)))
        return StockModel(model, parallel_loss=True)
    mesh = init_device_mesh("cpu", (world // mode.tp, mode.tp), mesh_dim_names=("dp", "tp"))
    apply_tp(model, mesh["tp"])
    apply_fsdp(model, mesh["dp"])
    dp = mesh["dp"]
    return StockModel(model, dp.size(), dp.get_local_rank(), dp.get_group(), parallel_loss=True)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2: ``fully_shard`` each block, then the root."""
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """1D tensor parallelism over ``mesh`` (see the module docstring for the plan)."""
    tp = mesh.size()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        parallelize_module(block, mesh, block_plan(block))
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp
        replicate(block.attention_norm, mesh)
        replicate(block.ffn_norm, mesh)
    replicate(model.norm, mesh)


def block_plan(block: nn.Module) -> dict:
    """A block's TP plan: its attention and feed-forward inputs one replicated DTensor, their
    output projections (``wo``, ``w2``) rowwise, every other projection (q, k, v, gate, up,
    separate or fused) columnwise."""
    one_input = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
    )
    with_positions = PrepareModuleInput(  # attention also takes the plain positions tensor
        input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None)
    )
    plan = {"attention": with_positions, "feed_forward": one_input}
    for part, out in (("attention", "wo"), ("feed_forward", "w2")):
        for name, child in getattr(block, part).named_children():
            if isinstance(child, nn.Linear):
                plan[f"{part}.{name}"] = RowwiseParallel() if name == out else ColwiseParallel()
    return plan


def replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make ``module``'s parameters replicated DTensors; it takes and returns plain tensors."""

    def to_dtensor(_module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

    def to_local(_module, output, _mesh):
        return output.to_local()

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def stock_optimizer(model: nn.Module, s: Settings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only, torch's fused kernel (``fused=True``, also on
    DTensor parameters), as :func:`tetrad.train.step.build_optimizer` builds tetrad's."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": s.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def stock_step(
    run: StockModel,
    opt: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    grad_clip: float,
) -> float:
    """Forward, backward, clip, update on this data rank's share; returns the global mean loss.

    The loss is this rank's token mean: DDP and FSDP2 average gradients over data ranks, so the
    gradient is that of the mean over the global batch.
    """
    with loss_parallel() if run.parallel_loss else nullcontext():
        logits = run.model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        loss = loss / targets.numel()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if run.dp_size > 1:
        dist.all_reduce(loss, group=run.dp_group)
        loss /= run.dp_size
    return float(loss)


# ---- counting stock collectives ----------------------------------------------------------------

_KINDS = (
    ("reduce_scatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("all_to_all", "all_to_all"),
    ("broadcast", "broadcast"),
    ("send", "send"),
    ("recv", "recv"),
    ("scatter", "scatter"),
    ("gather", "gather"),
    ("reduce", "reduce"),
)
"""Substring of an op name -> collective kind, first match wins."""


def collective_kind(op: torch._ops.OpOverload) -> str | None:
    """The kind of a c10d or functional collective op (``all_reduce``, ...), else ``None``."""
    namespace, _, name = op.name().partition("::")
    if namespace not in ("c10d", "_c10d_functional"):
        return None
    return next((kind for key, kind in _KINDS if key in name), None)


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def payload_bytes(op: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> int:
    """The larger of a collective's input and output buffers. A c10d op names its outputs
    ``output*`` (an in-place op's tensors are both); a functional op returns its output (an
    ``*_out`` variant also takes it as ``out``)."""
    names = [a.name for a in op._schema.arguments]
    given = dict(zip(names, args, strict=False)) | kwargs
    inputs = sum(_nbytes(v) for k, v in given.items() if not k.startswith("out"))
    outputs = sum(_nbytes(v) for k, v in given.items() if k.startswith("out"))
    if op.namespace == "_c10d_functional" and "out" not in given:
        outputs += _nbytes(out)
    return max(inputs, outputs)


class CollectiveCounter(TorchDispatchMode):
    """Counts the calls and payload bytes, per kind, of the collectives issued while active.

    DTensor operations are passed on (``NotImplemented``) so that DTensor lowers them to plain
    tensors; the collectives that produces come back here.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        kind = collective_kind(func)
        if kind is not None:
            self.bytes[kind] += payload_bytes(func, args, kwargs, out)
            self.calls[kind] += 1
        return out


# ---- the schedule and the report ---------------------------------------------------------------


def schedule(worlds: list[int], modes: set[str], s: Settings, how: str) -> list[Job]:
    """One repeat: for each world, for each row, tetrad then stock (each job once)."""
    jobs: list[Job] = []
    for world in worlds:
        for grid, stock in rows_for(world, modes):
            for job in (*tetrad_jobs(world, s, grid, how), Job(world, s, stock=stock)):
                if job not in jobs:
                    jobs.append(job)
    return jobs


def rows_for(world: int, modes: set[str]) -> list[tuple[GridShape, Stock]]:
    return [(g, m) for g, m in ROWS[world] if m.kind in modes]


def summarise(runs: list[dict], warmup: int) -> dict:
    """Pool the runs of one job: the median step time over the steps after ``warmup``, the
    first and last losses, and the bytes and calls per step (of the last run)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    times = [t for r in ok for t in r["times"][warmup:]]
    return {
        "median_s": statistics.median(times),
        "repeat_medians_s": [statistics.median(r["times"][warmup:]) for r in ok],
        "loss_first": ok[0]["losses"][0],
        "loss_last": ok[0]["losses"][-1],
        "bytes": ok[-1]["bytes"],
        "calls": ok[-1]["calls"],
        "total_mb": sum(ok[-1]["bytes"].values()) / MB,
    }


def loss_ok(a: dict, b: dict) -> bool:
    if "error" in a or "error" in b:
        return False
    return abs(a["loss_first"] - b["loss_first"]) <= LOSS_TOLERANCE * abs(b["loss_first"])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def table_row(job: Job, stock: Stock, t: dict, p: dict, ref: dict) -> list[str]:
    """One printed row: tetrad grid vs stock mode (``ref``: the loss everything must match)."""
    name = fmt_grid(job.grid, job.orientation)
    if "error" in t or "error" in p:
        err = t.get("error") or p.get("error")
        return [name, "-", str(stock), "-", "-", "-", "-", "-", "-", "-", f"FAIL {err}"]
    ok = loss_ok(t, ref) and loss_ok(p, ref)
    return [
        name,
        f"{t['median_s']:.3f}",
        str(stock),
        f"{p['median_s']:.3f}",
        _ratio(t["median_s"], p["median_s"]),
        f"{t['total_mb']:.1f}",
        f"{p['total_mb']:.1f}",
        _ratio(t["total_mb"], p["total_mb"]),
        f"{t['loss_first']:.6f}",
        f"{p['loss_first']:.6f}",
        "ok" if ok else "MISMATCH",
    ]


HEADER = [
    "tetrad grid",
    "tetrad s/step",
    "stock mode",
    "stock s/step",
    "time ratio",
    "tetrad MB/step",
    "stock MB/step",
    "bytes ratio",
    "loss1 tetrad",
    "loss1 stock",
    "losses",
]


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [HEADER, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


ORDER = ["data", "z", "y", "x", "world", "all_reduce", "all_gather", "reduce_scatter"]
"""The order of the per-axis (tetrad) and per-kind (stock) byte counts in the report."""


def detail_lines(results: dict[Job, dict], world: int) -> list[str]:
    """Per job: the median s/step of each repeat, then the bytes per step by axis (tetrad) or
    collective kind (stock), with call counts."""
    lines = []
    for job, r in results.items():
        if job.world != world or "error" in r:
            continue
        keys = sorted(r["bytes"], key=lambda k: (ORDER.index(k) if k in ORDER else len(ORDER), k))
        parts = [f"{k} {r['bytes'][k] / MB:.2f} MB/{r['calls'][k]} calls" for k in keys]
        times = "/".join(f"{t:.3f}" for t in r["repeat_medians_s"])
        lines.append(f"  {job.label():<20} {times} s; {'; '.join(parts) or 'no collectives'}")
    return lines


def best_line(results: dict[Job, dict], world: int) -> str:
    """tetrad's fastest grid against the fastest stock mode at ``world``."""
    done = {j: r for j, r in results.items() if j.world == world and "error" not in r}
    tetrad = [j for j in done if j.grid]
    stock = [j for j in done if j.stock]
    if not tetrad or not stock:
        return f"world {world}: best vs best: not available"
    bt = min(tetrad, key=lambda j: done[j]["median_s"])
    bs = min(stock, key=lambda j: done[j]["median_s"])
    t, p = done[bt]["median_s"], done[bs]["median_s"]
    return (
        f"world {world}: best tetrad {fmt_grid(bt.grid, bt.orientation)} {t:.3f} s/step vs "
        f"best stock "
        f"{bs.stock} {p:.3f} s/step: time ratio {t / p:.2f}"
    )


def report(
    results: dict[Job, dict], s: Settings, worlds: list[int], modes: set[str], how: str
) -> bool:
    """Print the tables; returns whether every run finished and every first loss matches."""
    all_ok = True
    for world in worlds:
        rows = [(j, st) for g, st in rows_for(world, modes) for j in tetrad_jobs(world, s, g, how)]
        done = [results[j] for j, _ in rows]
        ref = next((r for r in done if "error" not in r), {"error": "no tetrad run"})
        table = []
        for job, stock in rows:
            t = results[job]
            p = results[Job(world, s, stock=stock)]
            table.append(table_row(job, stock, t, p, ref))
            all_ok &= loss_ok(t, ref) and loss_ok(p, ref)
        print(f"\nworld size {world}")
        print(format_table(table))
        print("per repeat s/step; payload bytes per step (rank 0):")
        print("\n".join(detail_lines(results, world)))
        print(best_line(results, world))
    return all_ok


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="preset[,key=value...] (default small)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--worlds", default="2,4", help="comma-separated world sizes (2, 4)")
    p.add_argument("--modes", default=",".join(STOCK_KINDS), help="stock modes to compare with")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--orientation",
        choices=("auto", "xy", "both"),
        default="auto",
        help="tetrad's layer pairs: as tetrad train turns them (auto), never turned (xy), or "
        "both side by side where they differ",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--start-method",
        choices=("spawn", "forkserver"),
        default="spawn",
        help="how each run's processes start (forkserver: faster, for smoke runs)",
    )
    a = p.parse_args(argv)
    a.worlds = [int(w) for w in a.worlds.split(",")]
    a.modes = set(a.modes.split(","))
    if bad := [w for w in a.worlds if w not in ROWS]:
        p.error(f"--worlds: no rows for {bad}; choose from {sorted(ROWS)}")
    if bad := a.modes - set(STOCK_KINDS):
        p.error(f"--modes: unknown {sorted(bad)}; choose from {', '.join(STOCK_KINDS)}")
    if a.steps <= a.warmup:
        p.error("--steps must exceed --warmup")
    return a


def run_all(jobs: list[Job], repeats: int, start_method: str = "spawn") -> dict[Job, dict]:
    """Every job ``repeats`` times, interleaved, every other repeat in reverse order (ABBA: a
    drift of the machine's speed favours neither side); the pooled summary of each."""
    runs: dict[Job, list[dict]] = {j: [] for j in jobs}
    for rep in range(repeats):
        for job in jobs if rep % 2 == 0 else jobs[::-1]:
            r = spawn(job, start_method)
            runs[job].append(r)
            took = r.get("error") or f"{statistics.median(r['times'][job.settings.warmup :]):.3f} s"
            print(f"[{rep + 1}/{repeats}] world {job.world} {job.label()}: {took}", file=sys.stderr)
    return {j: summarise(rs, j.settings.warmup) for j, rs in runs.items()}


def to_json(results: dict[Job, dict], s: Settings, args: argparse.Namespace) -> dict:
    runs = [
        {"world": j.world, "side": "tetrad" if j.grid else "stock", "config": j.label(), **r}
        for j, r in results.items()
    ]
    return {
        "settings": {**asdict(s), "repeats": args.repeats, "worlds": args.worlds},
        "runs": runs,
        "best": {w: best_line(results, w) for w in args.worlds},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg, _ = parse_model(args.model)
    s = Settings(cfg, args.seq, args.batch, args.steps, args.warmup, args.seed)
    print(
        f"model {args.model}: {cfg}; seq {s.seq}, global batch {s.batch}, {s.steps} steps "
        f"(medians over steps {s.warmup + 1}-{s.steps}), {args.repeats} repeats; CPU gloo fp32"
    )
    jobs = schedule(args.worlds, args.modes, s, args.orientation)
    results = run_all(jobs, args.repeats, args.start_method)
    ok = report(results, s, args.worlds, args.modes, args.orientation)
    if args.json:
        args.json.write_text(json.dumps(to_json(results, s, args), indent=1))
    if not ok:
        print("\nFAILED: a run failed or a first-step loss differs from tetrad's", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
