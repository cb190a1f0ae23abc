"""The planner's description of a model: its sizes, its GEMM layers, its parameter and FLOP
counts. Presets and how a model is named: :mod:`tetrad.plan.model.presets`; which grids shard
it: :mod:`tetrad.plan.model.grids`.

Plain Python (no torch), so the planner answers instantly anywhere.

Two families:

- ``llama``: pre-norm decoder with RMSNorm (one weight vector per norm), RoPE (no position
  table), SwiGLU MLP (``w2(silu(gate) * up)``, gate and up one Linear ``w13``) and
  grouped-query attention (q, k and v one Linear ``wqkv``); no biases; untied LM head unless
  ``tied_embeddings``. This is what tetrad's runtime trains
  (:mod:`tetrad.models.llama`).
- ``gpt``: AxoNN's GPT (Megatron-LM GPT as used in Singh et al., arXiv 2305.13525 and
  2502.08145): LayerNorm with weight and bias, learned position embeddings (``max_positions``
  rows), GeLU MLP of width ``4h``, biases on every linear of the blocks, no bias on the LM head,
  untied LM head.

Parameter counts (``h`` hidden, ``L`` layers, ``a`` heads, ``k`` KV heads, ``d = h/a`` head dim,
``f`` FFN width, ``V`` vocabulary, ``P`` positions):

    llama: L (2 h (a d) + 2 h (k d) + 3 h f + 2h) + h + V h + V h (LM head, if untied)
    gpt:   L (12 h^2 + 13 h) + (V + P) h + 2h + V h (LM head)          (with f = 4h)

Mixture of experts (llama only; ``E`` routed experts of width ``f_e``, top-``k``, a shared
expert of width ``f_s``, ``L_m`` MoE blocks): an MoE block replaces ``3 h f`` by the router
``E h``, the experts ``3 E h f_e`` and the shared expert ``3 h f_s``. FLOPs count the
*active* weights: ``E h + 3 k h f_e + 3 h f_s`` per MoE block (each token runs ``k`` experts).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from tetrad.plan.errors import PlanError

FAMILIES = ("gpt", "llama")


@dataclass(frozen=True)
class Linear:
    """One GEMM layer ``y = x W^T (+ b)`` with ``W [out_features, in_features]`` (``[n, k]``).

    Attributes:
        name: the layer's name inside a block (``wqkv``, ``w2``, ``qkv``, ``output``...).
        in_features: ``k``.
        out_features: ``n``.
        transposed: AxoNN orientation. Non-transposed layers take X-sharded inputs and give
            Y-sharded outputs (stored ``[n/(G_y G_z), k/G_x]``); transposed ones the reverse
            (stored ``[n/(G_x G_z), k/G_y]``).
        count: how many such layers one block has (always 1 for the presets).
        bias: whether the layer has a bias of ``n`` elements (GPT blocks).
    """

    name: str
    in_features: int
    out_features: int
    transposed: bool
    count: int = 1
    bias: bool = False

    @property
    def weight_elements(self) -> int:
        """Elements of one weight ``n * k``."""
        return self.in_features * self.out_features

    @property
    def params(self) -> int:
        """Parameters of all ``count`` layers (weights and biases)."""
        return self.count * (self.weight_elements + (self.out_features if self.bias else 0))


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a decoder-only transformer, as the planner needs them.

    Attributes:
        name: preset name or a label.
        family: ``"gpt"`` or ``"llama"`` (see the module docstring).
        hidden: ``h``.
        n_layers: ``L``.
        n_heads: ``a`` query heads; head dim ``h / a``.
        n_kv_heads: ``k`` key/value heads (``== a`` for GPT / multi-head attention).
        ffn_hidden: MLP inner width (GPT ``4h``; Llama its intermediate size).
        vocab: ``V`` (already padded).
        max_positions: rows of the learned position table (GPT); 0 for RoPE models.
        tied_embeddings: the LM head reuses the embedding table (no extra ``V h``).
        rope_theta: RoPE base (llama); the planner does not use it, the runtime builds its
            model from the same preset (:meth:`tetrad.models.config.ModelConfig.from_spec`).
        attn_head_dim: attention head size when it is not ``h / a`` (Qwen3: 128 with
            ``h / a = 64``); 0: ``h / a``.
        n_experts: routed experts ``E`` per MoE block (0: dense).
        top_k: experts per token ``k``.
        expert_ffn: inner width ``f_e`` of one routed expert.
        shared_ffn: inner width ``f_s`` of the shared expert (0: none).
        dense_layers: the first blocks keep the dense FFN (DeepSeek-V3: 3).
        moe_every: block ``i`` is an MoE block when ``(i + 1) % moe_every == 0`` and
            ``i >= dense_layers`` (Qwen3-MoE's ``decoder_sparse_step``).
        kv_lora_rank: multi-head latent attention (DeepSeek-V2/V3, arXiv 2405.04434 section
            2.1) when > 0: keys and values from a ``kv_lora_rank`` latent, queries from a
            ``q_lora_rank`` latent (0: a direct projection), ``rope_head_dim`` rotary features
            per head besides ``head_dim`` (the non-rotary part), values of ``v_head_dim``; the
            planner counts its parameters and FLOPs (tetrad's runtime does not implement it).
    """

    name: str
    family: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab: int
    max_positions: int = 0
    tied_embeddings: bool = False
    rope_theta: float = 10000.0
    attn_head_dim: int = 0
    n_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    dense_layers: int = 0
    moe_every: int = 1
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise PlanError(f"model family {self.family!r} is unknown: use 'llama' or 'gpt'")
        for f in ("hidden", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab"):
            if int(getattr(self, f)) <= 0:
                raise PlanError(f"model size {f}={getattr(self, f)} must be a positive integer")
        if self.max_positions < 0:
            raise PlanError(f"max_positions={self.max_positions} must be >= 0")
        if self.hidden % self.n_heads:
            raise PlanError(
                f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}: "
                "change one of them"
            )
        if self.n_heads % self.n_kv_heads:
            raise PlanError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: "
                "change one of them"
            )
        if self.family == "gpt" and self.n_kv_heads != self.n_heads:
            raise PlanError("a gpt model has n_kv_heads == n_heads: drop n_kv_heads")
        if self.n_experts:
            self._check_moe()

    def __hash__(self) -> int:
        """The hash of the fields, computed once per model: the planner's memoised functions
        key on the model, and a search asks them about a hundred thousand times."""
        got = self.__dict__.get("_hash")
        if got is None:
            got = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", got)
        return got

    def __getstate__(self) -> dict:
        """The fields, without the cached hash (strings hash differently in another
        process)."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def _check_moe(self) -> None:
        """Raise :class:`PlanError` for MoE sizes that describe no model."""
        if self.family != "llama":
            raise PlanError("mixture-of-experts sizes need family llama")
        if not 1 <= self.top_k <= self.n_experts:
            raise PlanError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if (
            self.expert_ffn <= 0
            or self.moe_every < 1
            or min(self.shared_ffn, self.dense_layers) < 0
        ):
            raise PlanError(
                f"MoE sizes expert_ffn={self.expert_ffn} (> 0), moe_every={self.moe_every} "
                f"(>= 1), shared_ffn={self.shared_ffn}, dense_layers={self.dense_layers} (>= 0)"
            )

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        """``d = h / a`` (or ``attn_head_dim`` when given)."""
        return self.attn_head_dim or self.hidden // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection ``a * d`` (equals ``h`` unless ``attn_head_dim``)."""
        return self.n_heads * self.head_dim

    # ---- mixture of experts ------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        """Whether any block is an MoE block."""
        return self.moe_layers > 0

    def moe_block(self, i: int) -> bool:
        """Whether block ``i`` (0-based) is an MoE block (see ``moe_every``)."""
        return self.n_experts > 0 and i >= self.dense_layers and (i + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        """MoE blocks ``L_m``."""
        if not self.n_experts:
            return 0  # a dense model (the planner asks often)
        return sum(self.moe_block(i) for i in range(self.n_layers))

    @property
    def dense_blocks(self) -> int:
        """Blocks with the dense ``ffn_hidden`` SwiGLU: ``L - L_m``."""
        return self.n_layers - self.moe_layers

    def attention_linears(self) -> list[Linear]:
        """The attention GEMMs of one block (``wqkv``, ``wo``, or MLA's)."""
        return [lin for lin in self.linears() if lin.name not in ("w13", "w2", "fc1", "fc2")]

    def latent_norm_params(self) -> int:
        """MLA's norms of the query and key/value latents per block (0 without MLA)."""
        return self.q_lora_rank + self.kv_lora_rank if self.kv_lora_rank else 0

    def attention_width(self) -> int:
        """Per-token width of the score and value products, ``a d`` (MLA: the mean of the
        query/key width ``a (d + d_rope)`` and the value width ``a d_v``)."""
        if not self.kv_lora_rank:
            return self.q_dim
        return self.n_heads * (self.head_dim + self.rope_head_dim + self.v_head_dim) // 2

    def shared_linears(self) -> list[Linear]:
        """The shared expert's GEMMs of one MoE block (sharded like the dense FFN's)."""
        if not self.shared_ffn:
            return []
        h, f = self.hidden, self.shared_ffn
        return [Linear("shared.w13", h, 2 * f, False), Linear("shared.w2", f, h, True)]

    def router_params(self) -> int:
        """Router weight of one MoE block ``E h``."""
        return self.n_experts * self.hidden

    def expert_params(self) -> int:
        """Routed-expert weights of one MoE block ``3 E h f_e`` (total, not active)."""
        return 3 * self.n_experts * self.hidden * self.expert_ffn

    def moe_params_per_layer(self) -> int:
        """Parameters of one MoE block: attention, router, experts, shared expert, two norms."""
        lins = self.attention_linears() + self.shared_linears()
        return (
            sum(lin.params for lin in lins)
            + self.router_params()
            + self.expert_params()
            + 2 * self.norm_params()
            + self.latent_norm_params()
        )

    def active_moe_matmul_params(self) -> int:
        """Weights one token multiplies in an MoE block: attention, router, its ``k`` experts
        ``3 k h f_e`` and the shared expert."""
        lins = self.attention_linears() + self.shared_linears()
        return (
            sum(lin.count * lin.weight_elements for lin in lins)
            + self.router_params()
            + 3 * self.top_k * self.hidden * self.expert_ffn
        )

    @property
    def kv_dim(self) -> int:
        """Width of one of the key or value projections ``k * d``."""
        return self.n_kv_heads * self.head_dim

    def linears(self) -> list[Linear]:
        """The GEMM layers of ONE block, in execution order.

        llama: ``wqkv`` (h->(a + 2k) d, q, k and v fused), ``wo`` (a d->h, transposed), ``w13``
        (h->2f, SwiGLU's gate and up fused), ``w2`` (f->h, transposed). gpt: ``qkv`` (h->3h),
        ``proj`` (h->h, transposed), ``fc1`` (h->4h), ``fc2`` (4h->h, transposed), all with
        biases.
        """
        return list(_block_linears(self))

    def lm_head(self) -> Linear:
        """The LM head ``output`` (h->V, non-transposed, no bias): logits come out Y-sharded."""
        return Linear("output", self.hidden, self.vocab, False)

    def norm_params(self) -> int:
        """Parameters of one norm: RMSNorm ``h`` (weight), LayerNorm ``2h`` (weight, bias)."""
        return 2 * self.hidden if self.family == "gpt" else self.hidden

    def params_per_layer(self) -> int:
        """Parameters of one block: its linears (with biases) and its two norms (and MLA's
        latent norms)."""
        return (
            sum(lin.params for lin in self.linears())
            + 2 * self.norm_params()
            + self.latent_norm_params()
        )

    def embedding_params(self) -> int:
        """Token table ``V h`` plus the learned position table ``P h`` (GPT)."""
        return (self.vocab + self.max_positions) * self.hidden

    def lm_head_params(self) -> int:
        """``V h`` for an untied LM head, 0 when tied to the embedding."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def num_params(self) -> int:
        """Exact total parameter count (every expert counted)."""
        return (
            self.dense_blocks * self.params_per_layer()
            + self.moe_layers * (self.moe_params_per_layer() if self.is_moe else 0)
            + self.embedding_params()
            + self.norm_params()
            + self.lm_head_params()
        )

    def matmul_params(self) -> int:
        """Weights used in a GEMM per token: block linears (no biases) and the LM head (the
        embedding lookup is not a GEMM); in MoE blocks the active ones only
        (:meth:`active_moe_matmul_params`)."""
        block = sum(lin.count * lin.weight_elements for lin in self.linears())
        moe = self.moe_layers * self.active_moe_matmul_params() if self.is_moe else 0
        return self.dense_blocks * block + moe + self.vocab * self.hidden

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward + backward, no recomputation:
        ``6 * matmul_params + 6 * L * S * (a d)``.

        The PaLM estimate (Chowdhery et al. 2022, appendix B, ``6N + 12 L H Q T``) with the
        attention term halved for causal masking; the same rule as
        ``tetrad.models.config.ModelConfig.flops_per_token``.
        """
        return 6.0 * self.matmul_params() + 6.0 * self.n_layers * seq_len * self.attention_width()

    def summary(self) -> str:
        """One line: name, family, billions of parameters and the sizes."""
        moe = (
            f" experts={self.n_experts}x{self.expert_ffn} top-{self.top_k} "
            f"(MoE blocks {self.moe_layers})"
            if self.is_moe
            else ""
        )
        return (
            f"{self.name} ({self.family}, {self.num_params() / 1e9:.2f}B): h={self.hidden} "
            f"L={self.n_layers} heads={self.n_heads}/{self.n_kv_heads} "
            f"ffn={self.ffn_hidden} V={self.vocab}{moe}"
        )


@functools.lru_cache(maxsize=256)
def _block_linears(model: ModelSpec) -> tuple[Linear, ...]:
    """:meth:`ModelSpec.linears`, built once per model (the planner asks for them per candidate)."""
    h, f = model.hidden, model.ffn_hidden
    if model.family == "gpt":
        return (
            Linear("qkv", h, 3 * model.q_dim, False, bias=True),
            Linear("proj", model.q_dim, h, True, bias=True),
            Linear("fc1", h, f, False, bias=True),
            Linear("fc2", f, h, True, bias=True),
        )
    ffn = (Linear("w13", h, 2 * f, False), Linear("w2", f, h, True))
    if model.kv_lora_rank:
        return (*_mla_linears(model), *ffn)
    return (
        Linear("wqkv", h, model.q_dim + 2 * model.kv_dim, False),
        Linear("wo", model.q_dim, h, True),
        *ffn,
    )


def _mla_linears(model: ModelSpec) -> tuple[Linear, ...]:
    """Multi-head latent attention's GEMMs (DeepSeek-V3 ``inference/model.py``, ``MLA``):
    ``wq_a`` h->q_lora, ``wq_b`` q_lora->a (d + d_rope) (or ``wq`` h->a (d + d_rope)),
    ``wkv_a`` h->kv_lora + d_rope, ``wkv_b`` kv_lora->a (d + d_v), ``wo`` a d_v->h."""
    h, a, d = model.hidden, model.n_heads, model.head_dim
    r, v, q, kv = model.rope_head_dim, model.v_head_dim, model.q_lora_rank, model.kv_lora_rank
    queries = (
        (Linear("wq_a", h, q, False), Linear("wq_b", q, a * (d + r), True))
        if q
        else (Linear("wq", h, a * (d + r), False),)
    )
    return (
        *queries,
        Linear("wkv_a", h, kv + r, False),
        Linear("wkv_b", kv, a * (d + v), True),
        Linear("wo", a * v, h, True),
    )
