"""tetrad against Hugging Face transformers' ``LlamaForCausalLM``: the same sizes, batch,
optimizer and device, in one run.

On one GPU (about 4 minutes on an H100 or H200, torch.compile included)::

    PYTHONPATH=. python benchmarks/vs_transformers.py [--out runs/vs_transformers]
        [--model llama-1b,vocab_size=32768] [--shapes 2048x16,4096x8]
        [--variants eager,compiled] [--steps 6] [--warmup 2] [--rounds 2] [--budget-s 225]

On CPU, as a smoke test with tiny sizes (``tests/test_vs_transformers.py`` runs it)::

    python benchmarks/vs_transformers.py --device cpu --out /tmp/vs_transformers

Both sides train the model of ``--model`` (a ``tetrad train --model`` text; CUDA default
``llama-1b,vocab_size=32768``, CPU ``tiny``):

- **tetrad**: ``ParallelLlama`` on the grid 1,1,1,1 of a world of one (NCCL on CUDA, gloo on
  CPU), stepped by :func:`tetrad.train.step.train_step`, as ``benchmarks/gpu_memory.py`` and
  ``tetrad train --grid 1,1,1,1`` run it.
- **hf**: ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` of the same sizes
  (hidden, intermediate, heads, KV heads, layers, vocabulary, RoPE base, RMSNorm epsilon, untied
  embeddings; ``vs_hf.llama.hf_config``, checked back by ``config_mismatches``) with
  ``attn_implementation="sdpa"``, stepped by ``vs_hf.llama.hf_train_step``: per micro-batch the
  logits of ``model(input_ids)``, the summed token cross-entropy in fp32 over the global
  batch's token count, backward; then gradient clipping and the optimizer step, as tetrad's
  step does.

The same on both sides: the global batch ``[2 x micro-batch, seq + 1]`` of random token ids in
two micro-batches (gradient accumulation), moved to the device in each step as
:func:`tetrad.parallel.batch.to_device` moves it; AdamW from
:func:`tetrad.train.step.build_optimizer` (torch's fused kernel, lr 3e-4, betas (0.9, 0.95), eps
1e-8, weight decay 0.1 on matrices only); gradient clipping at 1.0; weights drawn on the device
(normal, std 0.02, norms 1: only the values differ from either side's own initialisation);
:func:`tetrad.dtypes.autocast` (on CUDA bf16 autocast with attention restricted to the
flash kernels, FlashAttention-2's or cuDNN's; fp32 on CPU). Variant ``compiled``:
``torch.compile`` on every decoder layer, tetrad's :func:`tetrad.parallel.model.compile_blocks`
(what ``tetrad train --compile`` does) and ``layer.compile()`` on each of
``model.model.layers`` for HF; torch.compile's caches are reset between shapes, so each shape
compiles static shapes, as its own training run would.

Measurement, per shape and variant: ``--rounds`` rounds, the two sides interleaved in ABBA
order (tetrad then HF, then HF then tetrad, ...). Each round builds the side's model (after the
other's is freed: ``del``, ``gc.collect()``, ``torch.cuda.empty_cache()``, peak statistics
reset), runs ``--warmup`` steps (torch.compile compiles in the first; the first also allocates
AdamW's states), times ``--steps`` steps (CUDA events between steps, no host synchronisation in
between; ``time.perf_counter`` on CPU) and frees it. Per side: the median step (seconds) of each
round and over every timed step of every round; tokens/s = ``2 x micro-batch x seq`` / median
step; MFU by tetrad's count (:meth:`tetrad.spec.model.ModelSpec.flops_per_token` x tokens/s
/ :func:`tetrad.device.datasheet_flops`, the datasheet dense bf16 peak; None on CPU); the peak
memory (``torch.cuda.max_memory_allocated``, bytes, weights and optimizer states included; None
on CPU); and the time ratio tetrad/HF of the median steps (below 1: tetrad is faster). A
round that would start more than ``--budget-s`` seconds after the start is skipped, with a line.

Budget: the CUDA defaults run 16 rounds of 8 steps (about 10 s each for llama-1b) plus four
compilations per layer (each model at each shape; about 40-60 s each on a cold cache), so the
whole run can outgrow the 225 s budget; the rounds are ordered (shapes, then variants, as given)
so that what is cut is the last shape's compiled rounds. ``--shapes``, ``--variants`` and
``--rounds`` narrow it.

Writes ``OUT/vs_transformers.json`` (every figure, rewritten after each round, so a run cut
short keeps what it measured) and ``OUT/vs_transformers.md`` (the table, also printed). Exit
status 0 when every round ran and the parameter counts are equal, 1 otherwise, 2 when
transformers is not installed. Standard library, torch, tetrad and transformers only.

This script holds the options and the order of the rounds; the package ``benchmarks/vs_hf/``
holds the HF side (:mod:`vs_hf.llama`), one round of either side (:mod:`vs_hf.rounds`) and the
report (:mod:`vs_hf.report`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tetrad
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the packages gpu/ and vs_hf/

import torch  # noqa: E402
from gpu.common import world_of_one  # noqa: E402
from vs_hf.llama import config_mismatches, probe_hf_attention  # noqa: E402
from vs_hf.report import markdown, problems_of, round_line  # noqa: E402
from vs_hf.rounds import (  # noqa: E402
    GRAD_CLIP,
    LR,
    SIDES,
    WEIGHT_DECAY,
    Shape,
    build_side,
    free_memory,
    guarded_round,
    n_params,
    side_summary,
)

from tetrad.device import device_name  # noqa: E402
from tetrad.grid import Grid  # noqa: E402
from tetrad.spec.model import ModelSpec
from tetrad.spec.presets import parse_model


@dataclass(frozen=True)
class Defaults:
    """Per device: the model, shapes and step counts of the run (``budget_s``: seconds after
    which the remaining rounds are skipped, each with a line)."""

    model: str
    shapes: str
    steps: int
    warmup: int
    rounds: int
    budget_s: float


DEFAULTS = {
    "cuda": Defaults("llama-1b,vocab_size=32768", "2048x16,4096x8", 6, 2, 2, 225.0),
    "cpu": Defaults("tiny", "64x2", 2, 1, 1, 120.0),
}
"""CUDA: the comparison. CPU: a smoke test of every code path with tiny sizes."""


def say(msg: str) -> None:
    """One progress line on stdout."""
    print(f"vs_transformers: {msg}", flush=True)


def parse_shapes(text: str) -> list[Shape]:
    """``2048x16,4096x8`` -> shapes (seq x micro-batch)."""
    out = []
    for part in text.split(","):
        seq, _, mb = part.strip().partition("x")
        out.append(Shape(int(seq), int(mb)))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options; the per-device defaults come from :data:`DEFAULTS`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default="runs/vs_transformers", help="output folder")
    p.add_argument("--model", help="tetrad train --model (cuda: llama-1b,vocab_size=32768)")
    p.add_argument("--shapes", help="seq x micro-batch, comma-separated (cuda: 2048x16,4096x8)")
    p.add_argument("--variants", default="eager,compiled", help="eager, compiled")
    p.add_argument("--steps", type=int, help="timed steps per round (cuda: 6)")
    p.add_argument("--warmup", type=int, help="untimed steps per round, at least 1 (cuda: 2)")
    p.add_argument("--rounds", type=int, help="rounds per shape and variant (cuda: 2)")
    p.add_argument(
        "--budget-s", type=float, help="skip the rounds that would start after this (cuda: 225 s)"
    )
    args = p.parse_args(argv)
    d = DEFAULTS[args.device]
    args.model = args.model or d.model
    args.shapes = parse_shapes(args.shapes or d.shapes)
    args.variants = [v.strip() for v in args.variants.split(",")]
    if not set(args.variants) <= {"eager", "compiled"}:
        p.error(f"--variants {','.join(args.variants)}: choose from eager, compiled")
    args.steps = args.steps or d.steps
    args.warmup = max(1, args.warmup or d.warmup)
    args.rounds = args.rounds or d.rounds
    args.budget_s = args.budget_s or d.budget_s
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible: use --device cpu")
    return args


def environment(args: argparse.Namespace, device: torch.device, started: str) -> dict:
    """The device, its name, the versions of torch, CUDA, transformers and Python, the command
    line and the start time (ISO 8601, UTC)."""
    import transformers

    return {
        "device": args.device,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "argv": sys.argv,
        "started": started,
    }


def settings(args: argparse.Namespace, device: torch.device) -> dict:
    """What both sides share: model, shapes, variants, steps, optimizer, precision."""
    return {
        "model": args.model,
        "shapes": [str(s) for s in args.shapes],
        "variants": args.variants,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "lr": LR,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": WEIGHT_DECAY,
        "grad_clip": GRAD_CLIP,
        "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
    }


def count_parameters(cfg: ModelSpec, grid: Grid, seq: int) -> dict:
    """Both models' parameter counts (each built uncompiled, then freed), the HF config's
    mismatches and how HF calls SDPA (:func:`probe_hf_attention`)."""
    model, step = build_side("tetrad", cfg, Shape(seq, 1), grid, False)
    ours = n_params(model)
    del model, step
    free_memory(grid.device)
    model, step = build_side("hf", cfg, Shape(seq, 1), grid, False)
    out = {
        "tetrad_params": ours,
        "hf_params": n_params(model),
        "config_params": cfg.num_params(),
        "config_mismatches": config_mismatches(cfg, model.config),
        "hf_attn_implementation": model.config._attn_implementation,
        "hf_sdpa": probe_hf_attention(model, cfg.vocab_size, min(seq, 128), grid.device),
    }
    del model, step
    free_memory(grid.device)
    return out


def compare(
    args: argparse.Namespace,
    cfg: ModelSpec,
    grid: Grid,
    shape: Shape,
    variant: str,
    result: dict,
    save: Callable[[], object],
    deadline: float,
) -> None:
    """The rounds of one shape and variant, the sides in ABBA order, into a new record of
    ``result["results"]``, saved (``save()``) after each round; a round that would start after
    ``deadline`` (``time.monotonic()``) is skipped with a line."""
    rec: dict = {"shape": str(shape), "seq": shape.seq, "micro_batch": shape.micro_batch}
    rec |= {"global_batch": shape.global_batch, "variant": variant, "time_ratio": None}
    result["results"].append(rec)
    rounds: dict[str, list[dict]] = {side: [] for side in SIDES}
    for side in SIDES:
        rec[side] = side_summary(rounds[side], cfg, shape, grid.device)
    for i in range(args.rounds):
        what = f"{shape} {variant} round {i + 1}"
        if time.monotonic() > deadline:
            result["skipped"].append(f"{what} (the {args.budget_s:.0f} s budget)")
            say(f"{what}: skipped, the {args.budget_s:.0f} s budget is spent")
            continue
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            rd = guarded_round(side, cfg, shape, grid, variant == "compiled", args)
            rounds[side].append(rd)
            rec[side] = side_summary(rounds[side], cfg, shape, grid.device)
            say(f"{what} {side}: {round_line(rd, shape)}")
        t, h = rec["tetrad"], rec["hf"]
        if "error" not in t and "error" not in h:
            rec["time_ratio"] = t["median_step_s"] / h["median_step_s"]
        save()
    if rec["time_ratio"] is not None:
        say(f"{shape} {variant}: time ratio tetrad/HF {rec['time_ratio']:.3f}")


def write(out: Path, result: dict) -> str:
    """Write the JSON and the Markdown report; return the Markdown."""
    result["problems"] = problems_of(result)
    (out / "vs_transformers.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "vs_transformers.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; write ``vs_transformers.json`` and ``vs_transformers.md`` into
    ``--out`` and print the table. Returns 0 when everything ran and matched, 1 otherwise, 2
    without transformers."""
    t0 = time.monotonic()
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            "vs_transformers: transformers is not installed (pip install transformers): "
            "nothing to compare against",
            flush=True,
        )
        return 2
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, _ = parse_model(args.model)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with world_of_one(args.device) as grid:
        result: dict = {
            "environment": environment(args, grid.device, started),
            "settings": settings(args, grid.device),
            "results": [],
            "skipped": [],
        }

        def save() -> str:
            result["wall_s"] = time.monotonic() - t0
            return write(out, result)

        result["models"] = m = count_parameters(cfg, grid, args.shapes[0].seq)
        say(
            f"{args.model}: tetrad {m['tetrad_params']:,} parameters, HF {m['hf_params']:,} "
            f"(config {m['config_params']:,}); HF attention {m['hf_attn_implementation']}, "
            f"SDPA call {m['hf_sdpa']}"
            + (f"; config mismatches: {m['config_mismatches']}" if m["config_mismatches"] else "")
        )
        for shape in args.shapes:
            torch._dynamo.reset()  # each shape compiles its own static graphs
            for variant in args.variants:
                compare(args, cfg, grid, shape, variant, result, save, t0 + args.budget_s)
    text = save()
    print(text, flush=True)
    say(f"wrote {out / 'vs_transformers.json'} and {out / 'vs_transformers.md'}")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
