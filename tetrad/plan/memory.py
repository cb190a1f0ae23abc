"""Per-GPU memory estimates: Fujii et al.'s 4D formula and a model of tetrad's own runtime.

Plain Python (no torch). Every function returns bytes. Two estimators, both giving a
:class:`MemoryBreakdown` with the 80% verdict of Fujii, Watanabe and Yokota (arXiv 2411.06465,
abstract: "when the estimated memory is below 80% of available GPU memory, training never ran out
of memory"):

- :func:`fujii2024`: the paper's estimator for Megatron-style ``t x c x p x d`` (TP, CP, PP, DP),
  as implemented by its first author (okoge-kaz/Megatron-LM,
  ``megatron/training/theoretical_memory_usage.py``, commits 85347a6b / 55d369bf). Reproduces the
  authors' unit-test values (see docs/memory.md and tests/test_plan_memory.py).
- :func:`tetrad`: derived from tetrad's 3D layout and what its code allocates and saves for
  backward, per rank of the grid ``(G_data, G_z, G_y, G_x)``. Parameters, gradients and AdamW
  states equal the runtime's exactly; saved activations were checked against autograd's saved
  tensors (tests/test_memory_validation.py).

Symbols: ``h`` hidden, ``L`` layers, ``a`` heads, ``d`` head dim, ``f`` FFN width, ``V``
vocabulary, ``S`` sequence length, ``b`` micro-batch (samples per (data, z) cell),
``m = b * S`` tokens per rank, ``e`` compute-dtype bytes (2 for bf16, 4 for fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tetrad.plan.models import Linear, ModelSpec, PlanError
from tetrad.spec import GiB

FIT_FRACTION = 0.8
"""Fujii et al. (arXiv 2411.06465): an estimate at or below 80% of GPU memory never ran out of
memory in their 454 runs; the 20% covers CUDA context, communicator buffers, allocator
fragmentation and other temporaries."""

FP32 = 4


@dataclass
class MemoryBreakdown:
    """Bytes per component on the most loaded rank, at its peak moment.

    Attributes:
        components: bytes per component (``parameters``, ``gradients``, ``optimizer_states``,
            ``activations``, ...); they add up to :attr:`total`.
        gpu_memory_bytes: the GPU's memory in bytes.
        peak_phase: for :func:`tetrad`, the phase of the training step at which the rank peaks
            (components not alive then are 0); empty for :func:`fujii2024`.
        phases: for :func:`tetrad`, the total bytes at each phase considered.
    """

    components: dict[str, float]
    gpu_memory_bytes: float
    peak_phase: str = ""
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Sum of the components (bytes)."""
        return float(sum(self.components.values()))

    @property
    def fraction(self) -> float:
        """``total / gpu_memory_bytes``."""
        return self.total / self.gpu_memory_bytes if self.gpu_memory_bytes else float("inf")

    @property
    def fits(self) -> bool:
        """``total <= 0.8 * gpu_memory_bytes`` (Fujii et al., arXiv 2411.06465)."""
        return self.total <= FIT_FRACTION * self.gpu_memory_bytes

    def to_dict(self) -> dict:
        """Plain-JSON view: components and totals in bytes and GiB, the fraction and verdict."""
        out = {
            "components_bytes": {k: float(v) for k, v in self.components.items()},
            "components_gib": {k: v / GiB for k, v in self.components.items()},
            "total_bytes": self.total,
            "total_gib": self.total / GiB,
            "gpu_memory_bytes": float(self.gpu_memory_bytes),
            "fraction": self.fraction,
            "fit_fraction": FIT_FRACTION,
            "fits": self.fits,
        }
        if self.peak_phase:
            out["peak_phase"] = self.peak_phase
            out["phases_bytes"] = {k: float(v) for k, v in self.phases.items()}
        return out


def _positive(**kw: int) -> None:
    for k, v in kw.items():
        if int(v) != v or v < 1:
            raise PlanError(f"{k}={v} must be a positive integer")


# =============================================================================================
# (a) Fujii et al. 2024 (arXiv 2411.06465), Megatron-style TP x CP x PP x DP
# =============================================================================================


