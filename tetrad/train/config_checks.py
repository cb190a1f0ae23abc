"""Checks of a training configuration's values that need no model or data, one section or
one concept each; :meth:`tetrad.train.config.TrainConfig.check` runs them. Plain Python (no
torch). Each raises :class:`tetrad.train.sections.ConfigError` with one line saying what to
change.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from tetrad.spec.conflicts import Settings, check_conflicts
from tetrad.spec.errors import TetradError
from tetrad.spec.grid import check_expert_parallel
from tetrad.spec.pipeline_split import PipelineSplitError, check_schedule, explicit_split
from tetrad.spec.sharding import context_problems
from tetrad.train.sections import ConfigError, ParallelismSection, TrainingSection


def check_parallelism(par: ParallelismSection, seq_len: int) -> None:
    """The sequence splits over the context ranks; ``G_expert`` divides the stage's ranks;
    the overlap piece counts are 0 (the planner's choice) or counts. (The sharded optimizer
    combines with expert parallelism: the expert-sharded weights, summed over expert-data, have
    their AdamW states and masters split over it, :attr:`tetrad.parallel.zero.DataShards.
    experts`.)

    Raises:
        ConfigError: one line saying which value to change.
    """
    grid = par.grid
    c = grid[1]
    if context_problems(seq_len, c):
        raise ConfigError(
            f"seq_len={seq_len} is not divisible by 2*G_context = {2 * c} (each context "
            "rank holds two chunks of every sequence): change --seq-len or the grid"
        )
    try:
        check_expert_parallel(par.expert_parallel, grid)
    except TetradError as e:
        raise ConfigError(str(e)) from None
    _check_pieces(par)
    if par.sequence_parallel:
        _check_sequence_parallel(par, seq_len)


def _check_sequence_parallel(par: ParallelismSection, seq_len: int) -> None:
    """A tensor axis in the Y role (with one, the orientation gives it that role), and
    ``seq_len`` divisible by ``G_context`` times the size of each axis that may play Y
    (:func:`tetrad.spec.sharding.sequence_parallel_problem`; the model's kind is checked when
    it is built)."""
    d, c, z, y, x = par.grid
    if y == 1 and x == 1:
        raise ConfigError(
            "--sequence-parallel splits the sequence over a tensor axis and the grid has none: "
            "add y=N (or x=N), or drop --sequence-parallel"
        )
    if par.orientation != "auto" and (y if par.orientation == "xy" else x) == 1:
        raise ConfigError(
            f"--sequence-parallel needs a tensor axis in the Y role: use --orientation "
            f"{'yx' if par.orientation == 'xy' else 'xy'} or auto"
        )
    roles = {"xy": (y,), "yx": (x,)}.get(par.orientation, (y, x))
    for n in (n for n in roles if n > 1):
        if seq_len % (c * n):
            raise ConfigError(
                f"--sequence-parallel splits each rank's seq_len/G_context tokens {n} ways: "
                f"use a seq_len divisible by G_context*{n} = {c * n}"
            )


def _check_pieces(par: ParallelismSection) -> None:
    """``fine_chunks`` and ``context_pieces``: 0 (the planner's choice) or a count."""
    if par.fine_chunks < 0:
        raise ConfigError(
            f"fine_chunks={par.fine_chunks} must be 0 (the planner's choice) "
            "or a number of pieces per ring step such as 2"
        )
    if par.context_pieces < 0:
        raise ConfigError(
            f"context_pieces={par.context_pieces} must be 0 (the planner's choice) or a "
            "number of pieces such as 8"
        )


def check_pipeline(par: ParallelismSection, micro_batches: int) -> None:
    """The pipeline settings (:func:`tetrad.pipeline.schedule.check_schedule`), when
    ``G_pipe > 1``; pipeline options without a pipeline (:mod:`tetrad.spec.conflicts`).

    Raises:
        ConfigError: one line saying what to change.
        ConflictError: a pipeline option on a grid without a pipeline axis.
    """
    if par.pipe < 1 or par.virtual_stages < 1:
        raise ConfigError("pipe and virtual_stages must be at least 1")
    check_conflicts(Settings("train", "", par.pipe, par.pipeline_schedule, par.virtual_stages))
    if par.pipe > 1:
        try:
            check_schedule(par.pipeline_schedule, par.pipe, par.virtual_stages, micro_batches)
        except PipelineSplitError as e:
            raise ConfigError(str(e)) from None
    elif par.pipeline_split:
        raise ConfigError("--pipeline-split needs a pipeline: a --grid with pipe= above 1")


def check_pipeline_split(par: ParallelismSection, n_blocks: int) -> None:
    """``--pipeline-split`` against the model's ``n_blocks`` blocks and the grid's stages.

    Raises:
        ConfigError: one line saying what to change.
    """
    if par.pipeline_split and par.pipe > 1:
        try:
            explicit_split(par.pipeline_split, n_blocks, par.pipe * par.virtual_stages)
        except PipelineSplitError as e:
            raise ConfigError(str(e)) from None


def check_training(t: TrainingSection) -> None:
    """The optimiser's values: a learning rate of 0 or more, betas in [0, 1), and so on.

    Raises:
        ConfigError: one line naming the value and its allowed range.
    """
    if not (math.isfinite(t.lr) and t.lr >= 0):
        raise ConfigError(f"lr={t.lr} must be a number, 0 or more (for example 3e-4)")
    if not (math.isfinite(t.min_lr) and 0 <= t.min_lr <= t.lr):
        raise ConfigError(
            f"min_lr={t.min_lr} must lie in [0, lr={t.lr}]: pass --min-lr at most {t.lr} "
            "(the learning rate at the end of the cosine; its default 3e-4 suits the default "
            "--lr 3e-3)"
        )
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(t, name) < 1:
            raise ConfigError(f"{name}={getattr(t, name)} must lie in [0, 1)")
    for name in ("weight_decay", "grad_clip", "warmup_steps"):
        if not getattr(t, name) >= 0:
            raise ConfigError(f"{name}={getattr(t, name)} must be 0 or more")


def check_fp8(recipe: str) -> None:
    """``--fp8`` other than ``off`` needs torchao (tetrad/parallel/fp8.py).

    Raises:
        ConfigError: an FP8 recipe without torchao installed (one line that says how).
    """
    if recipe != "off" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"--fp8 {recipe} needs torchao: pip install 'tetrad[fp8]' (torchao==0.18.0), or "
            "--fp8 off"
        )


def check_model_source(model: str, hf_folder: Path | None) -> None:
    """``--model hf:FOLDER`` (the form ``tetrad plan`` and ``tetrad memory`` take) names sizes
    alone; training from a folder's weights and tokenizer is ``--init-from hf:FOLDER``.

    Raises:
        ConfigError: ``--model hf:...`` without ``--init-from``.
    """
    first = model.split(",")[0].strip()
    if first.startswith("hf:") and hf_folder is None:
        raise ConfigError(
            f"--model {first} takes the folder's sizes alone (random weights, this run's "
            f"tokenizer): to train from its weights and tokenizer pass --init-from {first}; "
            f"for its sizes alone, --model {first[3:].rstrip('/')}/config.json"
        )


def check_resume_dir(run_dir: str | Path, resume: bool) -> None:
    """With ``resume``, the run directory must exist (nothing is created for a mistyped one).

    Raises:
        ConfigError: ``resume`` and no directory ``run_dir``.
    """
    if resume and not Path(run_dir).exists():
        raise ConfigError(
            f"--resume: --run-dir {run_dir} does not exist: pass the directory of the run to "
            "continue, or drop --resume to start a fresh run there"
        )
