"""One-GPU acceptance check of tetrad: equivalence, throughput, memory and step-time prediction.

On a machine with one GPU (about 5 minutes, at most 10; tetrad run from the checkout)::

    PYTHONPATH=. python benchmarks/gpu_check.py [--out runs/gpu_check] [--steps 20]

On CPU, as a smoke test with tiny sizes (about a minute; ``tests/test_gpu_check.py`` runs it)::

    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check

(a) **Equivalence**, in this process on a world-size-1 process group (NCCL on CUDA, gloo on
    CPU) and the grid 1,1,1,1. Each 3D-parallel layer (Linear with and without transpose and
    bias, Embedding, RMSNorm, the vocabulary-parallel cross-entropy) against its ``torch.nn``
    equivalent (output, input gradient, parameter gradients), in fp32 and under bf16 autocast.
    Then ``ParallelLlama`` against the single-process reference Llama with the same weights
    (``init_parameters`` of one seed) after one forward and backward, eager and with
    ``compile_blocks`` (torch.compile per block): mode ``fp32`` (no autocast) and mode
    ``trainer`` (``tetrad.train.step.train_step`` as the trainer runs it, two micro-batches:
    bf16 autocast on CUDA, fp32 on CPU), both against the fp32 reference. Errors: the relative
    error of the loss (nats per token) and the relative norm ``||a - b|| / ||b||`` of every
    output and gradient, the worst parameter counted. Tolerances
    (``gpu.equivalence.TOLERANCES``): fp32 loss 1e-5, tensors 1e-4; bf16 (about 3 significant
    digits) loss 2e-2, tensors 5e-2. Then a resume (:mod:`gpu.resume`): one training step of
    the check model, a checkpoint, a fresh model and optimizer loaded from it, the second
    step's loss and weights against the uninterrupted run's, with fp32 and with bf16 weights.
(b) **Training**: ``python -m tetrad.cli train`` of ``--model`` (CUDA: ``llama-1b``, bf16, seq
    2048) for ``--steps`` steps, eager and ``--compile``; the micro-batch is the largest of
    1, 2, 4, 8, 16 that ``tetrad memory --method tetrad`` predicts to fit (<= 80% of this GPU's
    memory), the global batch two micro-batches. From ``RUN_DIR/metrics.jsonl``: medians of
    tokens/s, MFU (against the datasheet bf16 peak on CUDA) and step time over the steps after
    the first logging interval (it holds torch.compile's compilation), and the peak memory
    (``torch.cuda.max_memory_allocated``). Steps 17-18 run under ``--profile-steps``; the
    report adds each run's device time by kernel category (:mod:`tetrad.train.trace`). Each
    run's whole output is kept in ``OUT/train_<variant>.log``; its checkpoints and trace are
    deleted.
(c) **Memory**: the planner's predicted peak (``tetrad memory``) against the measured one.
(d) **Step time**: ``tetrad calibrate --quick`` writes a machine file (it needs two ranks, so on
    a one-GPU machine it fails and the machine preset stands in: said in the output); the
    planner's predicted step time (``tetrad.plan.step_time``) on the calibrated machine, on
    the preset with this device's compute measured in-process
    (``tetrad.calibrate.measure.measure_compute``, the quick set) and on the bare preset,
    against the measured median step time.
(e) ``OUT/gpu_check.json`` (every figure), ``OUT/gpu_check.md`` (the table, also printed).

Exit status 0 when every check passed and every part ran; 1 otherwise. Standard library, torch
and tetrad only.

This script holds the options and the order of the parts; each part lives in the package
``benchmarks/gpu/`` (:mod:`gpu.equivalence` and :mod:`gpu.resume` (a), :mod:`gpu.training`
(b), :mod:`gpu.memory` (c), :mod:`gpu.steptime` (d), :mod:`gpu.report` (e); :mod:`gpu.profiles`
the sizes per device, :mod:`gpu.common` what they share).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tetrad
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the package gpu/, also when imported

import torch  # noqa: E402
from gpu.common import GRID, guarded, say, timed, world_of_one  # noqa: E402
from gpu.equivalence import equivalence_part  # noqa: E402
from gpu.memory import choose_micro_batch, device_memory_bytes, memory_part  # noqa: E402
from gpu.profiles import PROFILES, Profile  # noqa: E402
from gpu.report import fmt_gib, markdown, problems_of  # noqa: E402
from gpu.steptime import calibrate_part, measure_compute_figures, planner_part  # noqa: E402
from gpu.training import training_part  # noqa: E402

from tetrad.device import cpu_cores, device_name  # noqa: E402


def in_process_part(args: argparse.Namespace, prof: Profile, errors: dict[str, str]) -> dict:
    """Part (a) and the in-process compute measurement of part (d), in one world-of-one group;
    frees the device memory afterwards. Keys ``equivalence`` and ``compute_figures`` (None
    when that part raised)."""
    out: dict = {}
    torch.set_float32_matmul_precision("highest")  # fp32 checks: no TF32
    with world_of_one(args.device) as grid:
        if not args.skip_equivalence:
            out["equivalence"] = guarded(
                errors, "equivalence", lambda: equivalence_part(grid, prof)
            )
        say("(d) measuring this device's compute in-process (calibrate's quick set)")
        out["compute_figures"] = guarded(
            errors, "compute measurement", lambda: measure_compute_figures(grid.device)
        )
    torch._dynamo.reset()  # drop the compiled blocks and their caches
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options; the per-device defaults come from :data:`PROFILES`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default="runs/gpu_check", help="output folder")
    p.add_argument("--model", help="tetrad train --model (cuda: llama-1b,vocab_size=32768)")
    p.add_argument("--steps", type=int, help="training steps per run (default 20)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (cuda: 2048)")
    p.add_argument("--micro-batch", type=int, help="skip the choice by the memory planner")
    p.add_argument("--skip-train", action="store_true", help="no training runs")
    p.add_argument("--skip-equivalence", action="store_true", help="no equivalence checks")
    args = p.parse_args(argv)
    prof = PROFILES[args.device]
    args.model = args.model or prof.model
    args.steps = args.steps or prof.steps
    args.seq_len = args.seq_len or prof.seq_len
    args.out = str(Path(args.out).resolve())  # the training runs start in the checkout
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible: use --device cpu")
    return args


def environment(args: argparse.Namespace, started: str) -> dict:
    """The device, its name, the versions of torch, CUDA and Python, the CPU cores, the command
    line and the start time (ISO 8601, UTC)."""
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    return {
        "device": args.device,
        "device_name": device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_cores": cpu_cores(),
        "argv": sys.argv,
        "started": started,
    }


def run_all(args: argparse.Namespace, prof: Profile, deadline: float) -> dict:
    """Parts (a) to (d); the result without the environment. ``timings``: seconds per part;
    ``errors``: the parts that raised (part -> the end of the traceback)."""
    result: dict = {"settings": {"model": args.model, "seq_len": args.seq_len}}
    result["settings"] |= {"steps": args.steps, "log_every": prof.log_every, "grid": GRID}
    timings: dict[str, float] = {}
    errors: dict[str, str] = {}
    result |= {"timings": timings, "errors": errors}
    with timed(timings, "equivalence_and_compute_measurement_s"):
        result |= in_process_part(args, prof, errors)
    gpu_bytes = device_memory_bytes(args.device)
    choice = guarded(
        errors, "micro-batch choice", lambda: choose_micro_batch(args, prof, gpu_bytes)
    )
    if choice is None:
        return result
    result["micro_batch_choice"] = {
        "chosen": choice["chosen"],
        "given": choice["given"],
        "predicted_bytes": {mb: e["total_bytes"] for mb, e in choice["by_micro_batch"].items()},
        "fits": {mb: e["fits"] for mb, e in choice["by_micro_batch"].items()},
    }
    say(f"(b) micro-batch {choice['chosen']} (memory planner, {fmt_gib(gpu_bytes)} device)")
    training = None
    if not args.skip_train:
        with timed(timings, "training_s"):
            training = guarded(
                errors, "training", lambda: training_part(args, prof, choice["chosen"], deadline)
            )
    result["training"] = training
    result["memory"] = memory_part(choice, training, gpu_bytes)
    mb = training["micro_batch"] if training else choice["chosen"]
    with timed(timings, "calibrate_s"):
        calib = calibrate_part(args, deadline)
    figures = result.get("compute_figures")
    result["planner"] = guarded(
        errors, "planner", lambda: planner_part(args, calib, figures, mb, training)
    )
    return result


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the check; write ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` and print the
    table. Returns 0 when everything passed and ran.

    SIGTERM (``timeout``'s signal) raises ``SystemExit(143)``, so that a training run in
    progress is killed with its workers on the way out (:func:`gpu.common.run_logged`)."""
    signal.signal(signal.SIGTERM, _terminate)
    args = parse_args(argv)
    prof = PROFILES[args.device]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    result = run_all(args, prof, t0 + prof.budget_s)
    result["environment"] = environment(args, started) | {"wall_s": time.monotonic() - t0}
    result["problems"] = problems_of(result)
    result["skipped"] = [k for k in ("train", "equivalence") if getattr(args, f"skip_{k}")]
    result["ok"] = not result["problems"]
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    table = markdown(result)
    (out / "gpu_check.md").write_text(table)
    print(table, flush=True)
    say(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
