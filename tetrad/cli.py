"""The ``tetrad`` command: ``tetrad train`` and ``tetrad generate``.

``tetrad train`` either runs as one worker of a job started by ``torchrun`` (``RANK`` and
``WORLD_SIZE`` or ``TORCHELASTIC_RUN_ID`` set: it checks the grid against ``WORLD_SIZE`` and
trains), or, started by hand, prepares the data in this process and then starts
``G_data*G_z*G_y*G_x`` local workers with PyTorch's elastic launcher. Mistakes in the inputs
print one line ``tetrad: error: ...`` and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from tetrad.plan import cli as plan_cli  # plain Python: `tetrad plan` never imports torch


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean "change your input" (printed as one line, exit 2)."""
    from tetrad.models.config import ModelConfigError
    from tetrad.spec import GridError
    from tetrad.train.checkpoint import CheckpointError
    from tetrad.train.config import ConfigError
    from tetrad.train.data import DataError

    return (GridError, ModelConfigError, ConfigError, DataError, CheckpointError)


# Options of `tetrad train` that override TrainConfig fields (argparse dest == field name).
TRAIN_FIELDS = (
    "model",
    "grid",
    "steps",
    "micro_batch",
    "global_batch",
    "seq_len",
    "lr",
    "seed",
    "data",
    "tokenizer",
    "run_dir",
    "device",
    "activation_checkpointing",
    "resume",
    "log_every",
    "val_every",
    "ckpt_every",
    "overlap",
    "profile_steps",
    "machine",
    "nproc",
    "dp_bucket_mb",
    "domino_min_rows",
)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line ``tetrad: error: ...`` (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"tetrad: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tetrad`` command."""
    p = _Parser(prog="tetrad", description="Train Llama-style models with 4D hybrid parallelism.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser(
        "train",
        help="train a model (starts one worker per grid rank, or runs under torchrun)",
        description="Train a model. Options override the --config file, which overrides the "
        "defaults. Without torchrun, starts DATA*Z*Y*X local worker processes.",
    )
    t.add_argument("--config", metavar="FILE.toml", help="TOML file of training settings")
    t.add_argument("--model", help="preset or sizes, e.g. small, tiny,n_layers=4, dim=512,...")
    t.add_argument(
        "--grid",
        metavar="DATA,Z,Y,X",
        help="process grid, e.g. 1,2,1,2, or auto (the planner picks it)",
    )
    t.add_argument("--steps", type=int, help="optimizer steps")
    t.add_argument("--micro-batch", type=int, metavar="N", help="samples per rank per micro-step")
    t.add_argument("--global-batch", type=int, metavar="N", help="samples per optimizer step")
    t.add_argument("--seq-len", type=int, metavar="N", help="tokens per sample")
    t.add_argument("--lr", type=float, help="peak learning rate")
    t.add_argument("--seed", type=int, help="random seed")
    t.add_argument(
        "--data",
        action="append",
        metavar="PATH",
        help="text file, folder or glob (repeatable); default: the Python stdlib",
    )
    t.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (default: train a BPE)")
    t.add_argument("--run-dir", metavar="DIR", help="where logs and checkpoints go")
    t.add_argument("--device", choices=("cpu", "cuda"), help="cpu (gloo) or cuda (NCCL)")
    t.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=None,
        help="recompute activations in the backward pass to save memory",
    )
    t.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="continue from the latest checkpoint in --run-dir",
    )
    t.add_argument("--log-every", type=int, metavar="N", help="steps between log lines")
    t.add_argument("--val-every", type=int, metavar="N", help="steps between validations")
    t.add_argument(
        "--ckpt-every", type=int, metavar="N", help="steps between checkpoints (0: only at the end)"
    )
    t.add_argument(
        "--overlap",
        metavar="LIST",
        help="collectives overlapped with compute: all (default), none, or a list of "
        "prefetch,reduce_scatter,dx_all_reduce,dp_all_reduce,domino",
    )
    t.add_argument(
        "--dp-bucket-mb",
        type=float,
        metavar="MB",
        help="data-parallel all-reduce bucket size in MiB (default 4)",
    )
    t.add_argument(
        "--domino-min-rows",
        type=int,
        metavar="N",
        help="split a forward GEMM + all-reduce only with at least 2N token rows",
    )
    t.add_argument(
        "--profile-steps",
        metavar="A:B",
        help="write a torch.profiler Chrome trace of steps A..B to the run directory",
    )
    t.add_argument(
        "--machine",
        metavar="NAME|FILE.toml",
        help="machine for the planner (--grid auto, Domino choice): a preset such as "
        "dgx-h100 or the file `tetrad calibrate` writes",
    )
    t.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="processes for --grid auto without torchrun (default: GPUs, or 4 on CPU)",
    )

    g = sub.add_parser(
        "generate",
        help="sample text from a trained run directory",
        description="Print PROMPT followed by text sampled from the latest checkpoint of RUN_DIR.",
    )
    g.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by `tetrad train`")
    g.add_argument("--prompt", default="", help="text to continue (default: empty)")
    g.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    g.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=50, metavar="K", help="0 means no top-k cut")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")

    r = sub.add_parser(
        "report",
        help="where a run's step time went (compute, communication)",
        description="Summarize RUN_DIR/metrics.jsonl: step time split into "
        "compute and exposed communication per mesh axis; writes report.png.",
    )
    r.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by `tetrad train`")
    r.add_argument("--no-plot", action="store_true", help="skip report.png")
    plan_cli.add_commands(sub)
    # options parsed by tetrad.train.calibrate itself, so that building this parser (and
    # `tetrad plan`) never imports torch
    sub.add_parser(
        "calibrate",
        add_help=False,
        help="measure GEMM and collective speed here "
        "and write a machine TOML for the planner (see `tetrad calibrate --help`)",
    )
    return p


