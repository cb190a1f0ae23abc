"""Issue 47's routing check: the max/mean expert load per MoE block over the steps of one or
more ``tetrad train`` runs, read from their ``metrics.jsonl``.

Prints, per run, each block's max/mean load at steps 100, 150, ..., the worst and mean value
after step ``--after`` and the validation losses, and draws one panel per run (load against
step, one line per block, the ``--limit`` line) into ``--out`` (a small PNG).

With ``--batches N`` it also loads each run's last checkpoint and routes ``N`` fresh batches
of the run's global batch (training windows from steps the run never drew) through those fixed
weights: each block's max/mean load per batch against the load of all ``N`` batches together,
the part of a step's figure that comes from which sequences the batch holds rather than from
the router's weights.

Usage: ``PYTHONPATH=. python benchmarks/moe_routing.py RUN_DIR [RUN_DIR ...] [--out
docs/moe_routing.png] [--label NAME ...] [--batches 24]``. Exits 1 if a block of the last run
reaches ``--limit`` after step ``--after``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def read_rows(run_dir: str) -> dict[int, dict]:
    """The rows of ``RUN_DIR/metrics.jsonl`` by step (the last row of a step wins)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r for r in rows}


def loads(rows: dict[int, dict]) -> dict[str, list[tuple[int, float]]]:
    """``block -> [(step, max/mean load)]`` over the steps that report it."""
    out: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(rows):
        for block, value in rows[step].get("moe_max_load", {}).items():
            out.setdefault(block, []).append((step, value))
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def summary(name: str, rows: dict[int, dict], after: int, limit: float) -> bool:
    """Print the run's table; True when every block stays below ``limit`` after ``after``."""
    per_block = loads(rows)
    blocks = list(per_block)
    print(f"{name}: {max(rows)} steps")
    print("  step  " + "  ".join(f"block {b}" for b in blocks) + "   worst  val_loss")
    for step in range(after, max(rows) + 1, 50):
        if step not in rows:
            continue
        values = [dict(per_block[b])[step] for b in blocks]
        val = rows[step].get("val_loss")
        shown = f"{val:.4f}" if val is not None else ""
        print(
            f"  {step:4d}  "
            + "  ".join(f"{v:7.3f}" for v in values)
            + f"  {max(values):6.3f}  {shown}"
        )
    ok = True
    for b in blocks:
        late = [v for s, v in per_block[b] if s > after]
        if not late:
            continue
        over = sum(v >= limit for v in late)
        ok &= over == 0
        print(
            f"  block {b}: after step {after} worst {max(late):.3f}, "
            f"mean {sum(late) / len(late):.3f}, {over} of {len(late)} steps at or above {limit}"
        )
    return ok


def fixed_weights(run_dir: str, n_batches: int) -> None:
    """Route ``n_batches`` fresh global batches through the run's last checkpoint and print,
    per MoE block, the max/mean load of all of them together and per batch (mean, worst)."""
    import torch

    from tetrad.data.loader import sample_batch
    from tetrad.train.config import TrainConfig
    from tetrad.train.generate import load_model
    from tetrad.train.preflight import load_corpus

    torch.set_num_threads(1)
    model, _, run_cfg = load_model(run_dir)
    t, data = run_cfg["training"], run_cfg["data"]
    cfg = TrainConfig()
    cfg.data.paths, cfg.data.vocab_size = data["paths"], data["vocab_size"]
    corpus = load_corpus(cfg)
    routers = [m for m in model.modules() if type(m).__name__ == "Router"]
    ids: list[torch.Tensor] = []
    for r in routers:
        route = r.route

        def recording(x: torch.Tensor, route=route) -> tuple:
            out = route(x)
            ids.append(out[0])
            return out

        r.route = recording
    counts: list[list[torch.Tensor]] = [[] for _ in routers]
    with torch.no_grad():
        for i in range(n_batches):  # steps far beyond any run's: windows it never trained on
            batch = sample_batch(
                corpus.train, 10**6 + i, t["global_batch"], t["seq_len"], t["seed"]
            )
            ids.clear()
            model(batch[:, :-1])
            for block, chosen in enumerate(ids):
                n = routers[block].n_experts
                counts[block].append(torch.bincount(chosen.flatten(), minlength=n).double())
    print(
        f"{run_dir}: last checkpoint, {n_batches} batches of {t['global_batch']} x {t['seq_len']}"
    )
    for block, cs in enumerate(counts):
        whole = torch.stack(cs).sum(0)
        each = [float(c.max() / c.mean()) for c in cs]
        print(
            f"  MoE block {block}: all batches {float(whole.max() / whole.mean()):.3f}; "
            f"per batch mean {sum(each) / len(each):.3f}, worst {max(each):.3f}"
        )


def plot(runs: list[tuple[str, dict[int, dict]]], after: int, limit: float, out: str) -> None:
    """One panel per run: max/mean load against step, a line per block, ``limit`` dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(runs), figsize=(4.2 * len(runs), 2.9), sharey=True, squeeze=False
    )
    for ax, (name, rows) in zip(axes[0], runs, strict=True):
        for block, points in loads(rows).items():
            ax.plot(*zip(*points, strict=True), lw=0.8, label=f"block {block}")
        ax.axhline(limit, color="k", ls="--", lw=0.8)
        ax.axvline(after, color="grey", ls=":", lw=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("max/mean expert load", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(f"plot: {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--label", action="append", default=[], help="panel title per run")
    ap.add_argument("--after", type=int, default=100, help="the step after which loads count")
    ap.add_argument("--limit", type=float, default=1.3, help="the max/mean load to stay below")
    ap.add_argument("--out", default="", help="PNG to write (default: none)")
    ap.add_argument(
        "--batches", type=int, default=0, help="route N fresh batches through the last checkpoint"
    )
    args = ap.parse_args()
    names = args.label + args.runs[len(args.label) :]
    runs = [(name, read_rows(d)) for name, d in zip(names, args.runs, strict=True)]
    ok = [summary(name, rows, args.after, args.limit) for name, rows in runs]
    if args.out:
        plot(runs, args.after, args.limit, args.out)
    for d in args.runs if args.batches else []:
        fixed_weights(d, args.batches)
    return 0 if ok[-1] else 1


if __name__ == "__main__":
    sys.exit(main())
