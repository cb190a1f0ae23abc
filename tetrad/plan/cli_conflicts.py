"""The options ``tetrad plan`` and ``tetrad memory`` were given, checked against the one table
of settings that disagree (:mod:`tetrad.spec.conflicts`), as ``tetrad train`` checks its own.
Plain Python."""

from __future__ import annotations

import argparse
import sys

from tetrad.spec.conflicts import PIPELINE_DEFAULTS, Settings, check_conflicts
from tetrad.spec.errors import warning_line

PLAN_RANKING_DEFAULTS = {
    "gpus": None,
    "global_batch": None,
    "top": 10,
    "json": False,
    "plot": None,
    "emit_config": None,
    "comm_model": "tetrad",
    "overlap": "all",
    "checkpointing": "auto",
    "micro_batch": None,
    "no_classic": False,
    "no_pipeline": False,
    "shard_optimizer": "auto",
    "param_dtype": "fp32",
    "residual_dtype": "auto",
    "sequence_parallel": "off",
    "sequence_parallel_regather": False,
    "gpu_memory_gib": None,
}
"""``tetrad plan``'s options that only ranking reads, and their defaults."""

MEMORY_TETRAD_DEFAULTS = {
    "shard_optimizer": False,
    "orientation": "auto",
    "activation_checkpointing": "none",
    "compile": False,
    "param_dtype": "fp32",
    "residual_dtype": "auto",
    "sequence_parallel": False,
    "sequence_parallel_regather": False,
    "expert_parallel": 1,
    "moe_imbalance": 1.0,
    **PIPELINE_DEFAULTS,
}
"""``tetrad memory``'s options that only ``--method tetrad`` reads, and their defaults."""


def _given(args: argparse.Namespace, defaults: dict) -> tuple[str, ...]:
    """The options of ``defaults`` given another value, as ``--name value`` (``--name`` for a
    flag)."""
    out = []
    for name, default in defaults.items():
        value = getattr(args, name, default)
        if value != default:
            flag = "--" + name.replace("_", "-")
            out.append(flag if value is True else f"{flag} {value}")
    return tuple(out)


def check_plan_settings(args: argparse.Namespace) -> None:
    """``tetrad plan``'s options checked against :mod:`tetrad.spec.conflicts`.

    Raises:
        ConflictError: ``--sublayers`` with options only ranking reads;
            ``--sequence-parallel-regather`` with ``--sequence-parallel off``.
    """
    mode = "sublayers" if args.sublayers else "rank"
    other = _given(args, PLAN_RANKING_DEFAULTS) if args.sublayers else ()
    settings = Settings(
        "plan",
        mode,
        other_mode_options=other,
        sequence_parallel=args.sequence_parallel != "off",
        sequence_parallel_regather=args.sequence_parallel_regather,
    )
    _warn(check_conflicts(settings))


def check_memory_settings(args: argparse.Namespace, method: str, pipe: int) -> None:
    """``tetrad memory``'s options checked against :mod:`tetrad.spec.conflicts`: pipeline
    options without a pipeline, options of the other ``--method``.

    Raises:
        ConflictError: one line naming both settings.
    """
    if method == "tetrad":
        other = tuple(
            f"--{n} {getattr(args, n)}" for n in ("tp", "cp", "pp", "dp") if getattr(args, n) != 1
        )
        settings = Settings(
            "memory",
            method,
            pipe,
            args.pipeline_schedule,
            args.virtual_stages,
            args.num_microbatches,
            other_mode_options=other,
            sequence_parallel=args.sequence_parallel,
            sequence_parallel_regather=args.sequence_parallel_regather,
        )
    else:
        other = _given(args, MEMORY_TETRAD_DEFAULTS)
        settings = Settings(
            "memory", method, pipe, num_microbatches=args.num_microbatches, other_mode_options=other
        )
    _warn(check_conflicts(settings))


def _warn(lines: list[str]) -> None:
    for line in lines:
        print(warning_line(line), file=sys.stderr)
