"""Two ranks on one GPU: gloo on CUDA tensors, then multi-rank equivalence on CUDA.

    PYTHONPATH=. python benchmarks/gloo_cuda.py [--grids 2,1,1,1 1,2,1,1 1,1,2,1]

NCCL refuses two ranks on one device, so a one-GPU machine can run tetrad's multi-rank CUDA
code (its streams, events and asynchronous collectives) only over gloo, which takes CUDA
tensors for some collectives. Two processes, both on ``cuda:0``, gloo:

1. **Probe**: every collective tetrad issues (``all_reduce``, the single-tensor all-gather and
   reduce-scatter, ``isend``/``irecv``), blocking and asynchronous, on CUDA tensors, each
   against its expected value; a collective gloo refuses is reported with its error.
   The point-to-point probe runs last (it has killed a rank on CUDA tensors) and only prints;
   the ``fine`` overlap's ring needs it.
2. **Equivalence** (only if the all-reduce and all-gather work): the check of
   ``tests/test_model.py`` on each grid, on CUDA: the tiny Llama, 3 AdamW steps with warm-up,
   clipping and two micro-batches, every overlap on; loss and gradient norm against the fp32
   single-process reference within 1e-5 and 1e-4 relative, every updated weight shard within
   0.05 lr. The steps run in fp32 (``tetrad.dtypes.autocast`` replaced by no autocast, TF32
   off), so the tolerances are the CPU tests' own.

Prints one line per check and ``gloo_cuda: ok`` (exit 0) or the failures (exit 1).
``--device cpu`` runs the same on the CPU (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import os
import queue as queue_module
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_model import (  # noqa: E402  (the same check: its model, batches, reference)
    CFG,
    CLIP,
    LR,
    MICRO,
    SEED,
    STEPS,
    batches,
    reference_run,
)
from tetrad.comm.collectives import all_gather_single, reduce_scatter_single  # noqa: E402
from tetrad.grid import Grid, parse_grid  # noqa: E402
from tetrad.parallel import init_parameters  # noqa: E402
from tetrad.parallel.model import ParallelLlama  # noqa: E402
from tetrad.spec.overlap import OVERLAPS
from tetrad.spec.precision import precision  # noqa: E402
from tetrad.train import step as step_module  # noqa: E402


def probe(rank: int, dev: torch.device, point_to_point: bool = False) -> dict[str, str]:
    """Each collective on CUDA tensors (or, with ``point_to_point``, ``isend``/``irecv``):
    ``{name: "ok" | error}``."""
    results = {}

    def check(name, fn):
        print(f"gloo_cuda: rank {rank} trying {name}", flush=True)  # the last such line names
        try:  # a collective that kills the process
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            results[name] = "ok"
        except Exception as e:  # noqa: BLE001 (a refused collective is a finding)
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"

    def all_reduce(async_op):
        t = torch.full((1024,), float(rank + 1), device=dev)
        w = dist.all_reduce(t, async_op=async_op)
        if async_op:
            w.wait()
        assert torch.all(t == 3.0), t[:4]

    def all_gather(async_op):
        t = torch.full((256,), float(rank), device=dev)
        out = torch.empty(512, device=dev)
        w = all_gather_single(out, t, async_op=async_op)
        if async_op:
            w.wait()
        assert torch.equal(out.cpu(), torch.tensor([0.0] * 256 + [1.0] * 256)), out

    def reduce_scatter(async_op):
        t = torch.arange(512, dtype=torch.float32, device=dev)
        out = torch.empty(256, device=dev)
        w = reduce_scatter_single(out, t, async_op=async_op)
        if async_op:
            w.wait()
        assert torch.equal(out.cpu(), 2 * (torch.arange(256.0) + 256 * rank)), out[:4]

    def send_recv():
        t = torch.full((128,), float(rank), device=dev)
        got = torch.empty(128, device=dev)
        peer = 1 - rank
        reqs = [dist.isend(t, peer), dist.irecv(got, peer)]
        for r in reqs:
            r.wait()
        assert torch.all(got == peer), got[:4]

    if point_to_point:
        check("isend/irecv", send_recv)
        return results
    for async_op in (False, True):
        suffix = " (async)" if async_op else ""
        check("all_reduce" + suffix, lambda a=async_op: all_reduce(a))
        check("all-gather" + suffix, lambda a=async_op: all_gather(a))
        check("reduce-scatter" + suffix, lambda a=async_op: reduce_scatter(a))
    return results


def equivalence(sizes: tuple[int, ...], ref, device_type: str) -> str:
    """``tests/test_model.py``'s check of one grid on CUDA in fp32: "ok" or what differs."""
    (ref_losses, ref_norms), ref_weights = ref
    grid = Grid.build(sizes, device_type)
    model = ParallelLlama(CFG, grid, "none", OVERLAPS, bucket_bytes=1 << 14, domino_min_rows=8)
    init_parameters(model, SEED, grid)
    # the CPU's policy (fp32 everywhere, no autocast) on CUDA too: the reference's numbers
    opt = step_module.build_optimizer(model, LR, weight_decay=0.1, policy=precision("cpu"))
    for step, batch in enumerate(batches()):
        for group in opt.param_groups:
            group["lr"] = step_module.lr_at(step, LR, LR / 10, 2, STEPS)
        loss, norm = map(float, step_module.train_step(model, opt, grid, batch, MICRO, CLIP))
        if abs(loss - ref_losses[step]) > 1e-5 * ref_losses[step]:
            return f"step {step}: loss {loss} vs {ref_losses[step]}"
        if abs(norm - ref_norms[step]) > 1e-4 * ref_norms[step]:
            return f"step {step}: gradient norm {norm} vs {ref_norms[step]}"
    worst = 0.0
    for name, p in model.named_parameters():
        expected = p.placement.shard_of(ref_weights[name], grid)
        worst = max(worst, (p.detach().cpu() - expected).abs().max().item())
    if worst > 0.05 * LR:
        return f"weights differ by {worst / LR:.3g} lr"
    return f"ok (worst weight difference {worst / LR:.2e} lr)"