def fujii_params_on_first_stage(model: ModelSpec, tp: int, pp: int) -> float:
    """Parameters on the most loaded rank (first pipeline stage), Fujii's code (notes section 3).

    ``p = 1``: ``(L P_layer + embedding + LM head) / t + final norm``;
    ``p > 1``: ``((L/p) P_layer + embedding) / t`` (the last stage is not modelled).
    ``P_layer`` is the exact per-block count; the embedding includes GPT's position table.
    """
    per_layer = model.params_per_layer()
    if pp == 1:
        return (
            model.n_layers * per_layer + model.embedding_params() + model.lm_head_params()
        ) / tp + model.norm_params()
    return (model.n_layers / pp * per_layer + model.embedding_params()) / tp


def fujii_weight_bytes(n_params: float) -> float:
    """bf16 weights: ``2 N`` bytes (Fujii code; notes section 4)."""
    return 2.0 * n_params


def fujii_gradient_bytes(n_params: float, grad_bytes: int) -> float:
    """Gradients: ``g N`` bytes, ``g = 4`` with fp32 main-grad accumulation (the authors'
    setting), 2 otherwise (notes section 4)."""
    return float(grad_bytes) * n_params


def fujii_optimizer_bytes(n_params: float, dp: int, cp: int, distributed_optimizer: bool) -> float:
    """fp32 master + Adam m + v = 12 bytes per parameter, divided by ``d c`` with Megatron's
    distributed optimizer (Fujii's change: sharded over the data x context group; notes
    section 4)."""
    return 12.0 * n_params / (dp * cp if distributed_optimizer else 1)


def fujii_layer_activation_bytes(
    model: ModelSpec, tp: int, cp: int, micro_batch: int, seq_len: int
) -> float:
    """Activation bytes of ONE transformer layer per rank (bf16, FlashAttention, no dropout,
    sequence parallelism; notes section 5).

    llama: ``(s/c) b h (12 + 4 k/a + 8 f/h) / t`` (Fujii's code: norm inputs 4, QKV input 2, Q 2,
    K and V 2 k/a each, attention output 2, MLP input 2, four f-wide tensors 8 f/h, in sbh units).
    gpt (Fujii's formula is for Llama): Korthikanti et al. (arXiv 2205.05198, Table 2), TP + SP +
    selective recompute, ``34 (s/c) b h / t``.
    """
    s, b, h = seq_len / cp, micro_batch, model.hidden
    if model.family == "gpt":
        return 34.0 * s * b * h / tp
    ratio_kv = model.n_kv_heads / model.n_heads
    return s * b * (12.0 * h + 4.0 * h * ratio_kv + 8.0 * model.ffn_hidden) / tp


def fujii_embedding_input_bytes(
    model: ModelSpec, tp: int, cp: int, pp: int, micro_batch: int, seq_len: int
) -> float:
    """Embedding-input term ``8 (s/c) b h p / t`` (Fujii's code, commented as int64 ids with p
    micro-batches in flight; the factor h is the author's, pinned by his tests; notes
    section 6)."""
    return 8.0 * (seq_len / cp) * micro_batch * model.hidden * pp / tp


def fujii_pipeline_factor(pp: int, num_microbatches: int | None, virtual_pp: int) -> float:
    """Factor on the layer and embedding activations of the first stage (notes section 6;
    Megatron's code): interleaved 1F1B ``1 + (p-1)/(p v)`` when ``v > 1``; otherwise
    ``min(1, m/p)`` when ``p > 1`` and the micro-batch count ``m`` is known; else 1. The first
    stage holds ``p`` micro-batches of ``L/p`` layers, i.e. ``L`` layers' worth."""
    if virtual_pp > 1:
        return 1.0 + (pp - 1) / (pp * virtual_pp)
    if pp > 1 and num_microbatches is not None:
        return min(1.0, num_microbatches / pp)
    return 1.0


def fujii_logits_bytes(
    model: ModelSpec, tp: int, cp: int, pp: int, micro_batch: int, seq_len: int
) -> float:
    """Output layer + cross-entropy, only when ``p = 1``: ``4 (s/c) b (h + V) / t`` (fp32 logits
    plus the final-norm output; notes section 6)."""
    if pp != 1:
        return 0.0
    return 4.0 * (seq_len / cp) * micro_batch * (model.hidden + model.vocab) / tp