def train_overrides(args: argparse.Namespace) -> dict:
    """The ``tetrad train`` options as ``load_config`` overrides (unset options are None)."""
    return {name: getattr(args, name, None) for name in TRAIN_FIELDS}


def under_torchrun() -> bool:
    """True when this process is one worker of a ``torchrun`` (or similar) job."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


def _train(args: argparse.Namespace) -> None:
    from tetrad.spec import GridError, check_world_size
    from tetrad.train.config import load_config

    cfg = load_config(args.config, train_overrides(args))
    if cfg.grid == "auto":
        from tetrad.train.auto import choose_grid, default_nproc, is_rank0
        from tetrad.train.data import prepare_corpus

        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else default_nproc(cfg)
        vocab = prepare_corpus(cfg.data, cfg.tokenizer, cfg.vocab_size, cfg.val_fraction)
        cfg = choose_grid(cfg, world, vocab.vocab_size, verbose=is_rank0())
    if under_torchrun():
        check_world_size(cfg.grid, int(os.environ["WORLD_SIZE"]))
        cfg.check()
        from tetrad.train import trainer

        trainer.train(cfg)
        return
    cfg.check()
    d, z, y, x = cfg.grid
    nproc = d * z * y * x
    if cfg.device == "cuda":
        from tetrad.device import gpu_count

        if gpu_count() < nproc:
            raise GridError(
                f"grid data*z*y*x = {d}*{z}*{y}*{x} = {nproc} needs {nproc} GPUs, but "
                f"{gpu_count()} are visible: use a smaller --grid or torchrun "
                "across nodes"
            )
    from tetrad.train import trainer
    from tetrad.train.launch import run_local

    trainer.preflight(cfg)
    print(
        f"tetrad: starting {nproc} workers (grid data={d} z={z} y={y} x={x}, {cfg.device})",
        file=sys.stderr,
        flush=True,
    )
    run_local(cfg, nproc)


def _generate(args: argparse.Namespace) -> None:
    from tetrad.train.generate import generate

    print(
        generate(
            args.run_dir,
            prompt=args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            device=args.device,
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Run the ``tetrad`` command line; returns the exit status.

    Exit status: 0 on success, 2 for a usage or configuration mistake (one line
    ``tetrad: error: <what to change>`` on stderr), 1 when a worker failed, 130 on Ctrl-C.
    """
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "calibrate":
        from tetrad.train import calibrate

        return calibrate.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in plan_cli.COMMANDS:
        return plan_cli.run(args)
    errors = user_errors()
    try:
        if args.command == "train":
            _train(args)
        elif args.command == "report":
            from tetrad.train.report import report

            print(report(args.run_dir, plot=not args.no_plot))
        else:
            _generate(args)
    except errors as e:
        msg = str(e).strip().splitlines()
        print(f"tetrad: error: {msg[0] if msg else type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
