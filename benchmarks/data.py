"""``tetrad prepare`` on a corpus of at least 2 GB, against HF tokenizers alone, and the loader.

1. Corpus: the Python standard library's ``*.py`` files (the demo's documents), repeated in a
   new shuffled order each time, as JSONL (``{"text": ...}``) in 256 MB files until ``--gb``
   GB (decimal) are on disk.
2. Ceiling: HF ``tokenizers`` ``encode_batch_fast`` alone, in one process, on the first
   ``--ceiling-mb`` MB of the same documents in batches of about 1 MiB (as tetrad's): with the
   tokenizer's own threads (``TOKENIZERS_PARALLELISM`` unset: every core), and with one thread.
3. ``tetrad prepare`` of the whole corpus with each ``--workers`` count (the demo's tokenizer),
   in a subprocess: wall time, tokens/s, input MB/s, and peak RSS: of the process tree summed
   (sampled every 0.2 s) and of the largest single process (``ru_maxrss``, exact).
4. Loader: ``sample_batch`` of the demo's shape (16 x 257 tokens) from the prepared corpus,
   ``--batches`` times (random windows across all shards), against the demo's step time
   measured here by ``tetrad train`` with the demo's settings for ``--demo-steps`` steps.

Prints a markdown table (and the raw figures as JSON). From the repository root; on 2 cores
the default run takes about an hour and needs ``--gb`` x 1.7 GB of free disk under ``--dir``,
which is removed at the end unless ``--keep``::

    python benchmarks/data.py [--gb 2] [--workers 1 2] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def stdlib_texts() -> list[str]:
    from tetrad.data.sources import stdlib_sources

    return [s.path.read_bytes().decode("utf-8", "replace") for s in stdlib_sources()]


def write_corpus(folder: Path, gigabytes: float) -> tuple[int, int]:
    """JSONL files of shuffled stdlib documents until ``gigabytes`` GB; (bytes, documents)."""
    folder.mkdir(parents=True)
    texts = stdlib_texts()
    lines = [json.dumps({"text": t}) + "\n" for t in texts if t]
    total, docs, part, rep = 0, 0, None, 0
    while total < gigabytes * 1e9:
        order = list(range(len(lines)))
        random.Random(rep).shuffle(order)
        rep += 1
        for i in order:
            if part is None or part.tell() >= 256e6:
                if part is not None:
                    part.close()
                part = open(folder / f"part-{docs:09d}.jsonl", "w", encoding="utf-8")
            part.write(lines[i])
            total += len(lines[i].encode())
            docs += 1
    part.close()
    return total, docs


def ceiling(tokenizer: str, corpus: Path, megabytes: float) -> dict:
    """tokens/s and MB/s of ``encode_batch_fast`` alone on the first ``megabytes`` MB of text
    (this process: run it in a fresh one with ``TOKENIZERS_PARALLELISM`` set as wanted)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    batches, batch, size, total = [], [], 0, 0
    for f in sorted(corpus.iterdir()):
        for line in open(f, encoding="utf-8"):
            batch.append(json.loads(line)["text"])
            size += len(batch[-1].encode())
            if size >= 1 << 20:
                batches.append(batch)
                total, batch, size = total + size, [], 0
            if total >= megabytes * 1e6:
                break
        if total >= megabytes * 1e6:
            break
    t0 = time.perf_counter()
    tokens = sum(len(e.ids) for b in batches for e in tok.encode_batch_fast(b, False))
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": tokens / seconds, "mb_per_s": total / 1e6 / seconds, "mb": total / 1e6}


def _tree_rss(root: int) -> tuple[int, int]:
    """Summed RSS of ``root`` and its descendants, and the largest peak RSS (``VmHWM``) among
    them, bytes."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    rss = hwm = 0
    for p in tree:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = max(hwm, int(line.split()[1]) * 1024)
        except OSError:
            pass
    return rss, hwm


def prepare_run(corpus: Path, out: Path, tokenizer: str, workers: int) -> dict:
    """``tetrad prepare`` in a subprocess: wall time, the index's totals, peak RSS."""
    cmd = [sys.executable, "-m", "tetrad.cli", "prepare", str(corpus), "--out", str(out)]
    cmd += ["--tokenizer", tokenizer, "--workers", str(workers)]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    peak_sum = peak_one = 0
    loads = []
    while proc.poll() is None:
        rss, hwm = _tree_rss(proc.pid)
        peak_sum, peak_one = max(peak_sum, rss), max(peak_one, hwm)
        loads.append(os.getloadavg()[0])
        time.sleep(0.2)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"tetrad prepare failed ({proc.returncode}): {proc.stdout.read()}")
    index = json.loads((out / "index.json").read_text())
    return {
        "workers": workers,
        "seconds": seconds,
        "tokens": index["tokens"],
        "documents": index["documents"],
        "tokens_per_s": index["tokens"] / seconds,
        "mb_per_s": index["bytes"] / 1e6 / seconds,
        "peak_rss_tree_bytes": peak_sum,
        "peak_rss_process_bytes": peak_one,
        "load_avg": statistics.mean(loads) if loads else None,
        "line": proc.stdout.read().strip(),
    }


