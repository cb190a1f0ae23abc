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
  embeddings; ``hf_llama.hf_config``, checked back by ``hf_llama.config_mismatches``) with
  ``attn_implementation="sdpa"``, stepped by ``hf_llama.hf_train_step``: per micro-batch the logits
  of ``model(input_ids)``, the summed token cross-entropy in fp32 over the global batch's token
  count, backward; then gradient clipping and the optimizer step, as tetrad's step does.

The same on both sides: the global batch ``[2 x micro-batch, seq + 1]`` of random token ids in
two micro-batches (gradient accumulation), moved to the device in each step as
:func:`tetrad.train.step.to_device` moves it; AdamW from
:func:`tetrad.train.step.build_optimizer` (torch's fused kernel, lr 3e-4, betas (0.9, 0.95), eps
1e-8, weight decay 0.1 on matrices only); gradient clipping at 1.0; weights drawn on the device
(normal, std 0.02, norms 1: only the values differ from either side's own initialisation);
:func:`tetrad.train.step.autocast` (on CUDA bf16 autocast with attention restricted to the
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
step; MFU by tetrad's count (:meth:`tetrad.models.config.ModelConfig.flops_per_token` x tokens/s
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
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tetrad
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu/, hf_llama

import torch  # noqa: E402
from gpu.common import world_of_one  # noqa: E402
from hf_llama import (  # noqa: E402
    build_hf,
    compile_layers,
    config_mismatches,
    hf_train_step,
    probe_hf_attention,
)
from torch import nn  # noqa: E402

from tetrad.device import datasheet_flops, device_name  # noqa: E402
from tetrad.grid import Grid  # noqa: E402
from tetrad.models.config import ModelConfig, parse_model  # noqa: E402
from tetrad.parallel.model import ParallelLlama, compile_blocks  # noqa: E402
from tetrad.spec import GiB  # noqa: E402
from tetrad.train.step import build_optimizer, train_step  # noqa: E402

LR = 3e-4
"""The learning rate of both sides' AdamW (``tetrad train``'s default peak)."""
WEIGHT_DECAY = 0.1
"""AdamW's weight decay, on matrices only (:func:`tetrad.train.step.build_optimizer`)."""
GRAD_CLIP = 1.0
"""The global gradient norm both sides clip to."""
SEED = 0
"""The seed of the batch (token ids)."""
SIDES = ("tetrad", "hf")


@dataclass(frozen=True)
class Shape:
    """One batch shape: ``seq`` tokens per sample, ``micro_batch`` samples per micro-batch; the
    global batch is two micro-batches."""

    seq: int
    micro_batch: int

    @property
    def global_batch(self) -> int:
        return 2 * self.micro_batch

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.global_batch * self.seq

    def __str__(self) -> str:
        return f"{self.seq}x{self.micro_batch}"


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


# ---- the models (HF's: hf_llama.py) ------------------------------------------------------------


def draw_weights(model: nn.Module) -> None:
    """Matrices normal with std 0.02, vectors (the RMSNorm weights) 1, drawn on their device
    (``init_parameters`` draws on the host, about 30 s per 1e9 parameters)."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)


def n_params(model: nn.Module) -> int:
    """The model's parameter elements (on the grid 1,1,1,1 tetrad's shards are whole)."""
    return sum(p.numel() for p in model.parameters())


# ---- measuring ---------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Collect garbage, return the cached blocks and reset the peak statistics."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def step_times(
    step: Callable[[], torch.Tensor], n: int, device: torch.device
) -> tuple[list[float], torch.Tensor]:
    """Run ``step`` ``n`` times: the seconds of each and the last step's loss. On CUDA the
    seconds come from events recorded between the steps (the host is not synchronised between
    them); on CPU from ``time.perf_counter``."""
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            loss = step()
            events[i + 1].record()
        events[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:], strict=False)], loss
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        loss = step()
        out.append(time.perf_counter() - t0)
    return out, loss


def build_side(
    side: str, cfg: ModelConfig, shape: Shape, grid: Grid, compiled: bool
) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The model of ``side`` (``tetrad`` or ``hf``) and its step function ``step() -> loss``
    (a 0-dim tensor, not read) on the global batch of ``shape`` (token ids ``[2 x micro-batch,
    seq + 1]``, the same batch every step). Drop both references to free the model."""
    batch = torch.randint(
        0,
        cfg.vocab_size,
        (shape.global_batch, shape.seq + 1),
        generator=torch.Generator().manual_seed(SEED),
    )
    if side == "tetrad":
        model = ParallelLlama(cfg, grid)  # no recompute
    else:
        model = build_hf(cfg, shape.seq, grid.device)
    draw_weights(model)
    if compiled:
        compile_blocks(model) if side == "tetrad" else compile_layers(model)
    opt = build_optimizer(model, LR, WEIGHT_DECAY)

    def step() -> torch.Tensor:
        if side == "tetrad":
            return train_step(model, opt, grid, batch, shape.micro_batch, GRAD_CLIP)[0]
        return hf_train_step(model, opt, batch, shape.micro_batch, grid.device, GRAD_CLIP)

    return model, step


def allocated_bytes(device: torch.device) -> int | None:
    """Bytes allocated on the GPU now (None on CPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def run_round(
    side: str, cfg: ModelConfig, shape: Shape, grid: Grid, compiled: bool, args: argparse.Namespace
) -> dict:
    """Build ``side``'s model, warm up, time ``args.steps`` steps, free it: seconds of the
    build, the warm-up and each timed step, the first and last losses (nats per token), the
    peak memory (bytes, from before the build; None on CPU) and the bytes allocated before the
    build (0 unless something of the previous round survived)."""
    device = grid.device
    free_memory(device)
    start = allocated_bytes(device)
    t0 = time.perf_counter()
    model, step = build_side(side, cfg, shape, grid, compiled)
    try:
        build_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        first = float(step())
        for _ in range(args.warmup - 1):
            step()
        sync(device)
        warmup_s = time.perf_counter() - t1
        times, loss = step_times(step, args.steps, device)
        last = float(loss)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finally:
        del model, step
        free_memory(device)
    return {
        "build_s": build_s,
        "warmup_s": warmup_s,
        "step_s": times,
        "median_step_s": statistics.median(times),
        "loss_first": first,
        "loss_last": last,
        "peak_memory_bytes": peak,
        "start_allocated_bytes": start,
    }


def side_summary(rounds: list[dict], cfg: ModelConfig, shape: Shape, device: torch.device) -> dict:
    """The rounds of one side pooled: the median step over every timed step (seconds), the
    per-round medians, tokens/s, MFU (fraction; None without a datasheet peak), the peak memory
    (the largest of the rounds, bytes)."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"rounds": rounds, "error": rounds[-1]["error"] if rounds else "not run"}
    median = statistics.median(t for r in ok for t in r["step_s"])
    tokens_per_s = shape.tokens / median
    peak_flops = datasheet_flops(device)
    peaks = [r["peak_memory_bytes"] for r in ok if r["peak_memory_bytes"] is not None]
    return {
        "median_step_s": median,
        "round_medians_s": [r["median_step_s"] for r in ok],
        "tokens_per_s": tokens_per_s,
        "mfu": cfg.flops_per_token(shape.seq) * tokens_per_s / peak_flops if peak_flops else None,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "rounds": rounds,
    }


def guarded_round(
    side: str, cfg: ModelConfig, shape: Shape, grid: Grid, compiled: bool, args: argparse.Namespace
) -> dict:
    """:func:`run_round`, or ``{"error": ...}`` when it raised (out of memory included); the
    run goes on with the next round."""
    try:
        return run_round(side, cfg, shape, grid, compiled, args)
    except Exception as e:  # one failing round must not hide the others
        tail = "".join(traceback.format_exception(e)[-2:]).strip().splitlines()
        kind = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
        error = f"{kind}: {tail[-1][:300] if tail else e!r}"
    free_memory(grid.device)  # here: the exception's frames no longer hold the model
    return {"error": error}


# ---- report ------------------------------------------------------------------------------------


def _gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / GiB:.2f} GiB"


