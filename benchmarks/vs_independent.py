"""tetrad against an independent stock baseline (issue 51): ``tetrad train`` as a user runs it
against a plain-PyTorch training script written apart from this project (the shared tools'
``torch_baseline.py``, given with ``--baseline``), same sizes, CPU, gloo, one thread per rank.

    python benchmarks/vs_independent.py rows ddp4 pp2 --repeats 4 --baseline PATH [--analogue]
    python benchmarks/vs_independent.py one-process --baseline PATH

``rows``: for each row, the two sides launched alternately in fresh processes (ABBA: every
other repeat in reverse order), ``--repeats`` times; per run the median step time of the
``--steps`` steps after 3 of warm-up (the baseline's own median; tetrad's ``step_time_s`` of
``metrics.jsonl``, ``--log-every 1``); printed: each side's median over the runs, their ratio
and the runs. The model: dim 256, 4 layers, 8 heads, 4 KV heads, ffn 768, vocabulary 4,096,
seq 256, global batch 16, fp32, AdamW (tetrad clips at 1.0, the baseline does not clip).

=========  =====================================  =========================================
row        baseline                               tetrad
=========  =====================================  =========================================
ddp2/ddp4  ``--mode ddp`` on 2/4 ranks            ``--grid 2,1,1,1`` / ``4,1,1,1``
pp2/pp4    ``--mode pp --pp-schedule 1f1b``, 8    ``--grid pipe=2`` / ``pipe=4``,
           micro-batches                          ``--pipeline-schedule 1f1b --micro-batch 2``
gpipe2     ``--pp-schedule gpipe``                ``--pipeline-schedule gpipe``
fsdp2      ``--mode fsdp2`` on 2 ranks            ``--grid 1,2,1,1`` (Z = 2)
tp2        ``--mode tp`` on 2 ranks               ``--grid 1,1,2,1`` (Y = 2)
=========  =====================================  =========================================

With ``--analogue`` the project's own stock analogue of each row (``benchmarks/vs_pytorch.py``'s
stock mode, :data:`ANALOGUES`, in fresh processes, the slowest rank's time per step, with no
barrier before a step: the other two sides have none) runs as a third side in the same
alternation, and the line adds tetrad over it and it over the baseline. It clips as tetrad
does: with ``--tetrad-args '--grad-clip 0'`` neither clips, which is the baseline's work (the
analogue then computes no norm either; tetrad still computes it for its metrics).

``one-process``: one rank's share of ``ddp4`` (batch 4 x 256) in one process and one thread,
by phase (forward with the loss, backward, clip at 1.0 and fused AdamW): the baseline's
``Llama``, the analogue's model (:class:`tetrad.models.reference.Llama`, full logits and
cross-entropy, the analogue's AdamW) and tetrad's ``ParallelLlama`` on the grid 1,1,1,1 (its
fused loss, the overlap's micro-batch calls, gradient sync and clip as ``train_step`` makes
them), alternated step by step, medians of ``--steps`` steps after 3, and each step over the
baseline's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"vocab": 4096, "hidden": 256, "ffn": 768, "layers": 4, "heads": 8, "kv-heads": 4}
SEQ, BATCH = 256, 16
ROWS = {
    "ddp2": (2, ["--mode", "ddp"], ["--grid", "2,1,1,1", "--micro-batch", "8"]),
    "ddp4": (4, ["--mode", "ddp"], ["--grid", "4,1,1,1", "--micro-batch", "4"]),
    "pp2": (2, ["--mode", "pp", "--pp-schedule", "1f1b"], ["--grid", "pipe=2,data=1"]),
    "pp4": (4, ["--mode", "pp", "--pp-schedule", "1f1b"], ["--grid", "pipe=4,data=1"]),
    "gpipe2": (2, ["--mode", "pp", "--pp-schedule", "gpipe"], ["--grid", "pipe=2,data=1"]),
    "fsdp2": (2, ["--mode", "fsdp2"], ["--grid", "1,2,1,1", "--micro-batch", "8"]),
    "tp2": (2, ["--mode", "tp"], ["--grid", "1,1,2,1", "--micro-batch", "16"]),
}
"""Row -> (ranks, the baseline's arguments, ``tetrad train``'s arguments)."""
PIPELINE = (["--microbatches", "8"], ["--micro-batch", "2"])
ANALOGUES = {
    "ddp2": {"kind": "ddp"},
    "ddp4": {"kind": "ddp"},
    "pp2": {"kind": "pp", "pp": 2, "schedule": "1f1b"},
    "pp4": {"kind": "pp", "pp": 4, "schedule": "1f1b"},
    "gpipe2": {"kind": "pp", "pp": 2, "schedule": "gpipe"},
    "fsdp2": {"kind": "fsdp2"},
    "tp2": {"kind": "tp", "tp": 2},
}
"""Row -> the project's own stock analogue in ``benchmarks/vs_pytorch.py`` (the arguments of its
``Stock`` mode: kind, tensor-parallel size, pipeline ranks, data ranks, schedule), run with
``--analogue``."""


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def baseline_run(baseline: Path, row: str, steps: int) -> float:
    """One run of the baseline's row: its median step seconds over ``steps`` steps after 3."""
    n, args, _ = ROWS[row]
    if "pp" in args:
        args = args + PIPELINE[0]
    sizes = [x for k, v in SIZES.items() for x in (f"--{k}", str(v))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n)]
    cmd += [str(baseline), *args, "--device", "cpu", *sizes, "--seq-len", str(SEQ)]
    cmd += ["--global-batch", str(BATCH), "--threads", "1", "--steps", str(steps), "--warmup", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tempfile.gettempdir())
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    # A pipeline run of the baseline sometimes aborts in torch's teardown after printing its
    # result ("terminate called without an active exception" on one rank): the result stands.
    if not lines:
        raise SystemExit(f"baseline {row} failed:\n{out.stderr[-4000:]}")
    return json.loads(lines[-1])["step_time_s_median"]


