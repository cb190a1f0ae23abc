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

from tetrad.models.moe_config import moe_grid_problem, moe_problems
from tetrad.plan.errors import PlanError
from tetrad.plan.model.grids import grid_problems
from tetrad.plan.model.presets import PRESETS as PLANNER_PRESETS
from tetrad.plan.model.spec import ModelSpec
from tetrad.spec import GridShape, TetradError


class ModelConfigError(TetradError):
    """A model size that is unknown, malformed or not divisible by the grid."""


def trainable(spec: ModelSpec) -> bool:
    """Whether tetrad's Llama implements ``spec``'s attention: heads of ``hidden / heads``, no
    multi-head latent attention."""
    return spec.head_dim * spec.n_heads == spec.hidden and not spec.kv_lora_rank


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

    Mixture of experts (:mod:`tetrad.models.moe`; all off by default, ``n_experts = 0`` is the
    dense Llama, unchanged):
        n_experts: routed experts ``E`` per MoE block (0: dense model).
        top_k: experts each token is routed to (``k``).
        expert_ffn_dim: SwiGLU inner size of one routed expert (0: ``ffn_dim``).
        shared_ffn_dim: inner size of the shared expert every token passes through (0: none;
            ``n_shared x width`` as Megatron's ``--moe-shared-expert-intermediate-size``).
        moe_every: block ``i`` (0-based) is an MoE block when ``(i + 1) % moe_every == 0``
            (Qwen3-MoE's ``decoder_sparse_step``) and ``i >= dense_layers`` (DeepSeek-V3's
            ``first_k_dense_replace``); the other blocks keep the dense ``ffn_dim`` SwiGLU.
        router_score: ``softmax`` (Mixtral, Qwen3-MoE) or ``sigmoid`` (DeepSeek-V3).
        router_renorm: divide the ``k`` routing weights by their sum.
        route_scale: multiply the routing weights by this (DeepSeek-V3: 2.5).
        aux_loss_coef: Switch/GShard load-balancing loss coefficient ``c`` per MoE block
            (balanced routing gives ``c``; :func:`tetrad.models.moe.load_balance_loss`).
        aux_loss_scope: ``sequence`` (statistics per sequence, DeepSeek-V3's sequence-wise
            loss: grid-independent) or ``batch`` (over the rank's micro-batch, Megatron's
            default ``aux_loss``: depends on the micro-batch split).
        bias_update_rate: aux-loss-free balancing rate ``gamma`` (DeepSeek-V3, arXiv
            2412.19437 section 2.1.2: 0.001); 0: no selection bias.
        qk_norm: RMSNorm of each query and key head (weights ``[head_dim]``) before RoPE, as
            Qwen3 (:class:`tetrad.models.llama.Attention`).
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
    n_experts: int = 0
    top_k: int = 2
    expert_ffn_dim: int = 0
    shared_ffn_dim: int = 0
    moe_every: int = 1
    dense_layers: int = 0
    router_score: str = "softmax"
    router_renorm: bool = True
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0
    aux_loss_scope: str = "sequence"
    bias_update_rate: float = 0.0
    qk_norm: bool = False

    def __post_init__(self) -> None:
        bad = moe_problems(self)
        if bad:
            raise ModelConfigError("mixture-of-experts sizes: " + "; ".join(bad))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        """Whether any block is a mixture-of-experts block."""
        return any(self.moe_block(i) for i in range(self.n_layers))

    @property
    def expert_dim(self) -> int:
        """Inner size of one routed expert (``expert_ffn_dim``, or ``ffn_dim`` when 0)."""
        return self.expert_ffn_dim or self.ffn_dim

    def moe_block(self, i: int) -> bool:
        """Whether block ``i`` (0-based) has the MoE feed-forward (see ``moe_every``)."""
        return self.n_experts > 0 and i >= self.dense_layers and (i + 1) % self.moe_every == 0

    def moe_blocks(self) -> int:
        """The number of MoE blocks ``L_m``."""
        return sum(self.moe_block(i) for i in range(self.n_layers))

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
        moe = (
            dict(
                n_experts=self.n_experts,
                top_k=self.top_k,
                expert_ffn=self.expert_dim,
                shared_ffn=self.shared_ffn_dim,
                dense_layers=self.dense_layers,
                moe_every=self.moe_every,
            )
            if self.is_moe
            else {}
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
                **moe,
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
        if not trainable(spec):
            raise ModelConfigError(
                f"{spec.name} has multi-head latent attention or heads of {spec.head_dim} (not "
                f"hidden/heads = {spec.hidden // spec.n_heads}), which tetrad's Llama does not "
                "implement yet"
            )
        moe = (
            dict(
                n_experts=spec.n_experts,
                top_k=spec.top_k,
                expert_ffn_dim=spec.expert_ffn,
                shared_ffn_dim=spec.shared_ffn,
                dense_layers=spec.dense_layers,
                moe_every=spec.moe_every,
            )
            if spec.n_experts
            else {}
        )
        return cls(
            dim=spec.hidden,
            n_layers=spec.n_layers,
            n_heads=spec.n_heads,
            n_kv_heads=spec.n_kv_heads,
            ffn_dim=spec.ffn_hidden,
            vocab_size=spec.vocab,
            rope_theta=spec.rope_theta,
            **moe,
        )

    def num_params(self) -> int:
        """Total parameter count (embedding and LM head untied; every expert):
        :meth:`ModelSpec.num_params`."""
        return self.spec().num_params()

    def active_params(self) -> int:
        """Parameters one token uses: :meth:`num_params` with each MoE block's routed experts
        counted ``top_k`` times instead of ``n_experts`` times."""
        spec = self.spec()
        unused = (self.n_experts - self.top_k) * 3 * self.dim * self.expert_dim
        return spec.num_params() - (spec.moe_layers * unused if self.is_moe else 0)

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
    # MoE for tests: 4 experts, top-2, a shared expert, block 0 dense.
    "moe-tiny": ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        vocab_size=256,
        n_experts=4,
        top_k=2,
        expert_ffn_dim=32,
        shared_ffn_dim=32,
        dense_layers=1,
        aux_loss_coef=0.01,
    ),
    # MoE for the CPU demo: the active parameters of `small` (8 experts of width 384, top-2:
    # each token runs 2 x 3 x 256 x 384 = 589,824 expert weights per block, `small`'s
    # 3 x 256 x 768; plus a 2,048-weight router). 5,253,376 active, 12,331,264 in all
    # (`small`: 5,245,184).
    "moe-small": ModelConfig(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=768,
        vocab_size=4096,
        n_experts=8,
        top_k=2,
        expert_ffn_dim=384,
        aux_loss_coef=0.01,
    ),
    **{
        name: ModelConfig.from_spec(spec)
        for name, spec in PLANNER_PRESETS.items()
        if spec.family == "llama" and trainable(spec)
    },
}
"""Named sizes. A preset's ``vocab_size`` is what the planner assumes; a training run takes the
vocabulary from its tokenizer unless the user sets ``vocab_size`` (``TrainConfig.model_config``)."""


