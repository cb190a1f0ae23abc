"""Training configuration: one dataclass, loaded from TOML, overridden from the command line."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path

from tetrad.models.config import ModelConfig, parse_model, with_sizes
from tetrad.spec import parse_grid, parse_overlaps, tomllib

DEMO_GRID = (2, 1, 1, 2)


class ConfigError(ValueError):
    """A configuration file or value that tetrad cannot use; the message says what to change."""


@dataclass
class TrainConfig:
    """Everything one ``tetrad train`` run needs.

    Batch arithmetic: the ``global_batch`` samples of a step are split over ``G_data * G_z``
    ranks and each rank's share is processed ``micro_batch`` samples at a time, so
    ``global_batch % (G_data * G_z * micro_batch) == 0`` and there are
    ``global_batch / (G_data * G_z * micro_batch)`` gradient-accumulation micro-steps.
    """

    model: str = "small"  # preset, or preset/sizes string (see tetrad.models.config.parse_model)
    model_sizes: dict = field(default_factory=dict)  # the [model] table of a TOML file
    grid: tuple[int, int, int, int] | str = DEMO_GRID  # (G_data, G_z, G_y, G_x), or "auto"
    steps: int = 300  # optimizer steps of the whole run
    micro_batch: int = 4  # samples per rank per micro-step
    global_batch: int = 16  # samples per optimizer step
    seq_len: int = 256  # tokens per sample
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # learning rate at the end of the cosine decay
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm (0 disables)
    seed: int = 1234
    data: list[str] = field(default_factory=list)  # files, folders or globs; empty: stdlib
    tokenizer: str = ""  # a tokenizer.json; empty: train a byte-level BPE on the corpus
    vocab_size: int = 4096  # size of the trained tokenizer
    val_fraction: float = 0.01  # share of the corpus held out for validation
    run_dir: str = "runs/demo"
    device: str = "cpu"  # cpu (gloo, fp32) or cuda (NCCL, bf16 autocast)
    activation_checkpointing: bool = False
    log_every: int = 10  # steps between log lines
    val_every: int = 50  # steps between validations (and at the end)
    val_batches: int = 4  # global batches per validation
    ckpt_every: int = 0  # steps between checkpoints (0: only at the end)
    resume: bool = False  # continue from the latest checkpoint in run_dir
    peak_flops: float = 0.0  # peak FLOP/s per rank for MFU (0: look up or measure)
    overlap: str = "all"  # all, none, or a comma-separated list (tetrad.parallel.overlap)
    dp_bucket_mb: float = 4.0  # data-parallel all-reduce bucket size, MiB
    domino_min_rows: int = 256  # split a forward GEMM + all-reduce only above 2x this many rows
    profile_steps: str = ""  # "A:B": torch.profiler trace of steps A..B into run_dir
    machine: str = ""  # planner machine (preset or `tetrad calibrate` TOML) for grid "auto"
    nproc: int = 0  # processes for grid "auto" without torchrun (0: GPUs, or 4 on CPU)

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The model sizes: ``model`` string, then the ``[model]`` table, then the vocabulary.

        A vocabulary taken from the tokenizer (model ``vocab_size`` 0) is padded up to a
        multiple of ``lcm(128, G_y*G_z)`` so the embedding and LM head divide over the grid
        (as Megatron-LM pads its vocabulary); padding ids never occur in the data.
        """
        cfg: ModelConfig = with_sizes(parse_model(self.model), self.model_sizes)
        if vocab_size is not None and cfg.vocab_size == 0:
            yz = 1 if self.grid == "auto" else self.grid[1] * self.grid[2]
            multiple = math.lcm(128, yz)
            cfg = dataclasses.replace(cfg, vocab_size=-(-vocab_size // multiple) * multiple)
        return cfg

    def check(self) -> None:
        """Validate values that need no model or data.

        Raises:
            ConfigError: one line saying which value to change.
        """
        if self.grid == "auto":
            raise ConfigError(
                "grid 'auto' must be resolved by the planner before training "
                "(tetrad train does this; see tetrad.train.auto.choose_grid)"
            )
        d, z, _, _ = self.grid
        shards = d * z * self.micro_batch
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device {self.device!r} is not cpu or cuda")
        for name in ("steps", "micro_batch", "global_batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if self.global_batch % shards:
            raise ConfigError(
                f"global_batch={self.global_batch} is not divisible by "
                f"G_data*G_z*micro_batch = {d}*{z}*{self.micro_batch} = {shards}: "
                "change --global-batch or --micro-batch"
            )
        if not 0.0 < self.val_fraction < 0.5:
            raise ConfigError(f"val_fraction={self.val_fraction} must lie in (0, 0.5)")
        try:
            parse_overlaps(self.overlap)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.profile_steps:
            self.profile_range()

    def profile_range(self) -> tuple[int, int] | None:
        """Steps ``(A, B)`` (1-based, inclusive) to profile, or None.

        Raises:
            ConfigError: not ``A:B`` with ``1 <= A <= B``.
        """
        if not self.profile_steps:
            return None
        try:
            a, b = (int(v) for v in self.profile_steps.split(":"))
        except ValueError:
            a = b = 0
        if not 1 <= a <= b:
            raise ConfigError(
                f"profile_steps={self.profile_steps!r} is not A:B with 1 <= A <= B "
                "(for example 5:7)"
            )
        return a, b

    @property
    def grad_accum(self) -> int:
        """Micro-steps per optimizer step."""
        return self.global_batch // (self.grid[0] * self.grid[1] * self.micro_batch)


def _coerce(name: str, value, kind):
    if name == "grid":
        return "auto" if str(value).strip() == "auto" else parse_grid(value)
    if name == "data":
        return [value] if isinstance(value, str) else [str(v) for v in value]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}={value!r} is not true or false")
    if kind in (int, float, str):
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{name}={value!r} is not a whole number")
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}={value!r} is not a {kind.__name__}") from None
    return value


_KINDS = {"int": int, "float": float, "str": str, "bool": bool}


def load_config(path: str | None = None, overrides: dict | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from a TOML file and command-line overrides (which win).

    The file holds top-level keys named like the fields (``steps = 100``, ``grid = "1,2,1,2"``)
    and an optional ``[model]`` table of model sizes (``dim = 512``).

    Raises:
        ConfigError: missing or unparsable file, unknown key (with the closest known one),
            or a value of the wrong type.
    """
    raw: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist: check the --config path")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    sizes = raw.pop("model_sizes", None) or {}
    if isinstance(raw.get("model"), dict):
        sizes = raw.pop("model")
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    values: dict = {"model_sizes": dict(sizes)}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in fields or name == "model_sizes":
            near = difflib.get_close_matches(name, fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            where = f" in {path}" if path else ""
            raise ConfigError(f"unknown config key {key!r}{where}{hint}: remove or rename it")
        kind = _KINDS.get(str(fields[name].type), None)
        values[name] = _coerce(name, value, kind)
    return TrainConfig(**values)