def tetrad_run(row: str, steps: int, extra: list[str]) -> float:
    """One run of ``tetrad train`` on the row's grid (``extra`` appended to its arguments): the
    median step seconds of the ``steps`` steps after 3."""
    _, _, args = ROWS[row]
    if args[1].startswith("pipe"):
        schedule = "gpipe" if row.startswith("gpipe") else "1f1b"
        args = args + PIPELINE[1] + ["--pipeline-schedule", schedule]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "tetrad.cli", "train", "--model", "small", *args]
        cmd += ["--global-batch", str(BATCH), "--seq-len", str(SEQ), "--steps", str(steps + 3)]
        cmd += ["--log-every", "1", "--val-every", "1000", "--run-dir", f"{tmp}/run"]
        cmd += ["--device", "cpu", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
        if out.returncode:
            raise SystemExit(f"tetrad {row} failed:\n{out.stderr[-2000:]}")
        rows = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
    return statistics.median(r["step_time_s"] for r in rows if r["step"] > 3)


def analogue_run(row: str, steps: int, grad_clip: float = 1.0) -> float:
    """One run of the project's stock analogue of ``row`` (:data:`ANALOGUES`), as
    ``benchmarks/vs_pytorch.py`` runs it (fresh processes, the slowest rank's time per step)
    but timed as the other two sides time their steps: no barrier before a step, each rank's
    clock running from its previous step's end. It clips at ``grad_clip`` as tetrad does (0:
    no clipping and no norm). Returns the median step seconds of the ``steps`` steps after 3."""
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
    from stock_parallel import Stock
    from vs_jobs import Job
    from vs_pytorch import spawn
    from vs_settings import Settings

    from tetrad.spec.presets import parse_model

    cfg = parse_model("small")[0]
    settings = Settings(cfg, SEQ, BATCH, steps + 3, 3, grad_clip=grad_clip, step_barrier=False)
    job = Job(ROWS[row][0], settings, stock=Stock(**ANALOGUES[row]))
    result = spawn(job)
    if "error" in result:
        raise SystemExit(f"analogue {row} failed: {result['error']}")
    return statistics.median(result["times"][3:])


def grad_clip_of(tetrad_args: list[str]) -> float:
    """The ``--grad-clip`` among ``tetrad train`` arguments (the analogue clips alike), else
    tetrad's default, 1.0."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--grad-clip", type=float, default=1.0)
    return p.parse_known_args(tetrad_args)[0].grad_clip


def compare_rows(
    baseline: Path,
    rows: list[str],
    repeats: int,
    steps: int,
    extra: list[str],
    analogue: bool = False,
) -> None:
    """The ``rows`` command (module doc); with ``analogue`` the project's stock analogue runs
    as a third side, in the same alternation."""
    clip = grad_clip_of(extra)
    for row in rows:
        sides = [
            ("baseline", lambda r=row: baseline_run(baseline, r, steps)),
            ("tetrad", lambda r=row: tetrad_run(r, steps, extra)),
        ]
        if analogue:
            sides.append(("analogue", lambda r=row: analogue_run(r, steps, clip)))
        times: dict[str, list[float]] = {name: [] for name, _ in sides}
        for i in range(repeats):
            for name, run in sides if i % 2 == 0 else sides[::-1]:
                times[name].append(run())
        med = {k: statistics.median(v) for k, v in times.items()}
        b, t = med["baseline"], med["tetrad"]
        line = f"{row}: baseline {b:.4f} s, tetrad {t:.4f} s, ratio {t / b:.3f}"
        if analogue:
            a = med["analogue"]
            line += (
                f"; analogue {a:.4f} s, tetrad/analogue {t / a:.3f}, analogue/baseline {a / b:.3f}"
            )
        runs = {k: [round(x, 3) for x in v] for k, v in times.items()}
        print(f"{line}  runs {runs}", flush=True)


def one_process(baseline: Path, steps: int) -> None:
    """The ``one-process`` command (module doc)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("torch_baseline", baseline)
    tb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tb)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29611"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
    from stock_parallel import stock_optimizer
    from vs_settings import Settings

    from tetrad.grid import Grid
    from tetrad.models.reference import Llama
    from tetrad.parallel import init_parameters
    from tetrad.parallel.grads import clip_grad_norm, sync_gradients
    from tetrad.parallel.model import ParallelLlama
    from tetrad.spec.presets import PRESETS
    from tetrad.train.step import build_optimizer

    cfg, grid = PRESETS["small"], Grid.build((1, 1, 1, 1))
    model = ParallelLlama(cfg, grid, "none")
    init_parameters(model, 0, grid)
    opt = build_optimizer(model, 1e-3, 0.1)
    reference = Llama(cfg, device="cpu")
    init_parameters(reference, 0)
    ref_opt = stock_optimizer(reference, Settings(cfg, lr=1e-3))
    sizes = argparse.Namespace(
        **{k.replace("-", "_"): v for k, v in SIZES.items()}, rope_theta=10000.0
    )
    torch.manual_seed(0)
    stock = tb.Llama(sizes)
    stock_opt = torch.optim.AdamW(stock.parameters(), lr=1e-3, fused=True)

    def update(module, optimizer) -> None:
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def tetrad_forward(tokens, targets):
        model.overlap.begin_micro_batch(last=True)
        return model.loss_sum(tokens, targets) / targets.numel()

    def tetrad_update():  # what train_step does after its one micro-batch's backward
        model.overlap.end_micro_batch()
        sync_gradients(model, grid, model.overlap.buckets.reduced)
        clip_grad_norm(model, grid, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    sides = {  # name -> (forward with the loss, update)
        "baseline": (
            lambda x, y: F.cross_entropy(stock(x).flatten(0, 1).float(), y.flatten()),
            lambda: update(stock, stock_opt),
        ),
        "analogue": (
            lambda x, y: (
                F.cross_entropy(reference(x).flatten(0, 1), y.flatten(), reduction="sum")
                / y.numel()
            ),
            lambda: update(reference, ref_opt),
        ),
        "tetrad": (tetrad_forward, tetrad_update),
    }
    phases: dict[str, list[list[float]]] = {k: [] for k in sides}
    gen = torch.Generator().manual_seed(1)
    for i in range(steps + 3):
        batch = torch.randint(0, SIZES["vocab"], (4, SEQ + 1), generator=gen)
        tokens, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        for name, (forward, step) in sides.items() if i % 2 else list(sides.items())[::-1]:
            t0 = time.perf_counter()
            loss = forward(tokens, targets)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            step()
            t3 = time.perf_counter()
            if i >= 3:
                phases[name].append([t1 - t0, t2 - t1, t3 - t2, t3 - t0])
    print("one process, ms (medians): side, forward (with the loss), backward, clip + AdamW, step")
    base = statistics.median(p[3] for p in phases["baseline"])
    for name, rows in phases.items():
        med = [statistics.median(r[j] for r in rows) for j in range(4)]
        cells = ", ".join(f"{m * 1e3:.1f}" for m in med)
        print(f"{name}: {cells}, ratio {med[3] / base:.3f}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["rows", "one-process"])
    p.add_argument("rows", nargs="*", default=["ddp4", "pp2"], help=f"of {', '.join(ROWS)}")
    p.add_argument("--baseline", type=Path, default=ROOT.parent / "shared/tools/torch_baseline.py")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--steps", type=int, default=14, help="timed steps per run, after 3")
    p.add_argument(
        "--tetrad-args",
        default="",
        help="more `tetrad train` arguments for rows, e.g. '--grad-clip 0' (the baseline "
        "does not clip)",
    )
    p.add_argument(
        "--analogue",
        action="store_true",
        help="rows: also run the project's stock analogue (benchmarks/vs_pytorch.py's) as a "
        "third side",
    )
    a = p.parse_args(argv)
    if not a.baseline.is_file():
        p.error(f"--baseline {a.baseline} is not a file: give the baseline script's path")
    if a.command == "rows":
        unknown = [r for r in a.rows if r not in ROWS]
        if unknown:
            p.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
        compare_rows(a.baseline, a.rows, a.repeats, a.steps, a.tetrad_args.split(), a.analogue)
    else:
        one_process(a.baseline, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
