"""Per-GPU memory of tetrad's own runtime (:func:`tetrad`), and the fewest selective blocks that
fit (:func:`fewest_selective`).

Plain Python (no torch). Every function returns bytes. Both estimators of the planner give a
:class:`~tetrad.plan.memory.breakdown.MemoryBreakdown` with the 80% verdict of Fujii, Watanabe
and Yokota (arXiv 2411.06465):

- :func:`tetrad.plan.memory.fujii.fujii2024`: the paper's estimator for Megatron-style
  ``t x c x p x d`` (TP, CP, PP, DP).
- :func:`tetrad`: derived from tetrad's 3D layout and what its code allocates and saves for
  backward, per rank of the grid ``(G_data, G_z, G_y, G_x)``. Parameters, gradients and AdamW
  states (:mod:`tetrad.plan.memory.states`) equal the runtime's exactly; saved activations
  (:mod:`tetrad.plan.memory.activations`) were checked against autograd's saved tensors
  (tests/test_memory_validation.py); transient buffers: :mod:`tetrad.plan.memory.buffers`.

Symbols: ``h`` hidden, ``L`` layers, ``a`` heads, ``d`` head dim, ``f`` FFN width, ``V``
vocabulary, ``S`` sequence length, ``b`` micro-batch (samples per (data, z) cell),
``m = b * S`` tokens per rank, ``e`` compute-dtype bytes (2 for bf16, 4 for fp32).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from tetrad.plan.comm.context_parallel import local_seq_len
from tetrad.plan.errors import PlanError
from tetrad.plan.memory import zero
from tetrad.plan.memory.activations import dtype_bytes, saved_activations
from tetrad.plan.memory.breakdown import FIT_FRACTION, MemoryBreakdown, check_positive
from tetrad.plan.memory.buffers import (
    embedding_grad_bytes,
    end_of_backward_bytes,
    gathered_weight_bytes,
    lm_head_logits_bytes,
    step_buffer_bytes,
    weight_gradient_bytes,
)
from tetrad.plan.memory.states import (
    tetrad_gradient_bytes,
    tetrad_optimizer_bytes,
    tetrad_parameter_bytes,
)
from tetrad.plan.model.grids import check_grid, context_size, grid_sizes
from tetrad.plan.model.spec import ModelSpec
from tetrad.spec import FP32

PHASES = (
    "forward: LM head",
    "backward: LM head",
    "backward: blocks",
    "backward: end",
    "optimizer step",
)
"""The phases of a training step whose totals :func:`tetrad` compares (its peak is theirs)."""


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
    shard_optimizer: bool = False,
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
      two block weights (:data:`tetrad.spec.PREFETCH_DEPTH`; the two largest);
    - ``backward: LM head``: all saved + the scaled ``dx`` ``e m h`` + the fp32 copy of ``dW``
      (the reduce-scatter input) when ``e = 2`` (+ the next two block weights prefetched);
    - ``backward: blocks``: the blocks' saved tensors (+ one block's recompute set under
      ``full``, ``selective`` or ``selective:K``, whose top block is rebuilt first) + ``W`` of
      the largest block Linear (the three largest with ``prefetch``: in use and two in
      flight) + its ``dW`` (two in flight with ``async_reduce_scatter`` and ``G_z > 1``);
    - ``backward: end``: :func:`end_of_backward_bytes` (data-parallel buckets, embedding grad)
      + with ``prefetch`` and ``G_z > 1`` the step's next micro-batch's embedding table ``e V
      h / (G_y G_x)`` and first block weight (the largest), gathered ahead (counted whatever
      the micro-batches per step);
    - ``optimizer step``: :func:`step_buffer_bytes`.

    ``activation_checkpointing``: ``none``, ``selective``, ``selective:K`` or ``full`` (or a
    bool: ``full`` / ``none``); the saved sets are
    :func:`tetrad.plan.memory.activations.saved_activations`'s.
    ``prefetch``, ``async_reduce_scatter`` and ``dp_overlap`` mirror the runtime's
    ``prefetch``, ``reduce_scatter`` and ``dp_all_reduce`` overlaps (tetrad/parallel/overlap.py,
    on by default). ``shard_optimizer``: the runtime's sharded optimizer (ZeRO-1): the AdamW
    states over ``G_data G_context`` and the end of backward's and the step's buffers of
    :mod:`tetrad.plan.memory.zero`.

    Components (0 when not alive at the peak phase): ``parameters``, ``gradients``,
    ``optimizer_states``, ``activations`` (blocks, embedding, final norm), ``logits_and_loss``,
    ``recompute_activations``, ``gathered_weights``, ``reduce_scatter_buffers``,
    ``step_buffers``. Not counted: activation gradients (a few ``[m, h/G_x]`` / ``[m, f/G_y]``
    tensors in flight), CUDA context, communicator buffers, allocator fragmentation (the 20%
    margin of :attr:`MemoryBreakdown.fits`).

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
        tetrad.activation_checkpointing.CheckpointingError: an unknown checkpointing mode.
    """
    g, phases = _phases(
        model,
        grid,
        micro_batch,
        seq_len,
        activation_checkpointing,
        dtype,
        prefetch,
        async_reduce_scatter,
        dp_overlap,
        shard_optimizer,
    )
    absent = {
        "activations": 0.0,
        "logits_and_loss": 0.0,
        "recompute_activations": 0.0,
        "gathered_weights": 0.0,
        "reduce_scatter_buffers": 0.0,
        "step_buffers": 0.0,
    }
    static = dict(g.static)
    base = sum(static.values())
    totals = {name: base + sum(terms.values()) for name, terms in phases.items()}
    peak = max(totals, key=lambda k: totals[k])
    return MemoryBreakdown(
        components={**static, **absent, **phases[peak]},
        gpu_memory_bytes=float(gpu_memory_bytes),
        peak_phase=peak,
        phases=totals,
    )


