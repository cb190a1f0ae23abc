"""Settings that disagree: the one table ``tetrad train``, ``tetrad memory`` and ``tetrad plan``
consult, so each pair is refused (or, where harmless, warned about) in the same one line by
every command (plain Python).

A command describes what it was asked as :class:`Settings` (each field as the user gave it; a
default value means "not given") and calls :func:`check_conflicts`: the first refused pair
raises :class:`ConflictError`, naming both settings and what to keep; the harmless ones come
back as warning lines (:func:`tetrad.spec.errors.warning_line`).

The rows of :data:`RULES`:

- pipeline options (``--pipeline-schedule``, ``--virtual-stages``, ``--num-microbatches`` of
  ``tetrad memory``) on a grid without a pipeline axis: they would do nothing; with
  ``--grid auto``, whose planner chooses them;
- ``expert=N`` in a named ``--grid`` and a different ``--expert-parallel`` in the same place
  (the command line, or the config file): one silently won;
- mixture-of-experts sizes (``top_k``, ``expert_ffn_dim``, ...) in ``--model`` with
  ``n_experts=0``: the dense model would be trained or sized;
- options of one mode given in another (``tetrad memory --tp 2 --shard-optimizer``: fujii2024
  does not model the sharded optimizer; ``--grid`` options without ``--grid``);
- options of a feature that is off (``--fine-chunks`` without the fine overlap,
  ``--context-pieces`` without a context axis or overlap, ``--nproc`` with a grid of another
  size, ``--sequence-parallel-regather`` without ``--sequence-parallel``);
- a resumed run given another ``--steps`` (or ``--warmup-steps``, ``--lr``, ``--min-lr``): the
  learning-rate schedule changes; warned, since training further is a reason to resume.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tetrad.spec.errors import TetradError
from tetrad.spec.model import ModelSpec


class ConflictError(TetradError):
    """Two settings that disagree (or one that does nothing where it was given): one line
    naming both and what to keep."""


PIPELINE_DEFAULTS = {"pipeline_schedule": "1f1b", "virtual_stages": 1}
"""The pipeline options' defaults (``ParallelismSection``'s and ``tetrad memory``'s): any other
value was given by the user."""

MOE_SIZES = (
    "top_k",
    "expert_ffn_dim",
    "shared_ffn_dim",
    "dense_layers",
    "moe_every",
    "router_score",
    "router_renorm",
    "route_scale",
    "aux_loss_coef",
    "aux_loss_scope",
    "router_z_loss_coef",
    "bias_update_rate",
)
"""The :class:`~tetrad.spec.model.ModelSpec` fields that only a mixture-of-experts model reads."""

SCHEDULE_KEYS = ("steps", "warmup_steps", "lr", "min_lr")
"""The training settings that shape the learning-rate schedule (warmup, then cosine decay to
``min_lr`` at ``steps``)."""


@dataclass(frozen=True)
class Settings:
    """What one command was asked, as given. Defaults mean "not given"."""

    command: str = "train"
    """``train``, ``memory`` or ``plan``; with its mode, for options of another mode."""
    mode: str = ""
    """The command's mode: ``tetrad memory``'s estimator (``tetrad``, ``fujii2024``),
    ``tetrad plan``'s ``rank`` or ``sublayers``; empty for ``train``."""
    pipe: int | None = 1
    """``G_pipe`` (None: not known yet, ``--grid auto``)."""
    pipeline_schedule: str = PIPELINE_DEFAULTS["pipeline_schedule"]
    virtual_stages: int = PIPELINE_DEFAULTS["virtual_stages"]
    num_microbatches: int | None = None
    """``tetrad memory --num-microbatches`` (None: not given)."""
    grid_expert: int | None = None
    """``N`` of ``expert=N`` in a named ``--grid`` (None: not named there)."""
    expert_parallel: int | None = None
    """``--expert-parallel`` given in the same place as the grid (None: not given)."""
    model: ModelSpec | None = None
    model_keys: frozenset[str] = frozenset()
    """The model sizes the user named (``--model small,top_k=2``, ``[model]`` keys)."""
    other_mode_options: tuple[str, ...] = ()
    """Options given that only another mode of the command reads (``--tp`` with ``--grid``)."""
    overlaps: frozenset[str] | None = None
    """``tetrad train``'s overlaps (:func:`tetrad.spec.overlap.parse_overlaps`; None: not
    known)."""
    fine_chunks: int = 0
    """``--fine-chunks`` (0: not given, the planner's choice)."""
    context_pieces: int = 0
    """``--context-pieces`` (0: not given, the planner's choice)."""
    context: int = 1
    """``G_context`` of the grid."""
    nproc: int = 0
    """``--nproc`` (0: not given)."""
    sequence_parallel: bool = False
    """``--sequence-parallel``."""
    sequence_parallel_regather: bool = False
    """``--sequence-parallel-regather``."""
    ranks: int | None = None
    """The grid's ranks, ``G_pipe`` times the product of its sizes (None: ``--grid auto``)."""
    resumed: Mapping | None = None
    """The ``training`` settings a resumed run was started with (``RUN_DIR/config.json``)."""
    training: Mapping = field(default_factory=dict)
    """This run's ``training`` settings (for a resumed run)."""


@dataclass(frozen=True)
class Rule:
    """One kind of disagreement: ``check`` returns the line (None: no disagreement); a
    ``refused`` rule raises, the others warn."""

    name: str
    refused: bool
    check: Callable[[Settings], str | None]


