"""tetrad's expert-parallel MoE layer against a stock PyTorch analogue, on CPU gloo ranks.

For each world size (default 2 and 4; expert parallelism = world size) every rank holds the
same tokens ``x [T, h]`` and weights on every side and times one forward + backward of:

- tetrad: :class:`tetrad.models.moe.MoEFeedForward` on the grid ``data=P`` with
  ``G_expert = P`` (its router, :class:`tetrad.parallel.experts.ExpertParallelExperts`), its
  all-to-alls blocking;
- tetrad + overlap: the same with the ``expert`` overlap (the tokens in
  :data:`tetrad.spec.overlap.EXPERT_PIECES` pieces, each piece's exchanges behind the other's
  expert GEMMs);
- stock: ``benchmarks/stock_moe.py`` (torchtitan's dispatcher written with stock
  ``torch.distributed``: ``all_to_all_single`` of the counts, functional
  ``all_to_all_single_autograd`` of the rows, ``grouped_mm`` experts).

All run in the same processes, interleaved step by step (the sides' order rotating), a barrier
before each timed step; the table gives the medians over the repeats' steps after the warm-up,
the ratios to stock, the all-to-alls' exposed seconds (the time the step waited on them,
:class:`tetrad.comm.collectives.CommLog`) without and with the overlap, the hidden time that
the planner's schedule (:func:`tetrad.plan.comm.experts.pipelined_seconds`) predicts from the
blocking run's own per-call all-to-all seconds and the expert computation between them, and
payload bytes per step on rank 0 (tetrad: its ``CommLog``; stock: ``CollectiveCounter``, the
larger of each collective's input and output, as ``benchmarks/vs_pytorch.py``), and the
planner's all-to-all bytes for the step's routing counts
(:func:`tetrad.plan.comm.experts.all_to_all_traffic`) against tetrad's recorded ones. The first
step's outputs must agree (fp32, 1e-5).

    PYTHONPATH=. python benchmarks/moe.py [--worlds 2,4] [--tokens 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stock_moe, collective_counter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tetrad, tests

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from collective_counter import CollectiveCounter  # noqa: E402
from stock_moe import StockExpertParallelMoE  # noqa: E402

from tests.distributed import run_distributed  # noqa: E402
from tetrad.grid import Grid  # noqa: E402
from tetrad.models.moe import MoEFeedForward, can_grouped_mm, expert_swiglu  # noqa: E402
from tetrad.parallel import init_parameters  # noqa: E402
from tetrad.parallel.model import ParallelLayers  # noqa: E402
from tetrad.parallel.overlap import Overlap  # noqa: E402
from tetrad.plan.comm.experts import all_to_all_traffic, pipelined_seconds  # noqa: E402
from tetrad.spec.grid import Axis
from tetrad.spec.overlap import EXPERT_PIECES
from tetrad.spec.presets import PRESETS


def build(args: argparse.Namespace, world: int):
    """Both layers on this rank, with the same weights, and this rank's tokens."""
    cfg = dataclasses.replace(
        PRESETS["moe-small"],
        dim=args.dim,
        n_experts=args.experts,
        top_k=args.top_k,
        expert_ffn_dim=args.ffn,
        aux_loss_coef=0.0,
    )
    grid = Grid.build((world, 1, 1, 1, 1), expert=world)
    ours = MoEFeedForward(cfg, ParallelLayers(grid, Overlap(grid, ())), None)
    init_parameters(ours, args.seed, grid)
    overlap = Overlap(grid, ("expert",), expert_pieces=args.pieces)
    piped = MoEFeedForward(cfg, ParallelLayers(grid, overlap), None)
    piped.load_state_dict(ours.state_dict())
    x = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    grouped = can_grouped_mm(x, args.dim, args.ffn)
    group = dist.group.WORLD
    stock = StockExpertParallelMoE(args.experts, args.dim, args.ffn, args.top_k, group, grouped)
    with torch.no_grad():
        stock.gate.weight.copy_(ours.router.gate.weight)
        for name in ("w1", "w3", "w2"):
            getattr(stock, name).copy_(getattr(ours.experts, name))
    return grid, ours, piped, stock, x


def one_step(layer, x: torch.Tensor, dy: torch.Tensor, tetrad: bool) -> torch.Tensor:
    layer.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    y = layer(xi.view(1, *x.shape)).view_as(x) if tetrad else layer(xi)
    y.backward(dy)
    return y.detach()


