"""The one description of a model, shared by the runtime and the planner: its sizes (one set of
names), its GEMM layers, its parameter and FLOP counts, and the checks that say which sizes
describe a model. Named presets and how ``--model`` is read: :mod:`tetrad.spec.presets`; which
grids shard a model: :mod:`tetrad.spec.sharding`.

Plain Python (no torch), so the planner answers instantly anywhere.

Two families:

- ``llama``: pre-norm decoder with RMSNorm (one weight vector per norm), RoPE (no position
  table), SwiGLU MLP (``w2(silu(gate) * up)``, gate and up one Linear ``w13``) and
  grouped-query attention (q, k and v one Linear ``wqkv``); no biases; untied LM head unless
  ``tied_embeddings``. This is what tetrad's runtime trains (:mod:`tetrad.models.llama`;
  :func:`check_trainable` says which llama sizes it implements).
- ``gpt``: AxoNN's GPT (Megatron-LM GPT as used in Singh et al., arXiv 2305.13525 and
  2502.08145): LayerNorm with weight and bias, learned position embeddings (``max_positions``
  rows), GeLU MLP of width ``4h``, biases on every linear of the blocks, no bias on the LM head,
  untied LM head. The planner models it; the runtime does not train it.

Parameter counts (``h`` = ``dim`` hidden, ``L`` layers, ``a`` heads, ``k`` KV heads, ``d = h/a``
head dim, ``f`` = ``ffn_dim`` FFN width, ``V`` = ``vocab_size``, ``P`` positions):

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

from tetrad.spec.errors import TetradError

FAMILIES = ("gpt", "llama")
ROUTER_SCORES = ("softmax", "sigmoid")
AUX_LOSS_SCOPES = ("sequence", "batch")


class ModelError(TetradError):
    """Model sizes that are unknown, malformed, describe no model, or describe one tetrad's
    runtime does not train."""


_MOE_LEAST = {
    "n_experts": 0,
    "dense_layers": 0,
    "moe_every": 1,
    "expert_ffn_dim": 0,
    "shared_ffn_dim": 0,
    "route_scale": 0,
    "aux_loss_coef": 0,
    "bias_update_rate": 0,
    "router_z_loss_coef": 0,
}
"""The least value of each mixture-of-experts size (``route_scale`` must also be above 0)."""


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
        stacked: how many matrices of ``n / stacked`` rows the weight stacks, each split over
            the output axis and Z alike (Llama's ``w13``: gate and up, 2;
            tetrad/parallel/placement.py ``Placement.stacked``).
    """

    name: str
    in_features: int
    out_features: int
    transposed: bool
    count: int = 1
    bias: bool = False
    stacked: int = 1

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
    """Sizes of a decoder-only transformer: what the runtime builds and the planner models.

    Attributes:
        name: preset name or a label (``small``, ``llama-3.1-8b,n_layers=16``, ``custom``).
        family: ``"llama"`` or ``"gpt"`` (see the module docstring).
        dim: hidden size ``h``.
        n_layers: transformer blocks ``L``.
        n_heads: query heads ``a``; head dim ``h / a`` unless ``attn_head_dim``.
        n_kv_heads: key/value heads ``k`` (grouped-query attention; ``== a`` for GPT).
        ffn_dim: MLP inner width ``f`` (GPT ``4h``; Llama's SwiGLU intermediate size).
        vocab_size: ``V`` tokens (padded to divide the grid; 0: not known yet, a training run
            takes it from its tokenizer).
        max_positions: rows of the learned position table (GPT); 0 for RoPE models.
        tied_embeddings: the LM head reuses the embedding table (no extra ``V h``).
        rope_theta: RoPE base (llama).
        norm_eps: RMSNorm epsilon.
        rope_factor: Llama 3.1's RoPE frequency scaling ``factor`` (1: no scaling), with
            ``rope_low_freq_factor``, ``rope_high_freq_factor`` and
            ``rope_original_positions`` (``original_max_position_embeddings``); see
            :func:`tetrad.models.llama.rope_frequencies`.
        unpadded_vocab: the real vocabulary when ``vocab_size`` is padded to divide the grid
            (0: no padding); the loss's softmax leaves the padding ids out.
        attn_head_dim: attention head size when it is not ``h / a`` (Qwen3: 128 with
            ``h / a = 64``); 0: ``h / a``. The planner models it; the runtime does not train it.
        qk_norm: RMSNorm of each query and key head (weights ``[head_dim]``) before RoPE, as
            Qwen3 (:class:`tetrad.models.llama.Attention`).

    Mixture of experts (off by default: ``n_experts = 0`` is the dense model):
        n_experts: routed experts ``E`` per MoE block.
        top_k: experts each token is routed to (``k``).
        expert_ffn_dim: inner width ``f_e`` of one routed expert (0: ``ffn_dim``; read it as
            :attr:`expert_dim`).
        shared_ffn_dim: inner width ``f_s`` of the shared expert every token passes through (0:
            none; ``n_shared x width`` as Megatron's ``--moe-shared-expert-intermediate-size``).
        dense_layers: the first blocks keep the dense FFN (DeepSeek-V3's
            ``first_k_dense_replace``: 3).
        moe_every: block ``i`` (0-based) is an MoE block when ``(i + 1) % moe_every == 0`` and
            ``i >= dense_layers`` (Qwen3-MoE's ``decoder_sparse_step``).
        router_score: ``softmax`` (Mixtral, Qwen3-MoE) or ``sigmoid`` (DeepSeek-V3).
        router_renorm: divide the ``k`` routing weights by their sum (refused with
            ``top_k = 1``: the weight is then 1.0 and the router gets no gradient).
        route_scale: multiply the routing weights by this (DeepSeek-V3: 2.5).
        aux_loss_coef: Switch/GShard load-balancing loss coefficient ``c`` per MoE block
            (balanced routing gives ``c``; :func:`tetrad.models.moe.load_balance_loss`).
        aux_loss_scope: ``sequence`` (statistics per sequence, DeepSeek-V3's sequence-wise
            loss: grid-independent) or ``batch`` (over the rank's micro-batch, Megatron's
            default ``aux_loss``: depends on the micro-batch split).
        router_z_loss_coef: router z-loss coefficient per MoE block (ST-MoE, arXiv 2202.08906,
            eq. 5: the mean over tokens of the squared log-sum-exp of the router logits,
            :func:`tetrad.models.moe.router_z_loss`; ST-MoE uses 0.001); 0: off.
        bias_update_rate: aux-loss-free balancing rate ``gamma`` (DeepSeek-V3, arXiv
            2412.19437 section 2.1.2: 0.001); 0: no selection bias.

    Multi-head latent attention (DeepSeek-V2/V3, arXiv 2405.04434 section 2.1; the planner
    counts its parameters and FLOPs, the runtime does not implement it):
        kv_lora_rank: when > 0, keys and values from a ``kv_lora_rank`` latent;
        q_lora_rank: queries from a ``q_lora_rank`` latent (0: a direct projection);
        rope_head_dim: rotary features per head besides ``head_dim`` (the non-rotary part);
        v_head_dim: width of the values per head.

    Raises:
        ModelError: sizes that describe no model (see :meth:`problems`).
    """

    name: str = "custom"
    family: str = "llama"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 768
    vocab_size: int = 0
    max_positions: int = 0
    tied_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_positions: int = 8192
    unpadded_vocab: int = 0
    attn_head_dim: int = 0
    qk_norm: bool = False
    n_experts: int = 0
    top_k: int = 2
    expert_ffn_dim: int = 0
    shared_ffn_dim: int = 0
    dense_layers: int = 0
    moe_every: int = 1
    router_score: str = "softmax"
    router_renorm: bool = True
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0
    aux_loss_scope: str = "sequence"
    router_z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        bad = self.problems()
        if bad:
            raise ModelError(f"model {self.name}: " + "; ".join(bad))

    def problems(self) -> list[str]:
        """What is wrong with these sizes, each with what to change (empty: nothing)."""
        if self.family not in FAMILIES:
            return [f"family {self.family!r} is unknown: use 'llama' or 'gpt'"]
        for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if int(getattr(self, f)) <= 0:
                return [f"size {f}={getattr(self, f)} must be a positive integer"]
        for f in ("vocab_size", "max_positions"):
            if getattr(self, f) < 0:
                return [f"size {f}={getattr(self, f)} must be 0 (from the data) or more"]
        if self.dim % self.n_heads:
            return [f"dim={self.dim} is not divisible by n_heads={self.n_heads}: change one"]
        if self.n_heads % self.n_kv_heads:
            return [
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: "
                "change one of them"
            ]
        if self.family == "gpt" and self.n_kv_heads != self.n_heads:
            return ["a gpt model has n_kv_heads == n_heads: drop n_kv_heads"]
        return self._moe_problems()

    def _moe_problems(self) -> list[str]:
        """What is wrong with the mixture-of-experts sizes (a dense model with the default
        fields has nothing wrong)."""
        bad = []
        if self.router_score not in ROUTER_SCORES:
            bad.append(
                f"router_score={self.router_score!r} is not one of {', '.join(ROUTER_SCORES)}"
            )
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            bad.append(
                f"aux_loss_scope={self.aux_loss_scope!r} is not one of {', '.join(AUX_LOSS_SCOPES)}"
            )
        for name, least in _MOE_LEAST.items():
            value = getattr(self, name)
            if value < least or (name == "route_scale" and value == 0):
                bound = "positive" if name == "route_scale" else f"at least {least}"
                bad.append(f"{name}={value} must be {bound}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            bad.append(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        elif self.n_experts and self.top_k == 1 and self.router_renorm:
            # the one weight divided by itself is 1.0 for every token: no gradient reaches the
            # router from the LM loss (issue 47 measured 3e-6 against 27 with top-2)
            bad.append(
                "top_k=1 with router_renorm=true gives every token the weight 1.0, so the router "
                "learns nothing from the loss: set router_renorm=false (Switch) or top_k=2"
            )
        if self.n_experts and self.family != "llama":
            bad.append("mixture-of-experts sizes need family llama")
        return bad

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
        process) and block count."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_moe_layers")}

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        """``d = h / a`` (or ``attn_head_dim`` when given)."""
        return self.attn_head_dim or self.dim // self.n_heads

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
        """MoE blocks ``L_m`` (counted once per model: the planner asks often)."""
        if not self.n_experts:
            return 0  # a dense model
        got = self.__dict__.get("_moe_layers")
        if got is None:
            got = sum(self.moe_block(i) for i in range(self.n_layers))
            object.__setattr__(self, "_moe_layers", got)
        return got

    @property
    def expert_dim(self) -> int:
        """Inner width ``f_e`` of one routed expert: ``expert_ffn_dim``, or ``ffn_dim`` when 0."""
        return self.expert_ffn_dim or self.ffn_dim

    @property
    def dense_blocks(self) -> int:
        """Blocks with the dense ``ffn_dim`` SwiGLU: ``L - L_m``."""
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
        if not self.shared_ffn_dim:
            return []
        h, f = self.dim, self.shared_ffn_dim
        return [
            Linear("shared.w13", h, 2 * f, False, stacked=2),
            Linear("shared.w2", f, h, True),
        ]

    def router_params(self) -> int:
        """Router weight of one MoE block ``E h``."""
        return self.n_experts * self.dim

    def expert_params(self) -> int:
        """Routed-expert weights of one MoE block ``3 E h f_e`` (total, not active)."""
        return 3 * self.n_experts * self.dim * self.expert_dim

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
            + 3 * self.top_k * self.dim * self.expert_dim
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
        return Linear("output", self.dim, self.vocab_size, False)

    def norm_params(self) -> int:
        """Parameters of one norm: RMSNorm ``h`` (weight), LayerNorm ``2h`` (weight, bias)."""
        return 2 * self.dim if self.family == "gpt" else self.dim

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
        return (self.vocab_size + self.max_positions) * self.dim

    def lm_head_params(self) -> int:
        """``V h`` for an untied LM head, 0 when tied to the embedding."""
        return 0 if self.tied_embeddings else self.vocab_size * self.dim

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
        return self.dense_blocks * block + moe + self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward + backward, no recomputation:
        ``6 * matmul_params + 6 * L * S * (a d)``.

        The PaLM estimate (Chowdhery et al. 2022, appendix B, ``6N + 12 L H Q T``) with the
        attention term halved for causal masking; MFU is computed against it.
        """
        return 6.0 * self.matmul_params() + 6.0 * self.n_layers * seq_len * self.attention_width()

    def active_params(self) -> int:
        """Parameters one token uses: :meth:`num_params` with each MoE block's routed experts
        counted ``top_k`` times instead of ``n_experts`` times."""
        unused = (self.n_experts - self.top_k) * 3 * self.dim * self.expert_dim
        return self.num_params() - (self.moe_layers * unused if self.is_moe else 0)

    def summary(self) -> str:
        """One line: name, family, billions of parameters and the sizes."""
        moe = (
            f" experts={self.n_experts}x{self.expert_dim} top-{self.top_k} "
            f"(MoE blocks {self.moe_layers})"
            if self.is_moe
            else ""
        )
        return (
            f"{self.name} ({self.family}, {self.num_params() / 1e9:.2f}B): h={self.dim} "
            f"L={self.n_layers} heads={self.n_heads}/{self.n_kv_heads} "
            f"ffn={self.ffn_dim} V={self.vocab_size}{moe}"
        )


@functools.lru_cache(maxsize=256)
def _block_linears(model: ModelSpec) -> tuple[Linear, ...]:
    """:meth:`ModelSpec.linears`, built once per model (the planner asks for them per candidate)."""
    h, f = model.dim, model.ffn_dim
    if model.family == "gpt":
        return (
            Linear("qkv", h, 3 * model.q_dim, False, bias=True),
            Linear("proj", model.q_dim, h, True, bias=True),
            Linear("fc1", h, f, False, bias=True),
            Linear("fc2", f, h, True, bias=True),
        )
    ffn = (Linear("w13", h, 2 * f, False, stacked=2), Linear("w2", f, h, True))
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
    h, a, d = model.dim, model.n_heads, model.head_dim
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


def check_trainable(model: ModelSpec) -> ModelSpec:
    """``model`` if tetrad's runtime implements it: a Llama with an untied LM head, no learned
    positions, heads of ``dim / n_heads`` and no multi-head latent attention.

    Raises:
        ModelError: one line naming what the runtime does not implement.
    """
    if model.family != "llama" or model.tied_embeddings or model.max_positions:
        raise ModelError(
            f"{model.name} is not a Llama with an untied LM head, which is what tetrad "
            "trains: choose a llama preset or give sizes"
        )
    if model.head_dim * model.n_heads != model.dim or model.kv_lora_rank:
        raise ModelError(
            f"{model.name} has multi-head latent attention or heads of {model.head_dim} (not "
            f"dim/n_heads = {model.dim // model.n_heads}), which tetrad's Llama does not "
            "implement yet"
        )
    return model
