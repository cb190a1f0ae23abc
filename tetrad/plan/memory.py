"""Per-GPU memory of tetrad's own runtime, and the :class:`MemoryBreakdown` both estimators give.

Plain Python (no torch). Every function returns bytes. Both estimators give a
:class:`MemoryBreakdown` with the 80% verdict of Fujii, Watanabe and Yokota (arXiv 2411.06465,
abstract: "when the estimated memory is below 80% of available GPU memory, training never ran out
of memory"):

- :func:`tetrad.plan.fujii.fujii2024`: the paper's estimator for Megatron-style ``t x c x p x d``
  (TP, CP, PP, DP).
- :func:`tetrad`: derived from tetrad's 3D layout and what its code allocates and saves for
  backward, per rank of the grid ``(G_data, G_z, G_y, G_x)``. Parameters, gradients and AdamW
  states equal the runtime's exactly; saved activations were checked against autograd's saved
  tensors (tests/test_memory_validation.py).

Symbols: ``h`` hidden, ``L`` layers, ``a`` heads, ``d`` head dim, ``f`` FFN width, ``V``
vocabulary, ``S`` sequence length, ``b`` micro-batch (samples per (data, z) cell),
``m = b * S`` tokens per rank, ``e`` compute-dtype bytes (2 for bf16, 4 for fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tetrad.plan.activations import dtype_bytes, saved_activations
from tetrad.plan.context_parallel import local_seq_len
from tetrad.plan.models import Linear, ModelSpec, PlanError, check_grid, context_size, grid_sizes
from tetrad.spec import FP32, GiB, loss_chunk_rows

FIT_FRACTION = 0.8
"""Fujii et al. (arXiv 2411.06465): an estimate at or below 80% of GPU memory never ran out of
memory in their 454 runs; the 20% covers CUDA context, communicator buffers, allocator
fragmentation and other temporaries."""


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


def check_positive(**sizes: int) -> None:
    """Raise :class:`PlanError` unless every value is a positive integer (the message names it)."""
    for k, v in sizes.items():
        if int(v) != v or v < 1:
            raise PlanError(f"{k}={v} must be a positive integer")


# ---- tetrad's own runtime on the grid (G_data, G_z, G_y, G_x) ------------------------------

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
        ``{"matrices": ..., "vectors": ...}``: elements of all 2-D shards (AdamW's
        weight-decay group) and of all 1-D shards.
    """
    _, gz, gy, gx = grid_sizes(grid)
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
    return {"matrices": matrices, "vectors": vectors}


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
    counted: 0-d fp32 tensors, 4 bytes per parameter tensor (on its device with the fused
    kernel)."""
    return 2.0 * tetrad_parameter_bytes(model, grid)


# ---- transient buffers ----------------------------------------------------------------------


def gathered_weight_bytes(lin: Linear, grid, dtype: str = "bf16") -> float:
    """The Z all-gathered weight block ``n k / (G_x G_y)`` in compute dtype (tetrad/parallel/
    linear.py: ``all_gather_Z(w_shard.to(dtype))``). 0 in fp32 with ``G_z = 1``: the shard
    itself is used."""
    _, gz, gy, gx = grid_sizes(grid)
    e = dtype_bytes(dtype)
    if gz == 1 and e == FP32:
        return 0.0
    return float(e * lin.count * lin.weight_elements // (gx * gy))


def weight_gradient_bytes(lin: Linear, grid, dtype: str = "bf16") -> float:
    """The local weight gradient ``dy^T x`` ``[n/G_y, k/G_x]`` before the Z reduce-scatter: in
    compute dtype, plus its fp32 copy (the reduce-scatter input) when the compute dtype is bf16."""
    _, _, gy, gx = grid_sizes(grid)
    e = dtype_bytes(dtype)
    per = e + (FP32 if e != FP32 else 0)
    return float(per * lin.count * lin.weight_elements // (gx * gy))


def lm_head_logits_bytes(model: ModelSpec, grid, m: int, e: int) -> float:
    """Transients of the fused LM head and loss (tetrad/parallel/loss.py ``lm_head_loss``) at
    their largest, in forward: one block of ``n`` rows (:func:`tetrad.spec.loss_chunk_rows`,
    the GPU budget) of logits ``[n, V/(G_y G_x)]`` in the compute dtype, their fp32 softmax and
    its compute-dtype copy for the gradient GEMMs (one buffer in all when ``e = 4``); with the
    vocabulary split over Y or X the micro-batch's logits ``e m V/(G_y G_x)``, kept for the
    second pass; with ``G_x > 1`` the input gathered over X ``e m h``; the per-token maximum,
    sum and target logit ``12 m``."""
    _, _, gy, gx = grid_sizes(grid)
    vy = model.vocab // (gy * gx)
    n = loss_chunk_rows(vy, m)
    block = n * vy * (e if e == FP32 else 2 * e + FP32)
    kept = e * m * vy if gy * gx > 1 else 0
    gathered = e * m * model.hidden if gx > 1 else 0
    return float(block + kept + gathered + 12 * m)


def embedding_grad_bytes(model: ModelSpec, grid) -> float:
    """The embedding's full-block gradient ``[V/G_y, h/G_x]`` fp32 before the Z reduce-scatter
    (tetrad/parallel/embedding.py); none with ``G_z = 1``, where the block is the gradient."""
    _, gz, gy, gx = grid_sizes(grid)
    return float(FP32 * model.vocab * model.hidden // (gx * gy)) if gz > 1 else 0.0


def end_of_backward_bytes(model: ModelSpec, grid, dp_overlap: bool = True) -> float:
    """Temporaries at the end of backward, plus :func:`embedding_grad_bytes`: with ``G_data > 1``
    the data-parallel buffers. With ``G_z = 1`` and the ``dp_all_reduce`` overlap the
    weight-gradient GEMMs write into the buckets, which are the gradients
    (:meth:`tetrad.parallel.buckets.GradBuckets.slot`): only the vectors (norm weights, left to
    autograd) are copied into the last one. With ``G_z > 1``, ``torch.cat`` of each bucket's
    reduce-scattered gradients: a flat fp32 copy of all matrices (the vectors follow after
    backward, :func:`step_buffer_bytes`); without the overlap ``sync_gradients`` flattens one
    group at a time after backward, the matrices' copy the largest."""
    gz = grid_sizes(grid)[1]
    gd = grid_sizes(grid)[0] * context_size(grid)  # the data x context group
    n = local_parameter_elements(model, grid)
    flat = 0 if gd == 1 else n["vectors"] if gz == 1 and dp_overlap else n["matrices"]
    return FP32 * flat + embedding_grad_bytes(model, grid)


