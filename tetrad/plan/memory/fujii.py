"""Fujii et al.'s per-GPU memory estimator for Megatron-style TP x CP x PP x DP.

Fujii, Watanabe and Yokota, "Accelerating Large Language Model Training with 4D Parallelism and
Memory Consumption Estimator" (arXiv 2411.06465), as implemented by the first author
(okoge-kaz/Megatron-LM, ``megatron/training/theoretical_memory_usage.py``, commits
85347a6b / 55d369bf). Reproduces the authors' unit-test values (docs/memory.md,
tests/test_plan_memory.py). Plain Python; every function returns bytes (or parameters where
it says so). Symbols as in :mod:`tetrad.plan.memory.runtime`; ``t c p d`` are the TP, CP, PP and DP
degrees.
"""

from __future__ import annotations

from tetrad.plan.errors import PlanError
from tetrad.plan.memory.breakdown import MemoryBreakdown, check_positive
from tetrad.spec.model import ModelSpec
from tetrad.spec.sharding import context_problems, tp_problems


def fujii_params_on_first_stage(model: ModelSpec, tp: int, pp: int) -> float:
    """Parameters on the most loaded rank (first pipeline stage), Fujii's code (notes section 3).

    ``p = 1``: ``(L P_layer + embedding + LM head) / t + final norm``;
    ``p > 1``: ``((L/p) P_layer + embedding) / t`` (the last stage is not modelled).
    ``P_layer`` is the exact per-block count (the mean block of an MoE model, every expert
    counted and split by TP as Megatron's expert TP = TP without expert parallelism); the
    embedding includes GPT's position table.
    """
    per_layer = model.params_per_layer()
    if model.is_moe:
        blocks = model.num_params() - model.embedding_params() - model.lm_head_params()
        per_layer = (blocks - model.norm_params()) / model.n_layers
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
    s, b, h = seq_len / cp, micro_batch, model.dim
    if model.family == "gpt":
        return 34.0 * s * b * h / tp
    ratio_kv = model.n_kv_heads / model.n_heads
    return s * b * (12.0 * h + 4.0 * h * ratio_kv + 8.0 * model.ffn_dim) / tp


def fujii_embedding_input_bytes(
    model: ModelSpec, tp: int, cp: int, pp: int, micro_batch: int, seq_len: int
) -> float:
    """Embedding-input term ``8 (s/c) b h p / t`` (Fujii's code, commented as int64 ids with p
    micro-batches in flight; the factor h is the author's, pinned by his tests; notes
    section 6)."""
    return 8.0 * (seq_len / cp) * micro_batch * model.dim * pp / tp


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
    return 4.0 * (seq_len / cp) * micro_batch * (model.dim + model.vocab_size) / tp


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
        PlanError: a non-positive size, a size TP does not split (heads, KV heads, FFN,
            hidden), ``L`` not divisible by ``p * v``, or ``S`` not by ``2 CP`` (``CP > 1``).
    """
    check_positive(
        tp=tp, cp=cp, pp=pp, dp=dp, micro_batch=micro_batch, seq_len=seq_len, virtual_pp=virtual_pp
    )
    if grad_bytes not in (2, 4):
        raise PlanError(f"grad_bytes={grad_bytes}: use 4 (fp32 main grads) or 2 (bf16)")
    if bad := tp_problems(model, tp):
        raise PlanError(
            f"{model.name} does not split over TP={tp}: needs "
            + "; ".join(bad)
            + ": choose another --tp"
        )
    if context_problems(seq_len, cp):
        raise PlanError(
            f"sequence length {seq_len} does not split into 2*CP = {2 * cp} equal chunks "
            "(context parallelism's load-balanced split): choose another --cp or --seq-len"
        )
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