def fujii2024(
    model: ModelSpec,
    tp: int,
    cp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    seq_len: int,
    gpu_memory_bytes: float,
    *,
    grad_bytes: int = 4,
    distributed_optimizer: bool = True,
    num_microbatches: int | None = None,
    virtual_pp: int = 1,
) -> MemoryBreakdown:
    """Fujii et al. (arXiv 2411.06465) memory of the first pipeline stage, in bytes.

    ``M = N_1 (2 + g + 12/(d c)) + [L A_layer + 8 (s/c) b h p / t] * factor
    + (p == 1 ? 4 (s/c) b (h + V) / t : 0)``.

    Components: ``parameters`` (bf16), ``gradients``, ``optimizer_states`` (their sum is the
    paper's "weight + optimizer"), ``activations`` (layers), ``embedding_input``,
    ``logits_and_loss`` (these three are the paper's "activation").

    Raises:
        PlanError: a non-positive size, or ``L`` not divisible by ``p * v``.
    """
    _positive(
        tp=tp, cp=cp, pp=pp, dp=dp, micro_batch=micro_batch, seq_len=seq_len, virtual_pp=virtual_pp
    )
    if grad_bytes not in (2, 4):
        raise PlanError(f"grad_bytes={grad_bytes}: use 4 (fp32 main grads) or 2 (bf16)")
    if model.n_layers % (pp * virtual_pp):
        raise PlanError(
            f"{model.n_layers} layers do not split into pp*virtual_pp = "
            f"{pp * virtual_pp} equal stages: choose a divisor of {model.n_layers}"
        )
    n = fujii_params_on_first_stage(model, tp, pp)
    factor = fujii_pipeline_factor(pp, num_microbatches, virtual_pp)
    layers = model.n_layers * fujii_layer_activation_bytes(model, tp, cp, micro_batch, seq_len)
    embed = fujii_embedding_input_bytes(model, tp, cp, pp, micro_batch, seq_len)
    return MemoryBreakdown(
        components={
            "parameters": fujii_weight_bytes(n),
            "gradients": fujii_gradient_bytes(n, grad_bytes),
            "optimizer_states": fujii_optimizer_bytes(n, dp, cp, distributed_optimizer),
            "activations": layers * factor,
            "embedding_input": embed * factor,
            "logits_and_loss": fujii_logits_bytes(model, tp, cp, pp, micro_batch, seq_len),
        },
        gpu_memory_bytes=float(gpu_memory_bytes),
    )


# =============================================================================================
# (b) tetrad's own runtime on the grid (G_data, G_z, G_y, G_x)
# =============================================================================================

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
"""Compute-dtype bytes. ``"bf16"`` is the runtime on CUDA (bf16 autocast, fp32 master weights,
FlashAttention-style SDPA, foreach AdamW); ``"fp32"`` the runtime on CPU (no autocast, the CPU
flash SDPA kernel, single-tensor AdamW)."""


def _grid(grid) -> tuple[int, int, int, int]:
    try:
        gd, gz, gy, gx = (int(g) for g in grid)
    except (TypeError, ValueError):
        raise PlanError(f"grid {grid!r} is not (G_data, G_z, G_y, G_x)") from None
    _positive(G_data=gd, G_z=gz, G_y=gy, G_x=gx)
    return gd, gz, gy, gx


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype {dtype!r} is unknown: use 'bf16' (CUDA) or 'fp32' (CPU)")
    return DTYPE_BYTES[dtype]