def step_buffer_bytes(model: ModelSpec, grid) -> float:
    """Largest temporary of the optimizer step, after backward (tetrad/train/step.py):

    - ``sync_gradients`` of the vectors (norm weights, biases): one flat fp32 copy when
      ``G_z > 1`` (with ``G_z = 1`` their data-parallel sum rode in the last bucket:
      :func:`end_of_backward_bytes`);
    - none for ``clip_grad_norm`` (``torch._foreach_norm``, a scalar per gradient; the scaling
      in place) and AdamW (torch's fused kernel, on CPU and CUDA, in place)."""
    gz = grid_sizes(grid)[1]
    return float(FP32 * local_parameter_elements(model, grid)["vectors"] if gz > 1 else 0)


# ---- the estimate ---------------------------------------------------------------------------


def tetrad(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    gpu_memory_bytes: float,
    *,
    activation_checkpointing: str | bool = "none",
    dtype: str = "bf16",
    prefetch: bool = True,
    async_reduce_scatter: bool = True,
    dp_overlap: bool = True,
) -> MemoryBreakdown:
    """Peak memory of one rank of tetrad's runtime on ``grid = (G_data, G_z, G_y, G_x)``, bytes.

    ``micro_batch`` is the samples per micro-batch on each (data, z) cell (``m = micro_batch *
    seq_len`` tokens per rank). Static: fp32 parameters, fp32 gradients, AdamW states. On top,
    the largest of these phases of a training step (``W`` = a Z-gathered weight block in compute
    dtype, ``dW`` = a weight gradient before its reduce-scatter):

    - ``forward: LM head``, inside the fused LM head and loss (:func:`lm_head_logits_bytes`):
      all saved activations (the head's ``dx`` and ``dW`` among them) + one row block's logits
      and softmax + with the vocabulary split over Y or X the micro-batch's logits ``e m
      V/(G_y G_x)`` + the head's X-gathered input + its ``W`` + with ``prefetch`` the next
      block weight;
    - ``backward: LM head``: all saved + the scaled ``dx`` ``e m h`` + the fp32 copy of ``dW``
      (the reduce-scatter input) when ``e = 2`` (+ the next block weight prefetched);
    - ``backward: blocks``: the blocks' saved tensors (+ one block's recompute set under
      ``full``, ``selective`` or ``selective:K``, whose top block is rebuilt first) + ``W`` of
      the largest block Linear (the two largest with ``prefetch``) + its ``dW`` (two in flight
      with ``async_reduce_scatter`` and ``G_z > 1``);
    - ``backward: end``: :func:`end_of_backward_bytes` (data-parallel buckets, embedding grad);
    - ``optimizer step``: :func:`step_buffer_bytes`.

    ``activation_checkpointing``: ``none``, ``selective``, ``selective:K`` or ``full`` (or a
    bool: ``full`` / ``none``); the saved sets are
    :func:`tetrad.plan.activations.saved_activations`'s.
    ``prefetch``, ``async_reduce_scatter`` and ``dp_overlap`` mirror the runtime's
    ``prefetch``, ``reduce_scatter`` and ``dp_all_reduce`` overlaps (tetrad/parallel/overlap.py,
    on by default).

    Components (0 when not alive at the peak phase): ``parameters``, ``gradients``,
    ``optimizer_states``, ``activations`` (blocks, embedding, final norm), ``logits_and_loss``,
    ``recompute_activations``, ``gathered_weights``, ``reduce_scatter_buffers``,
    ``step_buffers``. Not counted: activation gradients (a few ``[m, h/G_x]`` / ``[m, f/G_y]``
    tensors in flight), CUDA context, communicator buffers, allocator fragmentation (the 20%
    margin of :attr:`MemoryBreakdown.fits`).

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
        tetrad.spec.CheckpointingError: an unknown checkpointing mode.
    """
    gz, gy = grid_sizes(grid)[1:3]
    check_positive(micro_batch=micro_batch, seq_len=seq_len)
    e = dtype_bytes(dtype)
    check_grid(model, grid)
    m = micro_batch * local_seq_len(seq_len, context_size(grid))  # this rank's tokens
    vy = model.vocab // (gy * grid_sizes(grid)[3])  # logits per rank: V over Y and X
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
    dw_head_fp32 = FP32 * vy * model.hidden if e != FP32 else 0.0
    w_big = gathered_weight_bytes(big, grid, dtype)
    w_two = sum(gathered_weight_bytes(lin, grid, dtype) for lin in by_size[:2])
    dw_blocks = weight_gradient_bytes(big, grid, dtype) * (
        2 if async_reduce_scatter and gz > 1 else 1
    )
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
            "logits_and_loss": saved["loss"] + lm_head_logits_bytes(model, grid, m, e),
            "gathered_weights": w_head + (w_big if prefetch else 0.0),
        },
        "backward: LM head": {
            "activations": act_all,
            "logits_and_loss": saved["loss"] + e * m * model.hidden,
            "gathered_weights": w_big if prefetch else 0.0,
            "reduce_scatter_buffers": dw_head_fp32,
        },
        "backward: blocks": {
            "activations": saved["blocks"] + saved["embedding"],
            "recompute_activations": saved["recompute"],
            "gathered_weights": w_two if prefetch else w_big,
            "reduce_scatter_buffers": dw_blocks,
        },
        "backward: end": {
            "activations": saved["embedding"],
            "reduce_scatter_buffers": end_of_backward_bytes(model, grid, dp_overlap),
        },
        "optimizer step": {"step_buffers": step_buffer_bytes(model, grid)},
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