def loader_run(folder: Path, batches: int) -> dict:
    """Seconds per ``sample_batch(16 x 256)`` on the prepared folder (mean, p99)."""
    from tetrad.data.corpus import open_corpus
    from tetrad.data.loader import sample_batch

    corpus = open_corpus(folder, 0.01)
    sample_batch(corpus.train, 0, 16, 256, 1234)
    times = []
    for step in range(batches):
        t0 = time.perf_counter()
        sample_batch(corpus.train, step, 16, 256, 1234)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "mean_s": statistics.mean(times),
        "p99_s": times[int(0.99 * (len(times) - 1))],
        "train_tokens": len(corpus.train),
        "shards": len(corpus.train.shards),
    }


def demo_step(folder: Path, steps: int) -> float:
    """Median step time (s) of ``tetrad train`` with the demo's settings, steps 3 on."""
    run_dir = folder / "demo_run"
    cmd = [sys.executable, "-m", "tetrad.cli", "train", "--run-dir", str(run_dir)]
    cmd += ["--steps", str(steps), "--log-every", "1", "--val-every", "100000"]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[2:])


def table(r: dict) -> str:
    c1, cn = r["ceiling_1_thread"], r["ceiling_threads"]
    lines = [
        "| run | tokens/s | input MB/s | vs ceiling (all cores) | peak RSS, process tree "
        "| peak RSS, largest process | load avg |",
        "|---|---|---|---|---|---|---|",
        f"| HF tokenizers alone, 1 process, its threads ({r['cpus']} cores) "
        f"| {cn['tokens_per_s']:,.0f} | {cn['mb_per_s']:.2f} | 1.00 | | "
        f"| {r['load_ceiling']:.1f} |",
        f"| HF tokenizers alone, 1 process, 1 thread | {c1['tokens_per_s']:,.0f} "
        f"| {c1['mb_per_s']:.2f} | {c1['tokens_per_s'] / cn['tokens_per_s']:.2f} | | | |",
    ]
    for p in r["prepare"]:
        lines.append(
            f"| tetrad prepare --workers {p['workers']} ({p['seconds']:,.0f} s) "
            f"| {p['tokens_per_s']:,.0f} | {p['mb_per_s']:.2f} "
            f"| {p['tokens_per_s'] / cn['tokens_per_s']:.2f} "
            f"| {p['peak_rss_tree_bytes'] / 2**20:,.0f} MiB "
            f"| {p['peak_rss_process_bytes'] / 2**20:,.0f} MiB | {p['load_avg']:.1f} |"
        )
    ld = r["loader"]
    lines += [
        "",
        f"Loader: sample_batch 16 x 257 tokens from {ld['train_tokens']:,} train tokens in "
        f"{ld['shards']} shards: {ld['mean_s'] * 1e3:.3f} ms mean, {ld['p99_s'] * 1e3:.3f} ms "
        f"p99; demo step {r['demo_step_s']:.3f} s: {100 * ld['mean_s'] / r['demo_step_s']:.3f}% "
        "of a step.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="corpus size on disk, GB (1e9 B)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ceiling-mb", type=float, default=200.0)
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--demo-steps", type=int, default=12)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the corpus and prepared folders")
    ap.add_argument("--ceiling", nargs=3, metavar=("TOKENIZER", "CORPUS", "MB"), help="internal")
    args = ap.parse_args()
    if args.ceiling:
        print(json.dumps(ceiling(args.ceiling[0], Path(args.ceiling[1]), float(args.ceiling[2]))))
        return
    work = Path(args.dir or tempfile.mkdtemp(prefix="tetrad_data_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    from tetrad.data.corpus import prepare_corpus

    tokenizer = str(prepare_corpus([]).tokenizer_path)  # the demo's BPE (from the cache)
    r: dict = {"cpus": len(os.sched_getaffinity(0)), "tokenizer": tokenizer}
    try:
        t0 = time.perf_counter()
        r["corpus_bytes"], r["corpus_documents"] = write_corpus(work / "corpus", args.gb)
        r["corpus_write_s"] = time.perf_counter() - t0
        r["load_ceiling"] = os.getloadavg()[0]
        base = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
        cmd = [sys.executable, __file__, "--ceiling", tokenizer, str(work / "corpus")]
        for name in ("ceiling_threads", "ceiling_1_thread"):
            env = base | {"TOKENIZERS_PARALLELISM": "false"} if name.endswith("1_thread") else base
            out = subprocess.run([*cmd, str(args.ceiling_mb)], env=env, capture_output=True)
            r[name] = json.loads(out.stdout)
        r["prepare"] = []
        for w in args.workers:
            out = work / f"prepared_{w}"
            r["prepare"].append(prepare_run(work / "corpus", out, tokenizer, w))
            print(json.dumps(r["prepare"][-1]), flush=True)
        r["loader"] = loader_run(work / f"prepared_{args.workers[-1]}", args.batches)
        r["demo_step_s"] = demo_step(work, args.demo_steps)
        r["load_end"] = os.getloadavg()
        print(json.dumps(r, indent=1))
        print(table(r))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
