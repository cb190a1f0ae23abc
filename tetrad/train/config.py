"""Training configuration: typed sections, read from TOML, overridden by command-line options.

A TOML file has one table per section; a key is a field of its section, and the ``[model]``
table also holds model sizes that override the preset (``tetrad plan --emit-config`` writes
this form, and ``RUN_DIR/config.json`` records it)::

    [model]
    name = "small"              # a preset, or preset,key=value sizes
    n_layers = 8                # sizes override the preset

    [data]
    paths = ["input.txt"]       # files, folders or globs (default: the Python stdlib), or
                                # one folder written by `tetrad prepare`
    text_field = "text"         # JSONL field / Parquet or datasets column of the text

    [parallelism]
    grid = "2,2,1,1"            # G_data,G_z,G_y,G_x, or "auto"

    [training]
    steps = 300

    [checkpoint]
    run_dir = "runs/demo"

    [logging]
    log_every = 10
    tensorboard = true          # also write TensorBoard scalars to RUN_DIR/tensorboard

The sections are the dataclasses of :mod:`tetrad.train.sections`. Every field is also a
``tetrad train`` option (:func:`add_arguments` generates them from the fields and their help),
named by its *option*: the field name, except ``--model`` for
``model.name`` and ``--data`` for ``data.paths``. A flat file of ``option = value`` keys (the
form before sections) is still accepted. Command-line options win over the file, which wins over
the defaults. Plain Python: parsing a configuration never imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tetrad.spec.conflicts import Settings, check_conflicts
from tetrad.spec.errors import TetradError
from tetrad.spec.grid import parse_grid, parse_pipeline_grid, pop_expert
from tetrad.spec.model import ModelSpec, check_trainable
from tetrad.spec.precision import DEVICES, Precision, PrecisionError, precision
from tetrad.spec.presets import ALIASES, parse_model, with_sizes
from tetrad.spec.toml import tomllib
from tetrad.train.config_checks import (
    check_fp8,
    check_model_source,
    check_parallelism,
    check_pipeline,
    check_pipeline_split,
    check_resume_dir,
    check_training,
)
from tetrad.train.sections import (
    CheckpointSection,
    ConfigError,
    DataSection,
    LoggingSection,
    ModelSection,
    ParallelismSection,
    PrecisionSection,
    TrainingSection,
)


@dataclass
class TrainConfig:
    """Everything one ``tetrad train`` run needs, in sections.

    Batch arithmetic: the ``global_batch`` samples of a step are split over ``G_data * G_z``
    ranks and each rank's share is processed ``micro_batch`` samples at a time, so
    ``global_batch % (G_data * G_z * micro_batch) == 0`` and there are
    ``global_batch / (G_data * G_z * micro_batch)`` gradient-accumulation micro-steps.
    """

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def model_config(self, tokenizer_vocab: int | None = None) -> ModelSpec:
        """The model sizes: the ``model`` string, then the ``[model]`` sizes.

        The vocabulary follows the tokenizer (``tokenizer_vocab`` tokens) unless the user set a
        nonzero ``vocab_size`` explicitly; it is then padded up to a multiple of
        ``lcm(128, G_z*G_y*G_x)`` so the embedding and LM head divide over the grid (as Megatron-LM
        pads its vocabulary); padding ids never occur in the data.
        """
        folder = self.hf_folder
        if folder is not None:
            from tetrad.models.hf import read_config

            cfg, explicit = read_config(folder)[0], frozenset()
            tokenizer_vocab = max(tokenizer_vocab or 0, cfg.vocab_size)
        else:
            cfg, explicit = parse_model(self.model.name)
            cfg = check_trainable(with_sizes(cfg, self.model.sizes))
        given = explicit | {ALIASES.get(k, k) for k in self.model.sizes}
        check_conflicts(Settings(model=cfg, model_keys=given))
        user_vocab = "vocab_size" in given and cfg.vocab_size
        if tokenizer_vocab is not None and not user_vocab:
            grid = self.parallelism.grid
            multiple = math.lcm(128, 1 if grid == "auto" else grid[2] * grid[3] * grid[4])
            padded = -(-tokenizer_vocab // multiple) * multiple
            real = tokenizer_vocab if padded > tokenizer_vocab else 0
            cfg = dataclasses.replace(cfg, vocab_size=padded, unpadded_vocab=real)
        return cfg

    @property
    def policy(self) -> Precision:
        """The numeric-format policy of the run: the device's with ``[precision]``'s choices
        (:func:`tetrad.spec.precision.precision`)."""
        p = self.precision
        return precision(self.training.device, p.params, p.grad_reduce, p.residual, p.fp8)

    @property
    def hf_folder(self) -> Path | None:
        """The Hugging Face folder of ``--init-from hf:PATH``, or None.

        Raises:
            ConfigError: ``init_from`` without the ``hf:`` prefix.
        """
        spec = self.model.init_from
        if not spec:
            return None
        if not spec.startswith("hf:"):
            raise ConfigError(f"init_from={spec!r}: give hf:PATH, a Hugging Face Llama folder")
        return Path(spec[3:])

    def check(self) -> None:
        """Validate values that need no data (the model's sizes but not the vocabulary).

        Raises:
            ConfigError: one line saying which value to change.
            ModelError: ``--model`` names no model.
            ConflictError: settings that disagree (:mod:`tetrad.spec.conflicts`).
        """
        t, grid = self.training, self.parallelism.grid
        self.parallelism.check_resolved()
        check_model_source(self.model.name, self.hf_folder)
        check_resume_dir(self.checkpoint.run_dir, self.checkpoint.resume)
        if self.hf_folder is None:  # its sizes, MoE sizes without experts, a stage split
            check_pipeline_split(self.parallelism, self.model_config().n_layers)
        if t.device not in DEVICES:
            raise ConfigError(f"device {t.device!r} is not {' or '.join(DEVICES)}")
        try:
            self.policy  # noqa: B018  (the formats agree: a bf16 stream needs bf16 compute)
        except PrecisionError as e:
            raise ConfigError(str(e)) from None
        check_fp8(self.precision.fp8)
        for name in ("steps", "micro_batch", "global_batch", "seq_len"):
            if getattr(t, name) < 1:
                raise ConfigError(f"{name}={getattr(t, name)} must be at least 1")
        d, c, z, _, _ = grid
        shards = d * z * t.micro_batch
        if t.global_batch % shards:
            raise ConfigError(
                f"global_batch={t.global_batch} is not divisible by "
                f"G_data*G_z*micro_batch = {d}*{z}*{t.micro_batch} = {shards}: "
                "change --global-batch or --micro-batch"
            )
        check_parallelism(self.parallelism, t.seq_len)
        check_training(t)
        check_pipeline(self.parallelism, self.grad_accum)
        c = self.checkpoint
        for name in ("checkpoint_every", "keep_last", "max_restarts"):
            if getattr(c, name) < 0:
                raise ConfigError(f"{name}={getattr(c, name)} must be 0 or more")
        for name in ("log_every", "val_every"):
            if getattr(self.logging, name) < 1:
                raise ConfigError(f"{name}={getattr(self.logging, name)} must be at least 1")
        if self.logging.val_batches < 0:
            raise ConfigError(f"val_batches={self.logging.val_batches} must be 0 or more")
        if not 0.0 < self.data.val_fraction < 0.5:
            raise ConfigError(f"val_fraction={self.data.val_fraction} must lie in (0, 0.5)")
        if self.data.workers < 0:
            raise ConfigError(f"workers={self.data.workers} must be 0 (this process) or more")
        par = self.parallelism
        try:
            overlaps = par.overlaps
        except TetradError as e:
            raise ConfigError(str(e)) from None
        check_conflicts(
            Settings(
                overlaps=overlaps,
                fine_chunks=par.fine_chunks,
                context_pieces=par.context_pieces,
                context=grid[1],
                nproc=par.nproc,
                ranks=par.pipe * math.prod(grid),
                sequence_parallel=par.sequence_parallel,
                sequence_parallel_regather=par.sequence_parallel_regather,
            )
        )
        self.logging.profile_range()

    @property
    def grad_accum(self) -> int:
        """Micro-steps per optimizer step."""
        d, _, z, _, _ = self.parallelism.grid
        return self.training.global_batch // (d * z * self.training.micro_batch)


# ---- fields, options, values -----------------------------------------------------------------

SECTIONS: dict[str, type] = {
    f.name: f.default_factory
    for f in dataclasses.fields(TrainConfig)  # type: ignore[misc]
}


@dataclass(frozen=True)
class _Field:
    section: str
    name: str  # the field name (the key inside its TOML table)
    option: str  # the command-line option and flat key
    kind: Any  # the resolved type hint
    help: str  # one line, with the default
    metavar: str | None


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _fields() -> list[_Field]:
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if "help" not in meta:
                continue
            default = _default(f)
            if isinstance(default, tuple):
                default = ",".join(map(str, default))
            shown = f" (default: {default})" if default not in ("", [], 0) else ""
            option = meta["option"] or f.name
            kind = hints[f.name]
            out.append(_Field(section, f.name, option, kind, meta["help"] + shown, meta["metavar"]))
    return out


FIELDS = _fields()
BY_OPTION = {f.option: f for f in FIELDS}
RENAMED = {"ckpt_every": "checkpoint_every"}  # keys of older config files


def _literal_choices(kind: Any) -> tuple | None:
    if typing.get_origin(kind) is Literal:
        return typing.get_args(kind)
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one option per configuration field, grouped by section (unset options are None)."""
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file of training settings")
    groups = {
        name: parser.add_argument_group(f"[{name}]", (cls.__doc__ or "").strip())
        for name, cls in SECTIONS.items()
    }
    for f in FIELDS:
        kw: dict[str, Any] = {"dest": f.option, "help": f.help, "default": None}
        if f.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(f.kind) is list:
            kw.update(action="append", metavar=f.metavar)
        elif _literal_choices(f.kind):
            kw["choices"] = _literal_choices(f.kind)
        else:
            kw.update(type=f.kind if f.kind in (int, float) else str, metavar=f.metavar)
        groups[f.section].add_argument("--" + f.option.replace("_", "-"), **kw)


def overrides(args: argparse.Namespace) -> dict:
    """The options given on the command line, as :func:`load_config` overrides."""
    return {f.option: getattr(args, f.option, None) for f in FIELDS}


_KIND_WORDS = {int: "a whole number", float: "a number", str: "text"}


def _coerce(f: _Field, value: Any) -> Any:
    """``value`` (from TOML or the command line) as the type of field ``f``."""
    kind, name = f.kind, f.option
    if name == "grid":
        return "auto" if str(value).strip() == "auto" else parse_grid(value)
    if typing.get_origin(kind) is list:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}={value!r} is not a path or a list of paths (strings)")
        return list(value)
    if isinstance(value, list | dict):
        raise ConfigError(f"{name}={value!r} is one value, not a list or a table")
    if isinstance(value, bool) and kind in (int, float):
        raise ConfigError(f"{name}={value!r} is not {_KIND_WORDS[kind]}")
    choices = _literal_choices(kind)
    if choices is not None:
        if value not in choices:
            raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}")
        return value
    if kind is bool:
        text = str(value).lower()
        if isinstance(value, bool) or text in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value if isinstance(value, bool) else text in ("1", "true", "yes", "on")
        raise ConfigError(f"{name}={value!r} is not true or false")
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{name}={value!r} is not a whole number")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name}={value!r} is not {_KIND_WORDS.get(kind, kind.__name__)}"
        ) from None


