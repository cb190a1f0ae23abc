"""The ``tetrad`` command: one entry point, one sub-command per job.

    tetrad train       train a model: start local workers, or run as one rank under torchrun
    tetrad prepare     tokenize text, JSONL, Parquet or datasets inputs into token shards
    tetrad generate    sample text from a run directory or an exported folder
    tetrad export      write a run's full weights, config and tokenizer as safetensors
    tetrad report      where a run's step time went (compute, communication per axis)
    tetrad plan        rank 4D (and Megatron-style) configurations by predicted step time
    tetrad memory      per-GPU memory of one configuration and the 80% verdict
    tetrad calibrate   measure this machine into a machine file for the planner

Each sub-command is one row of :data:`COMMANDS`: its help, the function adding its options and
the function running it (which imports what it needs, so building the parser and running
``plan`` or ``memory`` never import torch). A mistake in the input, any
:class:`tetrad.spec.errors.TetradError`, prints one line ``tetrad: error: ...`` and exits with
status
2; a failed worker exits with 1, Ctrl-C with 130.
"""

from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import signal
import sys
from collections.abc import Callable
from typing import NamedTuple

from tetrad.calibrate import cli as calibrate_cli
from tetrad.plan import cli as plan_cli
from tetrad.spec.errors import TetradError, error_line
from tetrad.spec.precision import DEVICES
from tetrad.spec.units import MiB
from tetrad.train import config


class Command(NamedTuple):
    """One sub-command: a one-line help, a longer description, its options, what it runs."""

    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


def _other_torchrun_rank() -> bool:
    """Whether this process is a rank other than 0 of a ``torchrun`` job: a mistake in the
    command line, the same on every rank, is then said by rank 0 alone."""
    env = os.environ
    under = "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)
    return under and env.get("RANK", "0") != "0"


def _train(args: argparse.Namespace) -> None:
    try:
        cfg = config.load_config(args.config, config.overrides(args))
    except TetradError:
        if _other_torchrun_rank():
            raise SystemExit(2) from None
        raise
    from tetrad.train.launch import launch_train

    launch_train(cfg)


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "data",
        nargs="+",
        metavar="DATA",
        help="text, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files, folders of them, datasets "
        "folders (save_to_disk) or globs",
    )
    p.add_argument(
        "--tokenizer",
        default="",
        metavar="FILE",
        help="tokenizer.json (default: train a byte-level BPE of --vocab-size on the data)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder to write: new or empty, or an unfinished preparation of the same inputs "
        "and settings (resumed)",
    )
    cpus = len(os.sched_getaffinity(0))
    p.add_argument(
        "--workers",
        type=int,
        default=cpus,
        metavar="N",
        help=f"tokenizing processes (default: one per usable CPU, {cpus} here; 0: this process)",
    )
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="JSONL field, Parquet or datasets column holding the text (default: text)",
    )
    p.add_argument(
        "--encoding-errors",
        choices=("replace", "strict"),
        default="replace",
        help="bytes that are not UTF-8: replace by U+FFFD and count them (default), or stop "
        "naming the file and byte offset",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        metavar="N",
        help="size of the BPE trained without --tokenizer (default 4096)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        metavar="F",
        help="share of documents the BPE is not trained on, without --tokenizer (default "
        "0.01; the split itself is tetrad train's --val-fraction)",
    )
    p.add_argument(
        "--skip-bad-files",
        action="store_true",
        help="leave out damaged inputs (a cut or corrupt .gz, .zst or Parquet file: each read "
        "through first), counted and named in the summary line, instead of stopping at the first",
    )
    p.add_argument(
        "--shard-mb",
        type=float,
        default=256,
        metavar="MB",
        help="MiB of tokens per shard (default 256)",
    )