def check_moe_grid(
    cfg: ModelConfig, grid: GridShape, pipe: int = 1, expert: int = 1, seq_len: int | None = None
) -> None:
    """Refuse a grid the MoE runtime (or ``qk_norm``) does not support yet
    (:func:`tetrad.models.moe_config.moe_grid_problem`).

    Raises:
        ModelConfigError: one line naming the grid to use instead.
    """
    problem = moe_grid_problem(cfg, grid, pipe, expert, seq_len)
    if problem:
        raise ModelConfigError(problem)


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
        kind = _KINDS.get(fields[k].type, int)
        try:
            out[k] = kind(v)
        except (TypeError, ValueError):
            raise ModelConfigError(f"model size {k}={v!r} is not a {kind.__name__}") from None
    return dataclasses.replace(base, **out)


def _bool(v) -> bool:
    """A bool from a bool, a number or ``true/false/yes/no/1/0``."""
    if isinstance(v, bool | int):
        return bool(v)
    low = str(v).strip().lower()
    if low in ("1", "true", "yes"):
        return True
    if low in ("0", "false", "no"):
        return False
    raise ValueError(v)


_bool.__name__ = "bool"
_KINDS = {"float": float, float: float, "str": str, str: str, "bool": _bool, bool: _bool}


def check_divisible(cfg: ModelConfig, grid: GridShape) -> None:
    """Check that every weight of ``cfg`` can be sharded on ``grid = (G_data, G_z, G_y, G_x)``:
    the planner's rule, :func:`tetrad.plan.model.grids.grid_problems`, and the MoE rules of
    :func:`tetrad.models.moe_config.moe_grid_problem`.

    Raises:
        ModelConfigError: one line listing every size that does not divide, and what to change.
    """
    check_moe_grid(cfg, grid)
    bad = grid_problems(cfg.spec(), grid)
    if bad:
        raise ModelConfigError(
            "model does not fit the grid: needs "
            + "; ".join(bad)
            + ": change the model sizes or the grid"
        )