def _pipeline_without_pipe(s: Settings) -> str | None:
    if s.pipe not in (1, None):
        return None
    given = [
        f"--{k.replace('_', '-')} {getattr(s, k)}"
        for k, default in PIPELINE_DEFAULTS.items()
        if getattr(s, k) != default
    ]
    if s.num_microbatches is not None:
        given.append(f"--num-microbatches {s.num_microbatches}")
    if not given:
        return None
    if s.pipe is None:
        return (
            f"{' and '.join(given)} with --grid auto: the planner chooses the pipeline and its "
            "schedule (or none): drop the pipeline option(s), or give a --grid with pipe=N"
        )
    return (
        f"{' and '.join(given)} set{'s' if len(given) == 1 else ''} up a pipeline but the grid "
        "has none (pipe=1): add pipe=N to --grid (or six sizes PIPE,DATA,CONTEXT,Z,Y,X), or "
        "drop the pipeline option(s)"
    )


def _expert_twice(s: Settings) -> str | None:
    if s.grid_expert is None or s.expert_parallel is None or s.grid_expert == s.expert_parallel:
        return None
    return (
        f"--grid names expert={s.grid_expert} but --expert-parallel is {s.expert_parallel}: "
        "keep one of them (expert=N in a named --grid sets --expert-parallel)"
    )


def _moe_sizes_without_experts(s: Settings) -> str | None:
    if s.model is None or s.model.n_experts:
        return None
    named = [k for k in MOE_SIZES if k in s.model_keys]
    if not named:
        return None
    sizes = ",".join(f"{k}={getattr(s.model, k)}" for k in named)
    return (
        f"model {s.model.name}: {sizes} {'are' if len(named) > 1 else 'is a'} mixture-of-experts "
        f"size{'s' if len(named) > 1 else ''} but n_experts=0 (a dense model): set n_experts=N "
        f"(at least top_k), or drop {', '.join(named)}"
    )


_MODES = {
    ("memory", "fujii2024"): (
        "tetrad memory's fujii2024 estimate (--tp --cp --pp --dp, no --grid)",
        "give --grid for the tetrad runtime's, or drop {it}",
    ),
    ("memory", "tetrad"): (
        "tetrad memory --grid (the tetrad runtime's estimate)",
        "put the sizes in --grid, or drop {it}",
    ),
    ("plan", "sublayers"): (
        "tetrad plan --sublayers (one table, nothing ranked)",
        "drop {it}, or drop --sublayers",
    ),
}
"""Per ``(command, mode)``: how the mode is named, and what to do with another mode's options."""


def _other_mode(s: Settings) -> str | None:
    if not s.other_mode_options:
        return None
    many = len(s.other_mode_options) > 1
    where, hint = _MODES.get((s.command, s.mode), (f"tetrad {s.command}", "drop {it}"))
    return (
        f"{' and '.join(s.other_mode_options)} {'do' if many else 'does'} nothing in {where}: "
        + hint.format(it="them" if many else "it")
    )


def _unused_options(s: Settings) -> str | None:
    if s.sequence_parallel_regather and not s.sequence_parallel:
        return (
            "--sequence-parallel-regather gathers the sequence-parallel input again in backward "
            "but --sequence-parallel is off: add --sequence-parallel, or drop "
            "--sequence-parallel-regather"
        )
    if s.overlaps is not None and s.fine_chunks and "fine" not in s.overlaps:
        return (
            f"--fine-chunks {s.fine_chunks} sets the fine overlap's pieces but --overlap leaves "
            "fine out: add fine to --overlap (or use all), or drop --fine-chunks"
        )
    if s.context_pieces and s.ranks is not None and s.context == 1:
        return (
            f"--context-pieces {s.context_pieces} splits the context all-gather but the grid "
            "has no context axis (G_context=1): give DATA,CONTEXT,Z,Y,X sizes, or drop "
            "--context-pieces"
        )
    if s.overlaps is not None and s.context_pieces and "context" not in s.overlaps:
        return (
            f"--context-pieces {s.context_pieces} splits the context overlap's all-gather but "
            "--overlap leaves context out: add context to --overlap (or use all), or drop "
            "--context-pieces"
        )
    if s.nproc and s.ranks is not None and s.nproc != s.ranks:
        return (
            f"--nproc {s.nproc} but the grid has {s.ranks} ranks (--nproc is for --grid auto): "
            "drop --nproc, or use --grid auto"
        )
    return None


def _resume_schedule(s: Settings) -> str | None:
    if not s.resumed:
        return None
    diff = [k for k in SCHEDULE_KEYS if k in s.resumed and s.resumed[k] != s.training.get(k)]
    if not diff:
        return None
    now = ", ".join(f"--{k.replace('_', '-')} {s.training.get(k)}" for k in diff)
    was = ", ".join(f"{s.resumed[k]}" for k in diff)
    return (
        f"{now} (the run had {was}): the resumed learning-rate schedule follows the new "
        f"value{'s' if len(diff) > 1 else ''}; pass the run's to keep its schedule"
    )


RULES: tuple[Rule, ...] = (
    Rule("pipeline options without a pipeline", True, _pipeline_without_pipe),
    Rule("expert parallelism named twice", True, _expert_twice),
    Rule("MoE sizes on a dense model", True, _moe_sizes_without_experts),
    Rule("options of another mode", True, _other_mode),
    Rule("options of a feature that is off", True, _unused_options),
    Rule("a resumed run's schedule changed", False, _resume_schedule),
)
"""Every disagreement the commands check, in the order they are checked."""


def check_conflicts(settings: Settings) -> list[str]:
    """Check ``settings`` against :data:`RULES`; returns the warnings (harmless disagreements,
    one line each, without the ``tetrad: warning:`` prefix).

    Raises:
        ConflictError: the first refused disagreement, naming both settings and what to keep.
    """
    warnings = []
    for rule in RULES:
        line = rule.check(settings)
        if line is None:
            continue
        if rule.refused:
            raise ConflictError(line)
        warnings.append(line)
    return warnings