def _unknown(key: str, where: str, choices: list[str]) -> ConfigError:
    near = difflib.get_close_matches(key, choices, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"unknown config key {key!r}{where}{hint}: remove or rename it")


class _Builder:
    """Collects values per section from TOML tables, flat keys and overrides."""

    def __init__(self, path: str | None):
        self.where = f" in {path}" if path else ""
        self.values: dict[str, dict] = {name: {} for name in SECTIONS}
        self.sizes: dict = {}
        self.experts: dict[str, int] = {}  # this layer's expert=N of --grid, --expert-parallel

    def layer(self) -> None:
        """End one layer of settings (the file, then the command line): expert=N in its grid
        and its --expert-parallel must agree (:mod:`tetrad.spec.conflicts`).

        Raises:
            ConflictError: they differ.
        """
        grid, option = self.experts.get("grid"), self.experts.get("option")
        self.experts = {}
        check_conflicts(Settings(grid_expert=grid, expert_parallel=option))

    def table(self, section: str, table: dict) -> None:
        """A ``[section]`` table of field names (``[model]``: ``name`` and sizes)."""
        for key, value in table.items():
            key = RENAMED.get(key, key)
            f = next(
                (g for g in FIELDS if g.section == section and key in (g.name, g.option)), None
            )
            if f is None and section == "model":
                self.sizes[key] = value
                continue
            if f is None:
                other = next((g for g in FIELDS if key in (g.name, g.option)), None)
                if other is not None:
                    named = f" as {other.name!r}" if other.name != key else ""
                    raise ConfigError(
                        f"config key {key!r}{self.where} belongs in [{other.section}]{named}, "
                        f"not [{section}]: move it"
                    )
                names = [g.name for g in FIELDS if g.section == section]
                raise _unknown(key, f"{self.where} [{section}]", names)
            self.set(f, value)

    def flat(self, key: str, value: Any) -> None:
        """A top-level key: a section table, or an option (the flat form)."""
        name = key.replace("-", "_")
        name = RENAMED.get(name, name)
        if name in SECTIONS and isinstance(value, dict):
            self.table(name, value)
        elif name == "model_sizes" and isinstance(value, dict):  # config.json before sections
            self.sizes.update(value)
        elif name in BY_OPTION:
            self.set(BY_OPTION[name], value)
        else:
            raise _unknown(key, self.where, [*BY_OPTION, *SECTIONS])

    def set(self, f: _Field, value: Any) -> None:
        if f.option == "grid" and isinstance(value, str) and "expert=" in value.replace(" ", ""):
            value, expert = pop_expert(value)  # expert=N sets expert_parallel
            self.set(BY_OPTION["expert_parallel"], expert)
            self.experts["grid"] = self.experts.pop("option")
        if f.option == "expert_parallel":
            self.experts["option"] = _coerce(f, value)
        if f.option == "grid" and str(value).strip() != "auto":  # it may carry G_pipe
            pipe, value = parse_pipeline_grid(value)
            self.values["parallelism"]["pipe"] = pipe
        self.values[f.section][f.name] = _coerce(f, value)

    def build(self) -> TrainConfig:
        self.values["model"]["sizes"] = self.sizes
        cfg = TrainConfig(**{name: SECTIONS[name](**v) for name, v in self.values.items()})
        par = cfg.parallelism
        if par.grid == "auto":  # the planner chooses the pipeline: its options would be ignored
            schedule, virtual = par.pipeline_schedule, par.virtual_stages
            check_conflicts(Settings(pipe=None, pipeline_schedule=schedule, virtual_stages=virtual))
        folder = cfg.hf_folder
        if folder is not None and not cfg.data.tokenizer and (folder / "tokenizer.json").is_file():
            cfg.data.tokenizer = str(folder / "tokenizer.json")  # the model's own vocabulary
        return cfg


def read_toml(path: str) -> dict:
    """The parsed TOML file at ``path``.

    Raises:
        ConfigError: the file is missing or not valid TOML.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist: check the --config path")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def load_config(path: str | None = None, overrides: dict | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from a TOML file and option overrides (which win).

    Args:
        path: a TOML file of section tables (or the flat form of ``option = value`` keys).
        overrides: ``{option: value}`` (``None`` values are ignored), e.g. from
            :func:`overrides` of parsed command-line options.

    Raises:
        ConfigError: missing or unparsable file, unknown key (with the closest known one), a
            key in the wrong section, or a value of the wrong type.
        ConflictError: expert=N in a named grid and another --expert-parallel given together.
    """
    builder = _Builder(path)
    for key, value in (read_toml(path) if path else {}).items():
        builder.flat(key, value)
    builder.layer()
    for key, value in (overrides or {}).items():
        if value is not None:
            builder.flat(key, value)
    builder.layer()
    return builder.build()