def phase_totals(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    *,
    activation_checkpointing: str | bool = "none",
    dtype: str = "bf16",
    prefetch: bool = True,
    async_reduce_scatter: bool = True,
    dp_overlap: bool = True,
    shard_optimizer: bool = False,
) -> dict[str, float]:
    """The total bytes at each phase of :func:`tetrad` (its ``phases``; the peak is their
    maximum) without the breakdown by component: what the search's memory lines need.

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
        tetrad.activation_checkpointing.CheckpointingError: an unknown checkpointing mode.
    """
    g, phases = _phases(
        model,
        grid,
        micro_batch,
        seq_len,
        activation_checkpointing,
        dtype,
        prefetch,
        async_reduce_scatter,
        dp_overlap,
        shard_optimizer,
    )
    base = sum(v for _, v in g.static)
    return {name: base + sum(terms.values()) for name, terms in phases.items()}


def phase_components(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    *,
    activation_checkpointing: str | bool = "none",
    dtype: str = "bf16",
    prefetch: bool = True,
    shard_optimizer: bool = False,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """``(static components, {phase: live components})`` of :func:`tetrad`, bytes: what the
    pipeline's per-stage memory (:mod:`tetrad.plan.pipe.memory`) adjusts.

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
    """
    g, phases = _phases(
        model,
        grid,
        micro_batch,
        seq_len,
        activation_checkpointing,
        dtype,
        prefetch,
        True,
        True,
        shard_optimizer,
    )
    return dict(g.static), phases


def _phases(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: str | bool,
    dtype: str,
    prefetch: bool,
    async_reduce_scatter: bool,
    dp_overlap: bool,
    shard_optimizer: bool = False,
) -> tuple[_GridBuffers, dict[str, dict[str, float]]]:
    """The grid's buffers and each phase's live components (bytes) of :func:`tetrad`."""
    check_positive(micro_batch=micro_batch, seq_len=seq_len)
    e = dtype_bytes(dtype)
    check_grid(model, grid)
    g = _grid_buffers(
        model, tuple(grid), dtype, prefetch, async_reduce_scatter, dp_overlap, shard_optimizer
    )
    m = micro_batch * local_seq_len(seq_len, context_size(grid))  # this rank's tokens
    saved = saved_activations(
        model,
        grid,
        micro_batch,
        seq_len,
        activation_checkpointing=activation_checkpointing,
        dtype=dtype,
    )
    act_all = saved["blocks"] + saved["embedding"] + saved["final_norm"]
    phases = {
        "forward: LM head": {
            "activations": act_all,
            "logits_and_loss": saved["loss"] + lm_head_logits_bytes(model, grid, m, e),
            "gathered_weights": g.head_forward,
        },
        "backward: LM head": {
            "activations": act_all,
            "logits_and_loss": saved["loss"] + e * m * model.hidden,
            "gathered_weights": g.head_backward,
            "reduce_scatter_buffers": g.head_gradient,
        },
        "backward: blocks": {
            "activations": saved["blocks"] + saved["embedding"],
            "recompute_activations": saved["recompute"],
            "gathered_weights": g.blocks,
            "reduce_scatter_buffers": g.block_gradients,
        },
        "backward: end": {
            "activations": saved["embedding"],
            "reduce_scatter_buffers": g.end_of_backward,
        },
        "optimizer step": {"step_buffers": g.step},
    }
    return g, phases


@dataclass(frozen=True)
class _GridBuffers:
    """The bytes of :func:`tetrad` that depend on the grid and the options but not on the
    micro-batch or the checkpointing mode.

    Attributes:
        static: ``(name, bytes)`` of the parameters, gradients and optimizer states.
        head_forward: gathered weights inside the LM head's forward (its ``W``, with
            ``prefetch`` the next two block weights); ``head_backward``: in its backward.
        head_gradient: the fp32 copy of the head's ``dW`` (compute dtype bf16).
        blocks: gathered weights in the blocks' backward; ``block_gradients``: their ``dW``.
        end_of_backward: :func:`end_of_backward_bytes`; ``step``: :func:`step_buffer_bytes`.
    """

    static: tuple[tuple[str, float], ...]
    head_forward: float
    head_backward: float
    head_gradient: float
    blocks: float
    block_gradients: float
    end_of_backward: float
    step: float


@functools.lru_cache(maxsize=1 << 12)
def _grid_buffers(
    model: ModelSpec,
    grid: tuple,
    dtype: str,
    prefetch: bool,
    async_reduce_scatter: bool,
    dp_overlap: bool,
    shard_optimizer: bool = False,
) -> _GridBuffers:
    """:class:`_GridBuffers` once per grid and options (the search asks :func:`tetrad` for
    several micro-batches and modes of each grid)."""
    gz, gy, gx = grid_sizes(grid)[1:]
    sharded = shard_optimizer and zero.data_group(grid) > 1
    share = zero.state_share(grid, sharded)
    e = dtype_bytes(dtype)
    vy = model.vocab // (gy * gx)  # logits per rank: V over Y and X
    by_size = sorted(model.linears(), key=lambda lin: lin.weight_elements, reverse=True)
    big = by_size[0]
    w_head = gathered_weight_bytes(model.lm_head(), grid, dtype)
    w_big = gathered_weight_bytes(big, grid, dtype)
    w_two = sum(gathered_weight_bytes(lin, grid, dtype) for lin in by_size[:2])
    w_three = sum(gathered_weight_bytes(lin, grid, dtype) for lin in by_size[:3])
    # the next micro-batch's table and first block weight, prefetched at the end of backward
    # (counted whatever the micro-batches per step: the model does not know them)
    wrap = e * model.vocab * model.hidden // (gx * gy) + w_big if prefetch and gz > 1 else 0.0
    dw_blocks = weight_gradient_bytes(big, grid, dtype) * (
        2 if async_reduce_scatter and gz > 1 else 1
    )
    static = (
        ("parameters", tetrad_parameter_bytes(model, grid)),
        ("gradients", tetrad_gradient_bytes(model, grid)),
        ("optimizer_states", tetrad_optimizer_bytes(model, grid) * share),
    )
    end = end_of_backward_bytes(model, grid, dp_overlap)
    step = step_buffer_bytes(model, grid)
    if sharded:
        end = embedding_grad_bytes(model, grid) + zero.end_of_backward_bytes(model, grid)
        step = zero.step_bytes(model, grid, dp_overlap)
    return _GridBuffers(
        static=static,
        head_forward=w_head + (w_two if prefetch else 0.0),
        head_backward=w_two if prefetch else 0.0,
        head_gradient=FP32 * vy * model.hidden if e != FP32 else 0.0,
        blocks=w_three if prefetch else w_big,
        block_gradients=dw_blocks,
        end_of_backward=end + wrap,
        step=step,
    )


def fewest_selective(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    gpu_memory_bytes: float,
    dtype: str = "bf16",
    prefetch: bool = True,
    shard_optimizer: bool = False,
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

    def at(mode: str) -> dict[str, float]:
        options = {"activation_checkpointing": mode, "dtype": dtype, "prefetch": prefetch}
        return phase_totals(
            model, grid, micro_batch, seq_len, shard_optimizer=shard_optimizer, **options
        )

    def fits(phases: dict[str, float]) -> bool:  # MemoryBreakdown.fits: the peak within 80%
        return max(phases.values()) <= limit

    everywhere = at("selective")
    if not fits(everywhere):
        raise PlanError(f"{model.name} does not fit with selective checkpointing on every block")
    one = at("selective:1") if L > 1 else everywhere
    if fits(one):
        return "selective:1" if L > 1 else "selective"
    k = 1
    for name, t1 in one.items():
        if t1 > limit:  # falls to everywhere[name] <= limit at K = L
            drop = (t1 - everywhere[name]) / (L - 1)
            k = max(k, 1 + math.ceil((t1 - limit) / drop * (1 - 1e-12)))
    while k < L and not fits(at(f"selective:{k}")):
        k += 1
    return "selective" if k >= L else f"selective:{k}"