def worker(rank: int, port: int, grids: list[tuple[int, ...]], device_type: str, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    os.environ["LOCAL_RANK"] = "0"  # both ranks on cuda:0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out: dict = {"rank": rank}
    try:
        out["probe"] = probe(rank, dev)
        usable = all(out["probe"][k] == "ok" for k in ("all_reduce (async)", "all-gather"))
        out["equivalence"] = {}
        if usable:
            ref = reference_run()
            for sizes in grids:
                try:
                    out["equivalence"][str(sizes)] = equivalence(sizes, ref, device_type)
                except Exception as e:  # noqa: BLE001
                    out["equivalence"][str(sizes)] = "raised " + traceback.format_exc(limit=3)
                    print(e, file=sys.stderr)
    finally:
        queue.put(out)
    # Last, after the results are sent: on CUDA tensors gloo's TCP transport has failed here
    # with "writev: Bad address", once as an exception and once killing the process.
    for name, verdict in probe(rank, dev, point_to_point=True).items():
        print(f"gloo_cuda: rank {rank} probe {name}: {verdict}", flush=True)
    dist.destroy_process_group()


def report(r: dict) -> bool:
    """Print one rank's verdicts; True when any check failed."""
    failed = False
    for name, verdict in r["probe"].items():
        print(f"gloo_cuda: rank {r['rank']} probe {name}: {verdict}", flush=True)
        failed |= verdict != "ok"
    for grid, verdict in r["equivalence"].items():
        print(f"gloo_cuda: rank {r['rank']} grid {grid}: {verdict}", flush=True)
        failed |= not verdict.startswith("ok")
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grids", nargs="+", default=["2,1,1,1", "1,2,1,1", "1,1,2,1", "1,1,1,2"])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke test")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible: use --device cpu")
    grids = [parse_grid(g) for g in args.grids]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, port, grids, args.device, queue)) for r in range(2)
    ]
    for proc in procs:
        proc.start()
    failed = False
    for _ in procs:  # printed as they arrive: a rank may hang in the point-to-point probe
        try:
            failed |= report(queue.get(timeout=300))
        except queue_module.Empty:
            print("gloo_cuda: a rank gave no result within 300 s (hung or died)", flush=True)
            failed = True
            break
    for proc in procs:
        proc.join(timeout=15)
        if proc.is_alive():
            proc.kill()
    print("gloo_cuda: ok" if not failed else "gloo_cuda: some checks failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