def grid_problems(model: ModelSpec, grid) -> list[str]:
    """Sizes of ``model`` that do not shard on ``grid = (G_data, G_z, G_y, G_x)``; empty if all do.

    Derived from tetrad's layout (tetrad.models.config.check_divisible): a non-transposed weight
    ``[n, k]`` needs ``n % (G_y G_z) == 0`` and ``k % G_x == 0``, a transposed one the same with X
    and Y swapped; heads and KV heads split over Y; the embedding and LM head ``V % (G_y G_z)``;
    norms ``h % G_x``.
    """
    _, gz, gy, gx = _grid(grid)
    bad: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok and msg not in bad:
            bad.append(msg)

    need(model.n_heads % gy == 0, f"n_heads={model.n_heads} divisible by G_y={gy}")
    need(model.n_kv_heads % gy == 0, f"n_kv_heads={model.n_kv_heads} divisible by G_y={gy}")
    need(model.hidden % gx == 0, f"hidden={model.hidden} divisible by G_x={gx}")
    for lin in [*model.linears(), model.lm_head()]:
        g_out, g_in, a_out, a_in = (
            (gx, gy, "G_x", "G_y") if lin.transposed else (gy, gx, "G_y", "G_x")
        )
        need(
            lin.out_features % (g_out * gz) == 0,
            f"{lin.name} out={lin.out_features} divisible by {a_out}*G_z={g_out * gz}",
        )
        need(
            lin.in_features % g_in == 0,
            f"{lin.name} in={lin.in_features} divisible by {a_in}={g_in}",
        )
    need(model.vocab % (gy * gz) == 0, f"vocab={model.vocab} divisible by G_y*G_z={gy * gz}")
    return bad


def check_grid(model: ModelSpec, grid) -> None:
    """Raise :class:`PlanError` listing every size of ``model`` that does not shard on ``grid``."""
    bad = grid_problems(model, grid)
    if bad:
        raise PlanError(
            f"{model.name} does not shard on grid {tuple(grid)}: needs "
            + "; ".join(bad)
            + ": change the grid or the model sizes"
        )


# ---- model states (exact) -------------------------------------------------------------------


def _vector_elements(lin: Linear, gx: int, gy: int) -> int:
    """Local bias elements ``n / G_out`` (replicated over the input axis, Z and data)."""
    if not lin.bias:
        return 0
    return lin.count * lin.out_features // (gx if lin.transposed else gy)