def fewest_selective(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    gpu_memory_bytes: float,
    dtype: str = "bf16",
    prefetch: bool = True,
) -> str:
    """``selective:K`` with the fewest blocks ``K`` whose :func:`tetrad` estimate fits (80%),
    or ``selective`` when every block must be (``K = L``) or ``selective:1`` already fits.

    Every phase's total is affine in ``K`` for ``1 <= K <= L`` (each selective block replaces
    its saved tensors by its selective set; the positions and the recompute set are there from
    ``K = 1``), so two estimates give each phase's line and the smallest ``K`` below the limit,
    checked exactly.

    Raises:
        PlanError: ``selective`` itself does not fit (the caller checks that first), or a bad
            grid, size or dtype.
    """
    L, limit = model.n_layers, FIT_FRACTION * gpu_memory_bytes

    def at(mode: str) -> MemoryBreakdown:
        return tetrad(
            model, grid, micro_batch, seq_len, gpu_memory_bytes,
            activation_checkpointing=mode, dtype=dtype, prefetch=prefetch,
        )  # fmt: skip

    everywhere = at("selective")
    if not everywhere.fits:
        raise PlanError(f"{model.name} does not fit with selective checkpointing on every block")
    one = at("selective:1") if L > 1 else everywhere
    if one.fits:
        return "selective:1" if L > 1 else "selective"
    k = 1
    for name, t1 in one.phases.items():
        if t1 > limit:  # falls to everywhere.phases[name] <= limit at K = L
            drop = (t1 - everywhere.phases[name]) / (L - 1)
            k = max(k, 1 + math.ceil((t1 - limit) / drop * (1 - 1e-12)))
    while k < L and not at(f"selective:{k}").fits:
        k += 1
    return "selective" if k >= L else f"selective:{k}"