def worker(args: argparse.Namespace, world: int, out: str) -> None:
    grid, ours, piped, stock, x = build(args, world)
    layers = {"tetrad": ours, "overlap": piped, "stock": stock}
    dy = torch.randn_like(x)
    y = {side: one_step(layer, x, dy, side != "stock") for side, layer in layers.items()}
    diff = max((y[side] - y["stock"]).abs().max().item() for side in ("tetrad", "overlap"))
    times: dict[str, list[float]] = {side: [] for side in layers}
    exposed: dict[str, list[float]] = {"tetrad": [], "overlap": []}
    for r in range(args.repeats):
        for i in range(args.steps):
            k = (r * args.steps + i) % 3
            for side in (list(layers) * 2)[k : k + 3]:
                dist.barrier()
                grid.comm.reset()
                t0 = time.perf_counter()
                one_step(layers[side], x, dy, side != "stock")
                if i >= args.warmup:
                    times[side].append(time.perf_counter() - t0)
                    if side in exposed:
                        exposed[side].append(grid.comm.reset()[Axis.EXPERT].exposed_s)
    grid.comm.reset()
    one_step(ours, x, dy, True)
    recorded = grid.comm.reset()[Axis.EXPERT]
    with CollectiveCounter() as counter:
        one_step(stock, x, dy, False)
    ids = ours.router(x)[0]
    mine = torch.bincount(ids.flatten(), minlength=args.experts)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    plan = all_to_all_traffic([[c.tolist() for c in every]], dist.get_rank(), args.dim, 4)
    predicted = predicted_hidden(grid, ours, x, dy, args.pieces)
    if dist.get_rank() == 0:
        result = {
            "world": world,
            "max_output_diff": diff,
            **{f"{side}_s": statistics.median(t) for side, t in times.items()},
            **{f"{side}_exposed_s": statistics.median(t) for side, t in exposed.items()},
            "predicted_hidden_s": predicted,
            "tetrad_payload": recorded.payload_bytes,
            "tetrad_calls": recorded.calls,
            "tetrad_sent": recorded.bytes,
            "stock_payload": sum(counter.bytes.values()),
            "stock_calls": sum(counter.calls.values()),
            "plan_payload": plan.payload_bytes,
            "plan_sent": plan.sent_bytes,
            "plan_calls": plan.calls,
            # the routing of the step's tokens over all ranks: busiest expert over the mean
            "max_mean_load": float(
                torch.stack(every).sum(0).max() / torch.stack(every).sum(0).float().mean()
            ),
        }
        Path(out).write_text(json.dumps(result))
    dist.barrier()


def predicted_hidden(grid: Grid, layer, x: torch.Tensor, dy: torch.Tensor, n: int) -> float:
    """The all-to-all seconds the planner's schedule hides with the overlap's pieces
    (:func:`pipelined_seconds`), from the blocking layer's own figures on this machine: a row
    all-to-all's seconds (the CommLog's over the backward, whose calls are the rows' alone)
    and the expert GEMMs and SwiGLU between them (timed alone on as many rows as this rank's
    slots, forward and backward), each cut in ``n`` equal pieces; the medians of 5 steps."""
    experts = layer.experts
    ids = layer.router(x)[0]
    rows = ids.numel()
    hidden = []
    for _ in range(5):
        layer.zero_grad(set_to_none=True)
        grid.comm.reset()  # the forward's calls (the counts' among them) left out
        y = layer(x.detach().requires_grad_().view(1, *x.shape)).view_as(x)
        grid.comm.reset()
        y.backward(dy)
        stats = grid.comm.reset()[Axis.EXPERT]
        row = stats.time_s / stats.calls
        xs = torch.randn(rows, x.shape[1], requires_grad=True)
        counts = torch.full((experts.w1.shape[0],), rows // experts.w1.shape[0])
        counts[-1] += rows - int(counts.sum())
        t0 = time.perf_counter()
        ys = expert_swiglu(xs, counts, experts.w1, experts.w3, experts.w2)
        t1 = time.perf_counter()
        ys.backward(torch.ones_like(ys))
        t2 = time.perf_counter()
        fwd, bwd = [(t1 - t0) / n] * n, [(t2 - t1) / n] * n
        pieces = [row / n] * n
        blocking = 4 * row + (t2 - t0)
        piped = pipelined_seconds(pieces, fwd, pieces) + pipelined_seconds(pieces, bwd, pieces)
        hidden.append(blocking - piped)
    return statistics.median(hidden)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=384, help="expert width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pieces", type=int, default=EXPERT_PIECES, help="the expert overlap's")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows, ok = [], True
    print(
        f"T={args.tokens} tokens/rank, h={args.dim}, E={args.experts}, F={args.ffn}, "
        f"top-{args.top_k}; medians of {args.repeats} x {args.steps - args.warmup} steps; "
        f"the overlap's {args.pieces} pieces"
    )
    print(
        "world  tetrad s  +overlap s  stock s  ratio  +overlap  exposed a2a s  +overlap  "
        "hidden measured  predicted  payload B tetrad  stock  planner  sent B tetrad planner  "
        "max|dy|  max/mean load"
    )
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "r.json")
            run_distributed(worker, world, args, world, out)
            r = json.loads(Path(out).read_text())
        rows.append(r)
        exact = r["plan_payload"] == r["tetrad_payload"] and r["plan_sent"] == r["tetrad_sent"]
        ok &= exact and r["max_output_diff"] <= 1e-5 and r["tetrad_payload"] <= r["stock_payload"]
        hidden = r["tetrad_exposed_s"] - r["overlap_exposed_s"]
        print(
            f"{world:5d}  {r['tetrad_s']:8.4f}  {r['overlap_s']:10.4f}  {r['stock_s']:7.4f}  "
            f"{r['tetrad_s'] / r['stock_s']:5.3f}  {r['overlap_s'] / r['stock_s']:8.3f}  "
            f"{r['tetrad_exposed_s']:13.4f}  {r['overlap_exposed_s']:8.4f}  {hidden:15.4f}  "
            f"{r['predicted_hidden_s']:9.4f}  {r['tetrad_payload']:16,.0f}  "
            f"{r['stock_payload']:,.0f}  {r['plan_payload']:,.0f}  {r['tetrad_sent']:,.0f} "
            f"{r['plan_sent']:,.0f}  {r['max_output_diff']:.1e}  {r['max_mean_load']:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