def local_parameter_elements(model: ModelSpec, grid) -> dict[str, int]:
    """Elements of this rank's parameter shards, by kind; the same on every rank.

    Derived from tetrad's layout (tetrad/parallel/{linear,embedding,norm}.py): every Linear and
    Embedding weight ``[n, k]`` is stored as ``n k / (G_x G_y G_z)`` elements whatever its
    orientation; biases ``n/G_y`` (``n/G_x`` when transposed); norm weights ``h/G_x`` (GPT
    LayerNorm: weight and bias, ``2h/G_x``), replicated over Y, Z and data.

    Returns:
        ``{"matrices": ..., "vectors": ..., "largest": ...}``: elements of all 2-D shards
        (AdamW's weight-decay group), of all 1-D shards, and of the largest single shard.
    """
    _, gz, gy, gx = _grid(grid)
    check_grid(model, grid)
    shard = gx * gy * gz
    block = [lin.weight_elements // shard for lin in model.linears() for _ in range(lin.count)]
    tables = [model.vocab * model.hidden // shard]
    if model.max_positions:
        tables.append(model.max_positions * model.hidden // shard)
    if not model.tied_embeddings:
        tables.append(model.lm_head().weight_elements // shard)
    matrices = model.n_layers * sum(block) + sum(tables)
    norm = model.norm_params() // gx
    bias = sum(_vector_elements(lin, gx, gy) for lin in model.linears())
    vectors = model.n_layers * (2 * norm + bias) + norm
    return {"matrices": matrices, "vectors": vectors, "largest": max(block + tables)}


def tetrad_parameter_bytes(model: ModelSpec, grid) -> float:
    """fp32 master weights of this rank's shards: ``4 * local elements`` (the runtime keeps
    parameters in fp32; bf16 autocast casts them per GEMM)."""
    n = local_parameter_elements(model, grid)
    return float(FP32 * (n["matrices"] + n["vectors"]))


def tetrad_gradient_bytes(model: ModelSpec, grid) -> float:
    """fp32 ``.grad`` of every local shard, same size as the parameters. Counted for the whole
    step (conservative when a step has one micro-batch: then they appear during backward)."""
    return tetrad_parameter_bytes(model, grid)


def tetrad_optimizer_bytes(model: ModelSpec, grid) -> float:
    """AdamW ``exp_avg`` and ``exp_avg_sq``: two fp32 copies of every local shard (torch.optim.AdamW
    built by tetrad.train.step.build_optimizer). The per-parameter ``step`` counters are not
    counted: without ``fused``/``capturable`` torch keeps them as 0-d fp32 tensors on the host."""
    return 2.0 * tetrad_parameter_bytes(model, grid)


# ---- saved activations of one micro-batch (derived from the runtime's autograd graph) --------


def _norm_saved_bytes(model: ModelSpec, m: int, hx: int, e: int, consumers: int) -> float:
    """One norm (tetrad/parallel/norm.py) and the cast of its output for its consumers, per rank.

    RMSNorm saves its input ``[m, h/G_x]`` fp32 (``pow``), ``rsqrt`` ``[m, 1]`` fp32 and the
    normalised ``[m, h/G_x]`` fp32 (for the weight's gradient). Its output is saved by the
    following Linears as ``x.to(compute dtype)``: one shared fp32 tensor when ``e = 4``, one bf16
    copy per consumer otherwise (3 for wq/wk/wv, 2 for w1/w3). GPT LayerNorm (not in the
    runtime): the same with two fp32 statistics ``[m]`` (mean, rstd).
    """
    stats = 2 if model.family == "gpt" else 1
    out = FP32 * m * hx if e == FP32 else consumers * e * m * hx
    return FP32 * m * hx + stats * FP32 * m + FP32 * m * hx + out


def _attention_saved_bytes(model: ModelSpec, m: int, seq_len: int, gy: int, e: int) -> float:
    """Attention of one block per rank (tetrad/models/llama.py ``Attention``), heads split over Y.

    llama: RoPE saves ``cos`` and ``sin`` ``[S, d/2]`` fp32 for q and for k (4 tensors); SDPA
    (FlashAttention: no ``S^2`` terms) saves rotated q ``[m, a d/G_y]``, rotated k and v
    ``[m, k d/G_y]`` each, its output ``[m, a d/G_y]`` and the fp32 log-sum-exp ``[m, a/G_y]``.
    With ``e = 4`` (CPU) the output is heads-major, so the out-projection input
    ``o.transpose(1, 2).reshape(..)`` is one more ``[m, a d/G_y]`` copy; CUDA's FlashAttention
    returns it token-major and the reshape is a view. gpt (not in the runtime): q, k, v are views
    of one ``[m, 3h/G_y]`` QKV output, no RoPE.
    """
    qy, kvy, ay = model.q_dim // gy, model.kv_dim // gy, model.n_heads // gy
    if model.family == "gpt":
        qkv, rope = 3 * qy, 0
    else:
        qkv, rope = qy + 2 * kvy, 4 * seq_len * (model.head_dim // 2) * FP32
    out = qy * (2 if e == FP32 else 1)
    return e * m * (qkv + out) + FP32 * m * ay + rope


def _mlp_saved_bytes(model: ModelSpec, m: int, gy: int, e: int) -> float:
    """MLP of one block per rank, inner width ``f/G_y``.

    llama SwiGLU ``w2(silu(w1 x) * w3 x)``: ``w1 x`` (silu's input), ``silu(w1 x)`` and ``w3 x``
    (the product's inputs), the product (w2's input): ``4 [m, f/G_y]`` in compute dtype.
    gpt GeLU: fc1's output (GeLU's input) and GeLU's output (fc2's input): ``2 [m, f/G_y]``.
    """
    n = 2 if model.family == "gpt" else 4
    return n * e * m * (model.ffn_hidden // gy)


def block_saved_bytes(
    model: ModelSpec, grid, micro_batch: int, seq_len: int, dtype: str = "bf16"
) -> float:
    """Bytes autograd saves for ONE block on one rank (no checkpointing): two norms with their
    output casts, attention, MLP, and the residual stream (block input and the mid-block sum
    ``h``, both ``[m, h/G_x]`` fp32, counted as the two norms' inputs)."""
    _, _, gy, gx = _grid(grid)
    e, m, hx = _dtype_bytes(dtype), micro_batch * seq_len, model.hidden // gx
    attn_consumers = 1 if model.family == "gpt" else 3
    mlp_consumers = 1 if model.family == "gpt" else 2
    return (
        _norm_saved_bytes(model, m, hx, e, attn_consumers)
        + _attention_saved_bytes(model, m, seq_len, gy, e)
        + _norm_saved_bytes(model, m, hx, e, mlp_consumers)
        + _mlp_saved_bytes(model, m, gy, e)
    )


def block_input_bytes(model: ModelSpec, grid, micro_batch: int, seq_len: int) -> float:
    """A block's input ``[m, h/G_x]`` fp32 (the residual stream stays fp32 under autocast): all
    that non-reentrant ``torch.utils.checkpoint`` keeps of a checkpointed block."""
    _, _, _, gx = _grid(grid)
    return float(FP32 * micro_batch * seq_len * (model.hidden // gx))


def embedding_saved_bytes(model: ModelSpec, micro_batch: int, seq_len: int) -> float:
    """The embedding (tetrad/parallel/embedding.py) saves the local ids ``[m]`` int64 and the
    out-of-block mask ``[m]`` bool: ``9 m`` bytes (its weight shard is a parameter)."""
    return 9.0 * micro_batch * seq_len


def final_norm_saved_bytes(
    model: ModelSpec, grid, micro_batch: int, seq_len: int, dtype: str = "bf16"
) -> float:
    """The final norm and the LM head's saved input (one consumer)."""
    _, _, _, gx = _grid(grid)
    return _norm_saved_bytes(
        model, micro_batch * seq_len, model.hidden // gx, _dtype_bytes(dtype), 1
    )


def loss_saved_bytes(model: ModelSpec, grid, micro_batch: int, seq_len: int) -> float:
    """Vocabulary-parallel cross-entropy (tetrad/parallel/loss.py) saves the fp32 softmax
    ``[m, V/G_y]`` and the local targets ``[m]`` int64 and mask ``[m]`` bool."""
    _, _, gy, _ = _grid(grid)
    m = micro_batch * seq_len
    return FP32 * m * (model.vocab // gy) + 9.0 * m


def saved_activations(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    *,
    activation_checkpointing: bool = False,
    dtype: str = "bf16",
) -> dict[str, float]:
    """What autograd holds on one rank at the end of one micro-batch's forward, in bytes.

    Returns:
        ``blocks`` (``L`` blocks' saved tensors, or ``L`` block inputs when checkpointed),
        ``embedding``, ``final_norm``, ``loss`` (their sum is what saved-tensor hooks see), and
        ``recompute``: with checkpointing, one block's saved tensors minus its kept input, live
        while that block is recomputed in backward (0 without checkpointing).
    """
    blk = block_saved_bytes(model, grid, micro_batch, seq_len, dtype)
    inp = block_input_bytes(model, grid, micro_batch, seq_len)
    return {
        "blocks": model.n_layers * (inp if activation_checkpointing else blk),
        "embedding": embedding_saved_bytes(model, micro_batch, seq_len),
        "final_norm": final_norm_saved_bytes(model, grid, micro_batch, seq_len, dtype),
        "loss": loss_saved_bytes(model, grid, micro_batch, seq_len),
        "recompute": blk - inp if activation_checkpointing else 0.0,
    }


# ---- transient buffers ----------------------------------------------------------------------


def gathered_weight_bytes(lin: Linear, grid, dtype: str = "bf16") -> float:
    """The Z all-gathered weight block ``n k / (G_x G_y)`` in compute dtype (tetrad/parallel/
    linear.py: ``all_gather_Z(w_shard.to(dtype))``). 0 in fp32 with ``G_z = 1``: the shard
    itself is used."""
    _, gz, gy, gx = _grid(grid)
    e = _dtype_bytes(dtype)
    if gz == 1 and e == FP32:
        return 0.0
    return float(e * lin.count * lin.weight_elements // (gx * gy))


def weight_gradient_bytes(lin: Linear, grid, dtype: str = "bf16") -> float:
    """The local weight gradient ``dy^T x`` ``[n/G_y, k/G_x]`` before the Z reduce-scatter: in
    compute dtype, plus its fp32 copy (the reduce-scatter input) when the compute dtype is bf16."""
    _, _, gy, gx = _grid(grid)
    e = _dtype_bytes(dtype)
    per = e + (FP32 if e != FP32 else 0)
    return float(per * lin.count * lin.weight_elements // (gx * gy))


def embedding_grad_bytes(model: ModelSpec, grid) -> float:
    """The embedding's backward builds its full-block gradient ``[V/G_y, h/G_x]`` fp32 before the
    Z reduce-scatter (tetrad/parallel/embedding.py)."""
    _, _, gy, gx = _grid(grid)
    return float(FP32 * model.vocab * model.hidden // (gx * gy))


def end_of_backward_bytes(model: ModelSpec, grid) -> float:
    """Temporaries at the end of backward, when the embedding's gradient is built: with
    ``G_data > 1`` the data-parallel all-reduce buffers of every weight gradient (``torch.cat``
    of the bucket's gradients, one flat fp32 copy of all matrices, held until the last
    micro-batch's backward ends; before the overlap rework ``sync_gradients`` made the same
    copy), plus :func:`embedding_grad_bytes`."""
    gd = _grid(grid)[0]
    matrices = local_parameter_elements(model, grid)["matrices"]
    return (FP32 * matrices if gd > 1 else 0.0) + embedding_grad_bytes(model, grid)


def step_buffer_bytes(model: ModelSpec, grid, dtype: str = "bf16") -> float:
    """Largest temporary of the optimizer step, after backward (tetrad/train/step.py):

    - ``sync_gradients`` of the vectors (norm weights, biases): one flat fp32 copy when
      ``G_z G_data > 1``;
    - ``clip_grad_norm``: ``p.grad.double().pow(2)``: 16 bytes per element of the largest shard;
    - AdamW: bf16/CUDA (foreach): ``_foreach_sqrt(exp_avg_sq)``, 4 bytes per element of the
      weight-decay group (all matrices); fp32/CPU (single tensor): ``exp_avg_sq.sqrt() / c``,
      8 bytes per element of the largest shard.
    """
    gd, gz, _, _ = _grid(grid)
    n = local_parameter_elements(model, grid)
    sync = FP32 * n["vectors"] if gd * gz > 1 else 0
    clip = 16 * n["largest"]
    adam = FP32 * n["matrices"] if _dtype_bytes(dtype) != FP32 else 8 * n["largest"]
    return float(max(sync, clip, adam))


# ---- the estimate ---------------------------------------------------------------------------


def tetrad(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    gpu_memory_bytes: float,
    *,
    activation_checkpointing: bool = False,
    dtype: str = "bf16",
    prefetch: bool = True,
    async_reduce_scatter: bool = True,
) -> MemoryBreakdown:
    """Peak memory of one rank of tetrad's runtime on ``grid = (G_data, G_z, G_y, G_x)``, bytes.

    ``micro_batch`` is the samples per micro-batch on each (data, z) cell (``m = micro_batch *
    seq_len`` tokens per rank). Static: fp32 parameters, fp32 gradients, AdamW states. On top,
    the largest of these phases of a training step (``W`` = a Z-gathered weight block in compute
    dtype, ``dW`` = a weight gradient before its reduce-scatter):

    - ``forward: LM head``: all saved activations + logits ``[m, V/G_y]`` (compute dtype) + the
      head's ``W`` (twice with ``prefetch``: the runtime prefetches it again for backward);
    - ``forward: loss``: all saved activations + logits + the loss's fp32 shifted logits and
      softmax (``(e + 8) m V/G_y`` in all) + the head's prefetched ``W``;
    - ``backward: LM head``: all saved + the logits gradient (a bf16 copy of the softmax when
      ``e = 2``) + the head's ``W`` and ``dW`` (+ the next block weight prefetched);
    - ``backward: blocks``: the blocks' saved tensors (+ one block's recompute set when
      checkpointed) + ``W`` of the largest block Linear (the two largest with ``prefetch``) +
      its ``dW`` (two in flight with ``async_reduce_scatter`` and ``G_z > 1``);
    - ``backward: end``: :func:`end_of_backward_bytes` (data-parallel buckets, embedding grad);
    - ``optimizer step``: :func:`step_buffer_bytes`.

    ``prefetch`` and ``async_reduce_scatter`` mirror the runtime's ``prefetch`` and
    ``reduce_scatter`` overlaps (tetrad/parallel/overlap.py, on by default).

    Components (0 when not alive at the peak phase): ``parameters``, ``gradients``,
    ``optimizer_states``, ``activations`` (blocks, embedding, final norm), ``logits_and_loss``,
    ``recompute_activations``, ``gathered_weights``, ``reduce_scatter_buffers``,
    ``step_buffers``. Not counted: activation gradients (a few ``[m, h/G_x]`` / ``[m, f/G_y]``
    tensors in flight), CUDA context, communicator buffers, allocator fragmentation (the 20%
    margin of :attr:`MemoryBreakdown.fits`).

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
    """
    gz, gy = _grid(grid)[1:3]
    _positive(micro_batch=micro_batch, seq_len=seq_len)
    e = _dtype_bytes(dtype)
    check_grid(model, grid)
    m = micro_batch * seq_len
    vy = model.vocab // gy
    static = {
        "parameters": tetrad_parameter_bytes(model, grid),
        "gradients": tetrad_gradient_bytes(model, grid),
        "optimizer_states": tetrad_optimizer_bytes(model, grid),
    }
    saved = saved_activations(
        model,
        grid,
        micro_batch,
        seq_len,
        activation_checkpointing=activation_checkpointing,
        dtype=dtype,
    )
    act_all = saved["blocks"] + saved["embedding"] + saved["final_norm"]
    by_size = sorted(model.linears(), key=lambda lin: lin.weight_elements, reverse=True)
    big = by_size[0]
    w_head = gathered_weight_bytes(model.lm_head(), grid, dtype)
    w_big = gathered_weight_bytes(big, grid, dtype)
    w_two = sum(gathered_weight_bytes(lin, grid, dtype) for lin in by_size[:2])
    dw_blocks = weight_gradient_bytes(big, grid, dtype) * (
        2 if async_reduce_scatter and gz > 1 else 1
    )
    logits = float(e * m * vy)
    zero = {
        "activations": 0.0,
        "logits_and_loss": 0.0,
        "recompute_activations": 0.0,
        "gathered_weights": 0.0,
        "reduce_scatter_buffers": 0.0,
        "step_buffers": 0.0,
    }
    phases = {
        "forward: LM head": {
            "activations": act_all,
            "logits_and_loss": logits,
            "gathered_weights": w_head * (2 if prefetch else 1),
        },
        "forward: loss": {
            "activations": act_all,
            "logits_and_loss": saved["loss"] + logits + FP32 * m * vy,
            "gathered_weights": w_head if prefetch else 0.0,
        },
        "backward: LM head": {
            "activations": act_all,
            "logits_and_loss": saved["loss"] + (logits if e != FP32 else 0.0),
            "gathered_weights": w_head + (w_big if prefetch else 0.0),
            "reduce_scatter_buffers": weight_gradient_bytes(model.lm_head(), grid, dtype),
        },
        "backward: blocks": {
            "activations": saved["blocks"] + saved["embedding"],
            "recompute_activations": saved["recompute"],
            "gathered_weights": w_two if prefetch else w_big,
            "reduce_scatter_buffers": dw_blocks,
        },
        "backward: end": {
            "activations": saved["embedding"],
            "reduce_scatter_buffers": end_of_backward_bytes(model, grid),
        },
        "optimizer step": {"step_buffers": step_buffer_bytes(model, grid, dtype)},
    }
    base = sum(static.values())
    totals = {name: base + sum(terms.values()) for name, terms in phases.items()}
    peak = max(totals, key=lambda k: totals[k])
    return MemoryBreakdown(
        components={**static, **zero, **phases[peak]},
        gpu_memory_bytes=float(gpu_memory_bytes),
        peak_phase=peak,
        phases=totals,
    )
