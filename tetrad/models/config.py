"""Llama model sizes: presets, user-given sizes, and the hand-off to the planner's description.

:class:`ModelConfig` names the sizes as the model code uses them. Everything that follows from
the sizes alone (parameter count, FLOPs per token, which grids shard the model) is computed once,
by the planner's :class:`tetrad.plan.model.spec.ModelSpec`, reached through
:meth:`ModelConfig.spec`.
Presets: ``tiny``, ``small`` and ``medium`` here, and every Llama preset of the planner
(``llama-1b``, ``llama-3-8b``, ...), taken from its table.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from tetrad.plan.errors import PlanError
from tetrad.plan.model.grids import grid_problems
from tetrad.plan.model.presets import PRESETS as PLANNER_PRESETS
from tetrad.plan.model.spec import ModelSpec
from tetrad.spec import GridShape, TetradError


class ModelConfigError(TetradError):
    """A model size that is unknown, malformed or not divisible by the grid."""


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a Llama-architecture decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention).

    Attributes:
        dim: hidden size ``h``.
        n_layers: transformer blocks.
        n_heads: query heads; ``head_dim = dim // n_heads``.
        n_kv_heads: key/value heads (grouped-query attention); divides ``n_heads``.
        ffn_dim: SwiGLU inner size.
        vocab_size: tokens in the vocabulary (0: not known yet, take it from the tokenizer).
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
        rope_factor: Llama 3.1's RoPE frequency scaling ``factor`` (1: no scaling), with
            ``rope_low_freq_factor``, ``rope_high_freq_factor`` and
            ``rope_original_positions`` (``original_max_position_embeddings``); see
            :func:`tetrad.models.llama.rope_frequencies`.
        unpadded_vocab: the real vocabulary when ``vocab_size`` is padded to divide the grid
            (0: no padding); the loss's softmax leaves the padding ids out.
    """

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 768
    vocab_size: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_positions: int = 8192
    unpadded_vocab: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def spec(self, name: str = "custom") -> ModelSpec:
        """The planner's description of this model (family ``llama``, untied LM head).

        Raises:
            ModelConfigError: sizes that describe no model (a vocabulary of 0, heads that do
                not divide the hidden size, ...).
        """
        if self.vocab_size < 1:
            raise ModelConfigError(
                f"vocab_size={self.vocab_size}: the vocabulary is not known yet (it is taken "
                "from the tokenizer when training starts); give vocab_size=N"
            )
        try:
            return ModelSpec(
                name=name,
                family="llama",
                hidden=self.dim,
                n_layers=self.n_layers,
                n_heads=self.n_heads,
                n_kv_heads=self.n_kv_heads,
                ffn_hidden=self.ffn_dim,
                vocab=self.vocab_size,
                rope_theta=self.rope_theta,
            )
        except PlanError as e:
            raise ModelConfigError(str(e)) from None

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelConfig:
        """The runtime's sizes of a planner description.

        Raises:
            ModelConfigError: not a model tetrad trains (a ``gpt`` family model, tied
                embeddings or learned positions).
        """
        if spec.family != "llama" or spec.tied_embeddings or spec.max_positions:
            raise ModelConfigError(
                f"{spec.name} is not a Llama with an untied LM head, which is what tetrad "
                "trains: choose a llama preset or give sizes"
            )
        return cls(
            dim=spec.hidden,
            n_layers=spec.n_layers,
            n_heads=spec.n_heads,
            n_kv_heads=spec.n_kv_heads,
            ffn_dim=spec.ffn_hidden,
            vocab_size=spec.vocab,
            rope_theta=spec.rope_theta,
        )

    def num_params(self) -> int:
        """Total parameter count (embedding and LM head untied): :meth:`ModelSpec.num_params`."""
        return self.spec().num_params()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward + backward, no recomputation:
        :meth:`ModelSpec.flops_per_token` (PaLM's ``6N + 12 L H Q T`` with the attention term
        halved for causal masking)."""
        return self.spec().flops_per_token(seq_len)


PRESETS: dict[str, ModelConfig] = {
    # For tests: every size divisible by 2 on every axis (and by 8 where it matters).
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256),
    # For the demo: a few million parameters, trains on 2 CPU cores in minutes.
    "small": ModelConfig(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=4096
    ),
    "medium": ModelConfig(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, vocab_size=4096
    ),
    **{
        name: ModelConfig.from_spec(spec)
        for name, spec in PLANNER_PRESETS.items()
        if spec.family == "llama"
    },
}
"""Named sizes. A preset's ``vocab_size`` is what the planner assumes; a training run takes the
vocabulary from its tokenizer unless the user sets ``vocab_size`` (``TrainConfig.model_config``)."""


def parse_model(text: str) -> tuple[ModelConfig, frozenset[str]]:
    """Parse ``"PRESET"``, ``"PRESET,key=value,..."`` or ``"key=value,..."`` (on ``small``).

    Example: ``small,n_layers=8`` or ``dim=512,n_heads=8,n_kv_heads=2,ffn_dim=1536``.
    Returns the sizes and the names of the sizes given explicitly.

    Raises:
        ModelConfigError: unknown preset or key, or a value that is not a number.
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    base = PRESETS["small"]
    if parts and "=" not in parts[0]:
        name = parts.pop(0)
        if name not in PRESETS:
            near = difflib.get_close_matches(name, PRESETS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ModelConfigError(
                f"unknown model {name!r}{hint}: use one of {', '.join(PRESETS)} "
                "or sizes like dim=256,n_layers=4"
            )
        base = PRESETS[name]
    sizes: dict[str, str] = {}
    for p in parts:
        if "=" not in p:
            raise ModelConfigError(f"model size {p!r} is not key=value (for example n_layers=8)")
        k, v = p.split("=", 1)
        sizes[k.strip()] = v.strip()
    return with_sizes(base, sizes), frozenset(sizes)


def with_sizes(base: ModelConfig, sizes: dict) -> ModelConfig:
    """Return ``base`` with the given fields replaced (values may be strings).

    Raises:
        ModelConfigError: an unknown field name or a value of the wrong type.
    """
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    out = {}
    for k, v in sizes.items():
        if k not in fields:
            near = difflib.get_close_matches(k, fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ModelConfigError(
                f"unknown model size {k!r}{hint}: known sizes are {', '.join(fields)}"
            )
        kind = float if fields[k].type in ("float", float) else int
        try:
            out[k] = kind(v)
        except (TypeError, ValueError):
            raise ModelConfigError(f"model size {k}={v!r} is not a {kind.__name__}") from None
    return dataclasses.replace(base, **out)


def check_divisible(cfg: ModelConfig, grid: GridShape) -> None:
    """Check that every weight of ``cfg`` can be sharded on ``grid = (G_data, G_z, G_y, G_x)``:
    the planner's rule, :func:`tetrad.plan.model.grids.grid_problems`.

    Raises:
        ModelConfigError: one line listing every size that does not divide, and what to change.
    """
    bad = grid_problems(cfg.spec(), grid)
    if bad:
        raise ModelConfigError(
            "model does not fit the grid: needs "
            + "; ".join(bad)
            + ": change the model sizes or the grid"
        )