class _Signalled(Exception):
    """Raised in ``tetrad prepare``'s main thread by SIGTERM or SIGUSR1 (SLURM's stop)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_signalled(signum: int, frame: object) -> None:
    raise _Signalled(signum)


def _prepare(args: argparse.Namespace) -> int | None:
    """``tetrad prepare``; on SIGTERM, SIGUSR1 or Ctrl-C one line saying how to resume (what
    is written is consistent: the complete shards stay, a run again resumes after them) and
    exit status 143 (130 for Ctrl-C)."""
    old = {s: signal.signal(s, _raise_signalled) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        _prepare_now(args)
    except (_Signalled, KeyboardInterrupt) as e:
        name = str(e) if isinstance(e, _Signalled) else "SIGINT"
        print(
            f"tetrad: prepare stopped by {name}; {args.out} keeps its complete shards: run the "
            "same command again to resume",
            file=sys.stderr,
            flush=True,
        )
        return 130 if name == "SIGINT" else 143
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return None


def _prepare_now(args: argparse.Namespace) -> None:
    from tetrad.data.prepare import plan_job, prepare_sources, summary_line

    sources, job = plan_job(
        args.data,
        args.tokenizer,
        args.vocab_size,
        args.val_fraction,
        args.text_field,
        args.encoding_errors,
        args.workers,
        int(args.shard_mb * MiB),
        args.skip_bad_files,
    )
    out = os.path.expanduser(args.out)
    index, wrote = prepare_sources(
        sources, pathlib.Path(out), job, args.tokenizer, workers=args.workers, progress=True
    )
    if wrote:
        print(summary_line(index, out))
    else:
        print(f"tetrad: {out} already holds this preparation ({index['tokens']:,} tokens)")


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="run directory written by `tetrad train`, or a folder written by `tetrad export`",
    )
    p.add_argument("--prompt", default="", help="text to continue (default: empty)")
    p.add_argument(
        "--max-new-tokens", type=int, default=200, metavar="N", help="tokens to add (default 200)"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy (default 0.8)")
    p.add_argument(
        "--top-k", type=int, default=50, metavar="K", help="0 means no top-k cut (default 50)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", choices=DEVICES, default="cpu")


def _generate(args: argparse.Namespace) -> None:
    from tetrad.train.generate import generate

    text = generate(
        args.run_dir,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        device=args.device,
    )
    print(text)


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by `tetrad train`")
    p.add_argument("out", metavar="OUT", help="folder to create (must not exist, or be empty)")
    p.add_argument(
        "--to",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="safetensors: tetrad's names and config; hf: a Hugging Face Llama folder "
        "(transformers' from_pretrained loads it)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="cast every tensor to this type (default: as saved)",
    )
    p.add_argument(
        "--max-shard-mb",
        type=int,
        default=2048,
        metavar="N",
        help="at most N MiB of weights per .safetensors file (default 2048)",
    )


def _export(args: argparse.Namespace) -> None:
    from tetrad.train.export import export

    out = export(
        args.run_dir,
        args.out,
        fmt=args.to,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_mb * MiB,
    )
    print(f"exported {args.run_dir} to {out}")


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by `tetrad train`")
    p.add_argument("--no-plot", action="store_true", help="skip report.png (and routing.png)")


def _report(args: argparse.Namespace) -> None:
    from tetrad.train.report import report

    print(report(args.run_dir, plot=not args.no_plot))


COMMANDS: dict[str, Command] = {
    "train": Command(
        "train a model (starts one worker per grid rank, or runs under torchrun)",
        "Train a model. Options override the --config file, which overrides the defaults. "
        "Without torchrun, starts DATA*Z*Y*X local worker processes.",
        config.add_arguments,
        _train,
    ),
    "prepare": Command(
        "tokenize text, JSONL, Parquet or datasets inputs into token shards for tetrad train",
        "Tokenize DATA with worker processes (HF tokenizers batch encoding) into memory-mapped "
        "token shards and an index in DIR, holding a few batches in memory whatever the corpus "
        "size; a killed run resumes from its last complete shard when run again. `tetrad train "
        "--data DIR` trains on DIR as is.",
        _prepare_arguments,
        _prepare,
    ),
    "generate": Command(
        "sample text from a trained run directory or an exported folder",
        "Print PROMPT followed by text sampled from the latest checkpoint of RUN_DIR, or from "
        "the weights of a folder written by `tetrad export`.",
        _generate_arguments,
        _generate,
    ),
    "export": Command(
        "write a run's full weights, config and tokenizer to a safetensors folder",
        "Write the latest checkpoint of RUN_DIR as full (unsharded) weights to OUT: "
        "model.safetensors (or numbered shards and model.safetensors.index.json), config.json "
        "and tokenizer.json. Reads one tensor at a time, so memory holds about one shard. "
        "`tetrad generate OUT` samples from it.",
        _export_arguments,
        _export,
    ),
    "report": Command(
        "where a run's step time went (compute, communication)",
        "Summarize RUN_DIR/metrics.jsonl: step time split into compute and exposed "
        "communication per mesh axis; writes report.png. For an MoE model also the routing per "
        "block (max/mean expert load, balance term over its coefficient) and routing.png.",
        _report_arguments,
        _report,
    ),
    "plan": Command(
        plan_cli.PLAN_HELP,
        plan_cli.PLAN_DESCRIPTION,
        plan_cli.add_plan_arguments,
        plan_cli.run_plan,
    ),
    "memory": Command(
        plan_cli.MEMORY_HELP,
        plan_cli.MEMORY_DESCRIPTION,
        plan_cli.add_memory_arguments,
        plan_cli.run_memory,
    ),
    "calibrate": Command(
        "measure GEMMs and collectives here; write a machine TOML for tetrad plan",
        "Measure GEMM throughput, memory bandwidth, attention and collective bandwidth/latency "
        "over grid-like rank groups on this machine, and write a machine TOML that `tetrad plan "
        "--machine FILE` reads. Without torchrun, starts --nproc local workers.",
        calibrate_cli.add_arguments,
        calibrate_cli.run,
    ),
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line ``tetrad: error: ...`` (exit 2)."""

    def error(self, message: str):
        if _other_torchrun_rank():
            self.exit(2)
        self.exit(2, f"{error_line(message)} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tetrad`` command, one sub-parser per :data:`COMMANDS` row."""
    p = _Parser(prog="tetrad", description="Train Llama-style models with 4D hybrid parallelism.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.description))
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; an unknown option is reported by its command's parser (``see `tetrad
    train --help```), with the closest option it has."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = _subparsers(parser)[args.command]
        known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        near = difflib.get_close_matches(extra[0].split("=", 1)[0], known, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        sub.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The command parsers of :func:`build_parser`'s parser, by command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _join_dashed_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with each value that starts with a dash and a digit joined to its option
    (``--grid -2,1,1,1`` -> ``--grid=-2,1,1,1``): argparse takes ``-2,1,1,1`` or ``-1e-3`` for
    an option and says "expected one argument"; joined, the option's own check names the
    problem (sizes must be positive, a rate 0 or more)."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = next((t for t in argv if not t.startswith("-")), None)
    target = sub.choices.get(command) if sub is not None and command else None
    if target is None:
        return list(argv)
    takes_value = {
        opt
        for action in target._actions
        if action.nargs in (None, "?") and action.option_strings
        for opt in action.option_strings
    }
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if (
            tok in takes_value
            and len(nxt) > 1
            and nxt[0] == "-"
            and (nxt[1].isdigit() or nxt[1] == ".")
        ):
            out.append(f"{tok}={nxt}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the ``tetrad`` command line; returns the exit status.

    Exit status: 0 on success, 2 for a usage or configuration mistake (one line
    ``tetrad: error: <what to change>`` on stderr), 1 when a worker failed, 130 on Ctrl-C.
    """
    parser = build_parser()
    args = _parse(parser, _join_dashed_values(parser, sys.argv[1:] if argv is None else argv))
    try:
        return COMMANDS[args.command].run(args) or 0
    except TetradError as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