def markdown(result: dict) -> str:
    """The Markdown report: a header, then one row per (shape, variant, side) with the time
    ratio tetrad/HF on tetrad's row."""
    env, m = result["environment"], result["models"]
    head = (
        f"# tetrad vs transformers: {env['device_name']} ({env['device']})\n\n"
        f"torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}, "
        f"{env['started']}, {result.get('wall_s', 0):.0f} s. Model {result['settings']['model']}: "
        f"{m['tetrad_params']:,} parameters in tetrad, {m['hf_params']:,} in HF"
        f"{'' if m['tetrad_params'] == m['hf_params'] else ' (NOT EQUAL)'}; HF SDPA call: "
        f"{m.get('hf_sdpa')}. {result['settings']['rounds']} rounds x "
        f"{result['settings']['steps']} timed steps after {result['settings']['warmup']} "
        "warm-up, medians.\n\n"
    )
    rows = [
        "| shape (seq x micro-batch) | variant | side | s/step | per-round medians | tokens/s "
        "| MFU | peak memory | time ratio tetrad/HF |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        for side in SIDES:
            s = r[side]
            if "error" in s:
                cells = [s["error"].replace("|", "/"), "", "", "", "", ""]
            else:
                mfu = "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
                ratio = r.get("time_ratio")
                cells = [
                    f"{s['median_step_s']:.3f}",
                    " / ".join(f"{t:.3f}" for t in s["round_medians_s"]),
                    f"{s['tokens_per_s']:,.0f}",
                    mfu,
                    _gib(s["peak_memory_bytes"]),
                    f"{ratio:.3f}" if side == "tetrad" and ratio is not None else "",
                ]
            rows.append("| " + " | ".join([r["shape"], r["variant"], side, *cells]) + " |")
    notes = "".join(f"\n- {p}" for p in result["problems"])
    return head + "\n".join(rows) + ("\n\nProblems:" + notes if notes else "") + "\n"


# ---- main --------------------------------------------------------------------------------------


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


def write(out: Path, result: dict) -> str:
    """Write the JSON and the Markdown report; return the Markdown."""
    result["problems"] = problems_of(result)
    (out / "vs_transformers.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "vs_transformers.md").write_text(text)
    return text


def problems_of(result: dict) -> list[str]:
    """What failed, was skipped or does not match (empty: all good)."""
    m = result["models"]
    out = [f"config: {x}" for x in m["config_mismatches"]]
    if m["tetrad_params"] != m["hf_params"]:
        out.append(f"parameters: tetrad {m['tetrad_params']:,}, hf {m['hf_params']:,}")
    for r in result["results"]:
        for side in SIDES:
            for i, rd in enumerate(r[side].get("rounds", [])):
                if "error" in rd:
                    out.append(f"{r['shape']} {r['variant']} {side} round {i + 1}: {rd['error']}")
    out += [f"skipped: {s}" for s in result["skipped"]]
    return out


def count_parameters(cfg: ModelConfig, grid: Grid, seq: int) -> dict:
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


def compare(
    args: argparse.Namespace,
    cfg: ModelConfig,
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


def round_line(rd: dict, shape: Shape) -> str:
    """One progress line of a round (with the bytes still allocated before its build when
    they exceed 256 MiB: something of the previous round survived and counts in this peak)."""
    if "error" in rd:
        return rd["error"]
    med = rd["median_step_s"]
    line = (
        f"build {rd['build_s']:.1f} s, {len(rd['step_s'])} steps median {med:.3f} s "
        f"({shape.tokens / med:,.0f} tok/s) after warm-up {rd['warmup_s']:.1f} s, "
        f"loss {rd['loss_first']:.3f} -> {rd['loss_last']:.3f}, "
        f"peak {_gib(rd['peak_memory_bytes'])}"
    )
    held = rd["start_allocated_bytes"]
    if held is not None and held > 256 * 2**20:
        line += f" ({_gib(held)} of it allocated before the build)"
    return line


if __name__ == "__main__":
    sys.exit(main())
