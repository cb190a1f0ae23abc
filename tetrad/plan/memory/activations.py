"""Saved activations of one micro-batch on one rank of tetrad's runtime, derived from its
autograd graph (tetrad/parallel, tetrad/models/llama.py) and checked against autograd's saved
tensors (tests/test_memory_validation.py). Bytes; symbols as in
:mod:`tetrad.plan.memory.runtime`.

Sequence parallelism (``sequence_parallel``, tetrad/parallel/sequence.py; ``G_y > 1``) splits
the residual stream's ``m`` rows over Y: each norm's input, ``rstd`` and
normalised tensor, and a checkpointed block's input, hold ``r = m / G_y`` rows (the ``split``
argument below is ``G_y`` then, else 1); the first Linear of each pair keeps its input gathered
along the sequence, ``[m, h/G_x]`` in the compute dtype, and the LM head and loss their ``dx``
``[m, h]``.
Korthikanti et al. (arXiv 2205.05198, section 4.2.2, eq. 5) divide every stored tensor by
``t``; tetrad keeps the gathered Linear input instead of gathering it again in backward, so no
collective is added. With ``regather`` (``sequence_parallel="regather"``, ``tetrad train
--sequence-parallel-regather``) the first Linear keeps its shard, ``[m/G_y, h/G_x]``, and
gathers it again in backward, as Korthikanti et al. and Megatron-LM: its saved input is then
``r`` rows like the norm's (under selective checkpointing it is the norm's recipe-tagged
output, so nothing is kept for it).

The residual stream's format (``residual``, ``tetrad train --residual-dtype``; ``r`` bytes per
element, :func:`residual_bytes`) sizes each norm's input and a checkpointed block's input: the
compute dtype's by default (``r = e``: a bf16 stream on GPUs, Megatron-LM's), fp32 with
``--residual-dtype fp32`` (``r = 4`` under bf16 compute). The norms keep no fp32 copy of a bf16
input, and with a bf16 stream no normalised tensor either (rebuilt in backward,
tetrad/parallel/norm.py), as Megatron-LM's fused norms.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from tetrad.plan.comm.context_parallel import local_seq_len
from tetrad.plan.errors import PlanError
from tetrad.plan.memory.formats import dtype_bytes, residual_bytes
from tetrad.plan.memory.moe import moe_block_saved_bytes
from tetrad.spec.activation_checkpointing import checkpointed_blocks
from tetrad.spec.grid import context_size, grid_sizes
from tetrad.spec.model import ModelSpec
from tetrad.spec.sharding import sequence_parallel_problem
from tetrad.spec.units import FP32


def _norm_saved_bytes(
    model: ModelSpec,
    m: int,
    hx: int,
    e: int,
    consumers: int,
    split: int = 1,
    rb: int = FP32,
    regather: bool = False,
) -> float:
    """One norm (tetrad/parallel/norm.py) and the cast of its output for its consumers, per rank
    (``rb``: the residual stream's bytes per element).

    RMSNorm saves its input ``[m, h/G_x]`` in the residual format (its sum of squares and its
    apply keep it as it is), ``rsqrt`` ``[m, 1]`` fp32 and, with an fp32 stream, the normalised
    ``[m, h/G_x]`` fp32 (for the weight's gradient; a bf16 stream's apply rebuilds it in
    backward instead, tetrad/parallel/norm.py ``_NarrowApply``). Its output is saved by
    the following Linears as ``x.to(compute dtype)``: one shared fp32 tensor when ``e = 4``, one
    bf16 tensor per consumer otherwise (one: the fused wqkv, the fused w13; the norm's own
    output when the stream is bf16). GPT LayerNorm (not in the runtime): the same with two fp32
    statistics ``[m]`` (mean, rstd). With sequence parallelism (``split = G_y``) the norm's
    three tensors hold ``m / G_y`` rows and each consumer keeps the output gathered along the
    sequence, ``e m h`` (module docstring); with ``regather`` its shard, ``e (m / G_y) h``.
    """
    stats = 2 if model.family == "gpt" else 1
    r = m // split
    kept = r if regather else m  # the consumers' saved rows
    out = FP32 * kept * hx if e == FP32 else consumers * e * kept * hx
    normalised = FP32 * r * hx if rb == FP32 else 0
    return rb * r * hx + stats * FP32 * r + normalised + out


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

    llama SwiGLU ``w2(silu(gate) * up)``: the fused ``w13`` output ``[m, 2f/G_y]`` (silu's input
    and the product's other input are views of it; :mod:`tetrad.models.swiglu` rebuilds
    ``silu(gate)`` in backward instead of keeping it) and the product (w2's input):
    ``3 [m, f/G_y]`` in compute dtype.
    gpt GeLU: fc1's output (GeLU's input) and GeLU's output (fc2's input): ``2 [m, f/G_y]``.
    """
    n = 2 if model.family == "gpt" else 3
    return n * e * m * (model.ffn_dim // gy)


def block_saved_bytes(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    dtype: str = "bf16",
    split: int = 1,
    residual: str | None = None,
    regather: bool = False,
) -> float:
    """Bytes autograd saves for ONE block on one rank (no checkpointing): two norms with their
    output casts, attention, MLP, and the residual stream (block input and the mid-block sum
    ``h``, both ``[m, h/G_x]`` in the ``residual`` format, :func:`residual_bytes`, counted as
    the two norms' inputs; ``[m/G_y, h]`` with sequence parallelism, ``split = G_y``;
    ``regather``: the first Linears keep their input's shard, module docstring)."""
    _, _, gy, gx = grid_sizes(grid)
    e, m, hx = dtype_bytes(dtype), micro_batch * seq_len, model.dim // gx
    rb = residual_bytes(dtype, residual)
    return (  # each norm feeds one (fused) Linear
        _norm_saved_bytes(model, m, hx, e, 1, split, rb, regather)
        + _attention_saved_bytes(model, m, seq_len, gy, e)
        + _norm_saved_bytes(model, m, hx, e, 1, split, rb, regather)
        + _mlp_saved_bytes(model, m, gy, e)
    )


def selective_block_saved_bytes(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    dtype: str = "bf16",
    split: int = 1,
    residual: str | None = None,
    regather: bool = False,
) -> float:
    """Bytes ONE block keeps on one rank under selective checkpointing (tetrad/models/recompute.py;
    Korthikanti et al., arXiv 2205.05198, section 5): the tensors that are expensive to recompute
    or cheap to keep; the element-wise outputs they feed are rebuilt from them in backward.

    Per norm: its input ``[m, h/G_x]`` in the ``residual`` format (the block input ``x``, the
    mid-block sum ``h``) and ``rstd [m, 1]`` fp32 (GPT's LayerNorm: mean and rstd, ``[m]`` each);
    the normalised output is rebuilt. Attention: the wqkv output ``[m, (a d + 2 k d)/G_y]`` (rotated
    q and k and the v copy are rebuilt from it), ``inv_freq [d/2]`` fp32 (RoPE's input, ``2d``
    bytes), SDPA's output ``[m, a d/G_y]`` and fp32 log-sum-exp ``[m, a/G_y]`` (the out-projection's
    token-major input is rebuilt from the output). MLP: the w13 output ``[m, 2f/G_y]`` (llama:
    ``silu(gate) * up`` is rebuilt; gpt: fc1's ``[m, f/G_y]``, GeLU rebuilt). The positions ``[S]``
    int64 shared by all blocks: :func:`saved_activations`. With sequence parallelism (``split =
    G_y``) the norms' input and statistics hold ``m / G_y`` rows, and each pair's first Linear keeps
    its input gathered along the sequence, ``e m h`` (no recipe rebuilds a collective's output);
    with ``regather`` it keeps the norm's output, rebuilt from its recipe: nothing.
    """
    _, _, gy, gx = grid_sizes(grid)
    e, m, hx = dtype_bytes(dtype), micro_batch * seq_len, model.dim // gx
    qy, kvy, ay = model.q_dim // gy, model.kv_dim // gy, model.n_heads // gy
    stats = 2 if model.family == "gpt" else 1
    r, rb = m // split, residual_bytes(dtype, residual)
    gathered = split > 1 and not regather  # the first Linears' gathered inputs
    norms = 2 * (rb * r * hx + stats * FP32 * r) + (2 * e * m * hx if gathered else 0)
    if model.family == "gpt":
        qkv, rope, mlp = 3 * qy, 0, model.ffn_dim // gy
    else:
        qkv, rope, mlp = qy + 2 * kvy, FP32 * (model.head_dim // 2), 2 * (model.ffn_dim // gy)
    return norms + e * m * (qkv + qy + mlp) + FP32 * m * ay + rope


def selective_recompute_bytes(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    dtype: str = "bf16",
    split: int = 1,
    residual: str | None = None,
) -> float:
    """The largest set rebuilt at once in a selective block's backward (one rank, bytes): the
    rotated q, k and v copy for SDPA's backward ``e m (a d + 2 k d)/G_y``; SwiGLU's
    recomputation with grad, ``silu(gate)`` and the product, ``2 e m f/G_y``; or the norm's
    (:func:`norm_recompute_bytes`; ``m / G_y`` rows with sequence parallelism, ``split =
    G_y``). Not checked against the runtime (transient)."""
    _, _, gy, gx = grid_sizes(grid)
    e, m, hx = dtype_bytes(dtype), micro_batch * seq_len, model.dim // gx
    attention = e * m * (model.q_dim + 2 * model.kv_dim) // gy
    mlp = 2 * e * m * (model.ffn_dim // gy)
    norm = norm_recompute_bytes(e, residual_bytes(dtype, residual)) * (m // split) * hx
    return float(max(attention, mlp, norm))


def norm_recompute_bytes(e: int, rb: int) -> int:
    """Bytes per element of a norm's apply rebuilt with grad (transient): the fp32 product by
    ``rstd``, its rounding to the residual format (``rb`` bytes; none when that is fp32), the
    product by the weight (fp32, the widest case) and its cast to the compute dtype (``e``;
    none when that is fp32): ``8 + e`` for an fp32 stream under bf16 compute, ``8`` in fp32,
    ``10 + e`` = 12 for a bf16 stream."""
    return FP32 + (rb if rb != FP32 else 0) + FP32 + (e if e != FP32 else 0)


def compiled_block_delta(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    dtype: str = "bf16",
    split: int = 1,
    residual: str | None = None,
) -> tuple[float, float]:
    """What ``torch.compile`` of the blocks (``tetrad train --compile``) changes in one block's
    saved tensors on one rank, bytes: ``(without checkpointing, under selective)``.

    AOTAutograd's partitioner (Inductor's default min-cut) keeps a fused block's cheap
    element-wise outputs for recomputation in its backward kernels instead of saving them, so
    against :func:`block_saved_bytes` a compiled block drops each norm's fp32 normalised tensor
    (``2 x 4 m h/G_x``) and RoPE's four ``cos``/``sin`` tables (``4 x 4 S d/2``), and keeps one
    ``[S, 1]`` fp32 column of positions instead (``silu(gate)``, which it recomputes too, the
    eager block keeps no more either: :mod:`tetrad.models.swiglu`). Under selective
    checkpointing the compiled block keeps the rotated keys ``[m, k d/G_y]`` that the eager one
    rebuilds (``+ e m k d/G_y``). Under full checkpointing the kept block inputs are the same,
    and the block rebuilt in backward saves the compiled set (the first delta) too.
    Measured with saved-tensor hooks on CPU (fp32
    and bf16 autocast, torch 2.13, ``tests/test_memory_validation.py``) and on an H200 (llama-1b,
    micro-batch 16, seq 2048: 62.63 GiB measured against 60.55 predicted, docs/performance.md).
    Context grids were not measured compiled: the same delta is assumed, and under sequence
    parallelism (``split = G_y``) the normalised tensors' ``m / G_y`` rows. With a bf16 stream
    (``residual``) the eager norms keep no normalised tensor, so there is none to drop (assumed,
    not measured compiled).
    """
    _, _, gy, gx = grid_sizes(grid)
    e, m, hx = dtype_bytes(dtype), micro_batch * seq_len, model.dim // gx
    rb = residual_bytes(dtype, residual)
    if model.family != "llama":  # gpt is not in the runtime: nothing compiled to model
        return 0.0, 0.0
    rope = 4 * seq_len * (model.head_dim // 2) * FP32
    normalised = 2 * FP32 * (m // split) * hx if rb == FP32 else 0
    none = -(normalised + rope) + FP32 * seq_len
    return float(none), float(e * m * (model.kv_dim // gy))


def block_input_bytes(
    model: ModelSpec, grid, micro_batch: int, seq_len: int, split: int = 1, rb: int = FP32
) -> float:
    """A block's input ``[m, h/G_x]`` in the residual format (``rb`` bytes per element): all
    that non-reentrant ``torch.utils.checkpoint`` keeps of a checkpointed block (``[m/G_y, h]``
    with sequence parallelism, ``split = G_y``)."""
    _, _, _, gx = grid_sizes(grid)
    return float(rb * micro_batch * seq_len // split * (model.dim // gx))


def embedding_saved_bytes(model: ModelSpec, micro_batch: int, seq_len: int) -> float:
    """The embedding (tetrad/parallel/embedding.py) saves the local ids ``[m]`` int64 and the
    out-of-block mask ``[m]`` bool: ``9 m`` bytes (its weight shard is a parameter)."""
    return 9.0 * micro_batch * seq_len


def final_norm_saved_bytes(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    dtype: str = "bf16",
    split: int = 1,
    residual: str | None = None,
) -> float:
    """The final norm and the input gradient the fused LM head and loss keep for backward
    (tetrad/parallel/loss.py ``lm_head_loss``): the norm's input, ``rstd`` and normalised
    tensor (its output is not saved: the head forms its share of the input gradient, ``[m, h]``
    in the compute dtype, in forward instead). Byte for byte this is what a Linear consumer
    saving the output (``G_x = 1``) or its X-gathered ``[m, h]`` copy (``G_x > 1``) would
    keep; under sequence parallelism (``split = G_y``) the norm's tensors hold ``m / G_y`` rows
    and ``dx`` is ``[m, h]`` (the head's input is gathered along the sequence). ``residual``:
    the stream's format (:func:`residual_bytes`), the norm's input's and normalised tensor's."""
    _, _, _, gx = grid_sizes(grid)
    m, e, h = micro_batch * seq_len, dtype_bytes(dtype), model.dim
    norm = _norm_saved_bytes(model, m, h // gx, e, 1, split, residual_bytes(dtype, residual))
    if gx == 1:
        return norm
    return norm - (FP32 if e == FP32 else e) * m * (h // gx) + e * m * h


def loss_saved_bytes(model: ModelSpec, grid, dtype: str = "bf16") -> float:
    """The fused LM head and cross-entropy (tetrad/parallel/loss.py ``lm_head_loss``) keeps its
    weight gradient, summed over the micro-batch's row blocks in forward, ``[V/(G_y G_x), h]``
    in the compute dtype (whatever the micro-batch: no ``[m, V]`` tensor outlives the
    forward) for its Z reduce-scatter (``G_z > 1``; else none: :func:`saved_activations`)."""
    _, _, gy, gx = grid_sizes(grid)
    return float(dtype_bytes(dtype) * (model.vocab_size // (gy * gx)) * model.dim)


def context_shared_bytes(seq_len: int, gc: int, e: int) -> float:
    """Saved tensors shared by every block (bytes): the chunk order ``[2G]`` int64, and with
    ``e = 4`` (fp32: the CPU) the two additive masks ``[c, (i+1) c]``, ``c^2 (2G + 1)``
    elements; in bf16 (CUDA) the masks are the lower-right ``CausalBias``, no tensor
    (tetrad/parallel/context.py); 0 without context parallelism."""
    if gc == 1:
        return 0.0
    c = seq_len // (2 * gc)
    return float((e * c * c * (2 * gc + 1) if e == 4 else 0) + 8 * 2 * gc)


def context_block_delta(
    model: ModelSpec, grid, micro_batch: int, seq_len: int, e: int, mode: str
) -> float:
    """What context parallelism adds to one block's saved tensors on one rank (bytes), against
    the same block on ``m = b S / G_context`` tokens without it (``seq_len``: the whole ``S``;
    ``e``: compute-dtype bytes; ``grid``: five sizes).

    Both modes keep the gathered K/V, ``2 b S kv_dim / G_y`` elements, and the attention output
    once more (SDPA's two halves and their token-major concatenation; without context
    parallelism the CPU kernel's heads-major output costs the same copy, CUDA's does not).
    ``none``: the local rotated k and the v copy (``2 m kv_dim / G_y``) are not kept (they feed
    the all-gather only). ``selective``: the concatenation is the kept input of the rebuilt
    head merge, and the rotated q is kept too (SDPA saves its two halves, views that carry no
    rebuild recipe): ``2 m a d / G_y`` more.
    """
    gc, gy = context_size(grid), grid_sizes(grid)[2]
    m = micro_batch * seq_len // gc
    kvy, qy = model.kv_dim // gy, model.q_dim // gy
    gathered = e * micro_batch * seq_len * 2 * kvy
    out = 0 if e == 4 else e * m * qy
    if mode == "none":
        return float(gathered - 2 * e * m * kvy + out)
    return float(gathered + 2 * e * m * qy)


def saved_activations(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    *,
    activation_checkpointing: str | bool = "none",
    dtype: str = "bf16",
    compiled: bool = False,
    expert: int = 1,
    imbalance: float = 1.0,
    sequence_parallel: bool | str = False,
    residual: str | None = None,
    params: str = "fp32",
) -> dict[str, float]:
    """What autograd holds on one rank at the end of one micro-batch's forward, in bytes.

    ``activation_checkpointing``: ``none``, ``selective``, ``full``
    (:data:`tetrad.spec.activation_checkpointing.CHECKPOINTING`; a bool means ``full``/``none``) or
    ``selective:K``. ``compiled``: the blocks run under ``torch.compile``
    (:func:`compiled_block_delta`).

    Returns:
        ``blocks`` (``L`` blocks' saved tensors; selective: ``L``
        :func:`selective_block_saved_bytes`; ``selective:K``: ``K`` of those and ``L - K``
        :func:`block_saved_bytes`; full: ``L`` block inputs; all but none plus the positions
        ``[S]`` int64, one tensor kept for all blocks; 0 with no block, the LM head's stage
        alone), ``embedding``, ``final_norm``, ``loss``
        (:func:`loss_saved_bytes` with ``G_z > 1``, else 0: training puts the head's ``dW``
        into its gradient in forward; their sum is what a training step's saved-tensor hooks
        see), and ``recompute``: live while one block is
        rebuilt in backward (full: its saved tensors minus its kept input; selective and
        ``selective:K``: :func:`selective_recompute_bytes`, the top block's, rebuilt while every
        block's tensors are still saved; none: 0). An MoE model's blocks are its dense and
        MoE blocks (:mod:`tetrad.plan.memory.moe`; ``expert`` = ``G_expert``, ``imbalance``
        the busiest rank's received rows over the mean; ``params`` the weights' stored format,
        whose bf16 expert weights are no copies): ``blocks`` counts each kind's own,
        ``selective:K`` their mean per block, ``recompute`` the larger kind's.

    ``sequence_parallel``: the residual stream split along the sequence over Y (module
    docstring); ``"regather"``: and each pair's first Linear keeping its input's sequence
    shard, gathered again in backward (``--sequence-parallel-regather``). ``residual``: the
    residual stream's format, ``fp32`` or ``bf16``; None (the runtime's ``auto``) is ``dtype``
    (:func:`residual_bytes`).

    Raises:
        tetrad.spec.activation_checkpointing.CheckpointingError: an unknown mode, or ``K`` above the
            model's blocks.
        PlanError: ``sequence_parallel`` where the runtime has none
            (:func:`tetrad.spec.sharding.sequence_parallel_problem`); an unknown dtype or
            residual format, or a bf16 stream under fp32 compute.
    """
    _, gz, gy, gx = grid_sizes(grid)
    shape = (1, context_size(grid), min(gz, 2), gy, gx)  # of G_z: whether the LM head keeps dW
    ckpt = activation_checkpointing
    # the memo's key: None where the stream is the compute dtype's (as the callers that never
    # give it spell it)
    rs = None if residual_bytes(dtype, residual) == dtype_bytes(dtype) else residual
    more = {} if rs is None else {"residual": rs}
    if sequence_parallel:
        problem = sequence_parallel_problem(model, shape, seq_len)
        if problem:
            raise PlanError(problem)
        args = (model, shape, micro_batch, seq_len, ckpt, dtype, compiled)
        if sequence_parallel == "regather":
            more["regather"] = True
        return dict(_saved_activations(*args, split=gy, **more))
    args = (model, shape, micro_batch, seq_len, ckpt, dtype, compiled)
    if not model.n_experts:  # a dense model
        return dict(_saved_activations(*args, **more))
    moe = (expert, imbalance) if params == "fp32" else (expert, imbalance, params)
    return dict(_saved_activations(*args, moe, **more))


@functools.lru_cache(maxsize=1 << 14)
def _saved_activations(
    model: ModelSpec,
    grid: tuple,
    micro_batch: int,
    seq_len: int,
    ckpt: str | bool,
    dtype: str,
    compiled: bool = False,
    moe: tuple = (1, 1.0),
    split: int = 1,
    residual: str | None = None,
    regather: bool = False,
) -> tuple[tuple[str, float], ...]:
    """:func:`saved_activations` once per model, ``grid = (1, G_context, min(G_z, 2), G_y,
    G_x)``, micro-batch, sequence, mode, dtype and compilation (``moe``: ``(expert,
    imbalance[, params])`` of an MoE model; ``split``: ``G_y`` under sequence parallelism;
    ``residual``: the stream's format, None for the compute dtype's; ``regather``: the first
    Linears keep their input's shard)."""
    mode, k = checkpointed_blocks(ckpt, model.n_layers)
    more = {} if residual is None else {"residual": residual}
    rg = {"regather": True} if regather else {}  # the memo's key of the callers without it
    t = _block_terms(model, grid, micro_batch, seq_len, dtype, compiled, split, **more, **rg)
    if model.n_experts and model.n_layers:
        t = _moe_block_terms(model, grid, micro_batch, seq_len, dtype, t, *moe, **more)
    if mode == "full":
        biggest = t.block_max or t.block
        blocks, recompute = model.n_layers * t.block_input + t.positions, biggest - t.block_input
    elif mode == "selective":
        blocks = k * t.selective + (model.n_layers - k) * t.block + t.positions
        recompute = t.selective_recompute
    else:
        blocks, recompute = model.n_layers * t.block, 0.0
    if mode == "full":  # the context masks and chunk order: saved by each recomputed block
        recompute += t.shared
    else:  # one set for all blocks
        blocks += t.shared
    if not model.n_layers:  # the LM head's stage alone (tetrad.spec.pipeline_split): no block
        blocks, recompute = 0.0, 0.0
    return (
        ("blocks", blocks),
        ("embedding", t.embedding),
        ("final_norm", t.final_norm),
        ("loss", t.loss if grid[2] > 1 else 0.0),  # G_z = 1: dW into the gradient in forward
        ("recompute", recompute),
    )


class _BlockTerms(NamedTuple):
    """The terms of :func:`saved_activations` that do not depend on the checkpointing mode,
    bytes: one block's saved tensors without checkpointing (``block``), under selective
    checkpointing (``selective``; context parallelism's share in both; ``block`` is also what
    full checkpointing rebuilds in backward, compiled or not), a block's input
    (``block_input``), the positions ``[S]`` int64 (``positions``, 0 for gpt), the context
    masks and chunk order (``shared``), the rebuilt selective set (``selective_recompute``),
    the embedding's, the final norm's and the loss's saved tensors."""

    block: float
    selective: float
    block_input: float
    positions: float
    shared: float
    selective_recompute: float
    embedding: float
    final_norm: float
    loss: float
    block_max: float = 0.0  # an MoE model's larger block kind (0: every block is ``block``)


@functools.lru_cache(maxsize=1 << 14)
def _block_terms(
    model: ModelSpec,
    grid: tuple,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    compiled: bool,
    split: int = 1,
    residual: str | None = None,
    regather: bool = False,
) -> _BlockTerms:
    """:class:`_BlockTerms` once per model, ``grid = (1, G_context, 1, G_y, G_x)``,
    micro-batch, sequence, dtype, compilation, ``split`` (``G_y`` under sequence
    parallelism), the residual stream's format and ``regather`` (shared by the checkpointing
    modes)."""
    gc, full_len, e = context_size(grid), seq_len, dtype_bytes(dtype)
    rb = residual_bytes(dtype, residual)
    seq_len = local_seq_len(seq_len, gc)  # this rank's tokens per sample
    args = (model, grid, micro_batch, seq_len, dtype, split, residual, regather)
    blk, sel = block_saved_bytes(*args), selective_block_saved_bytes(*args)
    if gc > 1:
        blk += context_block_delta(model, grid, micro_batch, full_len, e, "none")
        sel += context_block_delta(model, grid, micro_batch, full_len, e, "selective")
    if compiled:
        none, selective = compiled_block_delta(
            model, grid, micro_batch, seq_len, dtype, split, residual
        )
        blk, sel = blk + none, sel + selective
    # the positions [S] int64, one tensor for all blocks: an input of each full checkpoint, and
    # of RoPE's recipes under selective (none: RoPE's angles are built from it and not kept)
    positions = 8.0 * seq_len if model.family == "llama" else 0.0
    return _BlockTerms(
        block=blk,
        selective=sel,
        block_input=block_input_bytes(model, grid, micro_batch, seq_len, split, rb),
        positions=positions,
        shared=context_shared_bytes(full_len, gc, e),
        selective_recompute=selective_recompute_bytes(
            model, grid, micro_batch, seq_len, dtype, split, residual
        ),
        embedding=embedding_saved_bytes(model, micro_batch, seq_len),
        final_norm=final_norm_saved_bytes(
            model, grid, micro_batch, seq_len, dtype, split, residual
        ),
        loss=loss_saved_bytes(model, grid, dtype),
    )


def _moe_block_terms(
    model: ModelSpec,
    grid: tuple,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    dense: _BlockTerms,
    expert: int,
    imbalance: float,
    params: str = "fp32",
    residual: str | None = None,
) -> _BlockTerms:
    """:class:`_BlockTerms` of an MoE model: ``dense`` (its dense blocks' terms) with the
    per-block terms replaced by the mean over its ``L - L_m`` dense and ``L_m`` MoE blocks
    (``L`` times the mean is their sum), the recompute sets by the larger kind's
    (:mod:`tetrad.plan.memory.moe`)."""
    gc, gy, gx = context_size(grid), grid[3], grid[4]
    e, s = dtype_bytes(dtype), local_seq_len(seq_len, gc)
    m, hx, fy = micro_batch * s, model.dim // gx, model.ffn_dim // gy
    split = gc * gy * gx > 1
    args = (model, m, micro_batch, gy, gx, e)
    moe_none = moe_block_saved_bytes(*args, "none", expert, imbalance, split, params)
    moe_sel = moe_block_saved_bytes(*args, "selective", expert, imbalance, split, params)
    # the dense block's FFN norm output (one consumer) and SwiGLU, which an MoE block lacks
    out = FP32 * m * hx if e == FP32 else e * m * hx
    block = dense.block - out - _mlp_saved_bytes(model, m, gy, e) + moe_none
    selective = dense.selective - 2 * e * m * fy + moe_sel
    lm, ld = model.moe_layers, model.dense_blocks
    shared = 2 * e * m * (model.shared_ffn_dim // gy)
    attention = e * m * (model.q_dim + 2 * model.kv_dim) // gy
    norm = norm_recompute_bytes(e, residual_bytes(dtype, residual)) * m * hx
    sel_recompute = float(max(attention, shared, norm))
    if ld:
        sel_recompute = max(sel_recompute, dense.selective_recompute)
    return dense._replace(
        block=(ld * dense.block + lm * block) / model.n_layers,
        selective=(ld * dense.selective + lm * selective) / model.n_layers,
        selective_recompute=sel_recompute,
        block_max=max(block, dense.block if ld else 0.0),
    )
