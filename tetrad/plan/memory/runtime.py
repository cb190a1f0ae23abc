"""Per-GPU memory of tetrad's own runtime (:func:`runtime_memory`), the fewest selective blocks
that fit (:func:`fewest_selective`), and how much the sharded optimizer moves each phase
(:func:`sharding_offsets`).

Plain Python (no torch). Every function returns bytes. Both estimators of the planner give a
:class:`~tetrad.plan.memory.breakdown.MemoryBreakdown` with the 80% verdict of Fujii, Watanabe
and Yokota (arXiv 2411.06465):

- :func:`tetrad.plan.memory.fujii.fujii2024`: the paper's estimator for Megatron-style
  ``t x c x p x d`` (TP, CP, PP, DP).
- :func:`runtime_memory`: derived from tetrad's 3D layout and what its code allocates and saves for
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
from typing import NamedTuple

from tetrad.plan.comm.context_parallel import local_seq_len
from tetrad.plan.errors import PlanError
from tetrad.plan.memory.activations import saved_activations
from tetrad.plan.memory.breakdown import FIT_FRACTION, MemoryBreakdown, check_positive
from tetrad.plan.memory.buffers import lm_head_logits_bytes
from tetrad.plan.memory.formats import dtype_bytes
from tetrad.plan.memory.grid_buffers import GridBuffers, checked_grid_buffers, grid_buffers
from tetrad.spec.grid import context_size, grid_sizes
from tetrad.spec.model import ModelSpec

PHASES = (
    "forward: LM head",
    "backward: LM head",
    "backward: blocks",
    "backward: end",
    "optimizer step",
)
"""The phases of a training step whose totals :func:`runtime_memory` compares (its peak is
theirs)."""


def runtime_memory(
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
    compiled: bool = False,
    expert: int = 1,
    imbalance: float = 1.0,
    params: str = "fp32",
    sequence_parallel: bool | str = False,
    residual: str | None = None,
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
      two block weights (:data:`tetrad.spec.overlap.PREFETCH_DEPTH`; the two largest);
    - ``backward: LM head``: all saved + the scaled ``dx`` ``e m h`` + the fp32 copy of ``dW``
      (the reduce-scatter input) when ``e = 2`` (+ the next two block weights prefetched);
    - ``backward: blocks``: the blocks' saved tensors (+ one block's recompute set under
      ``full``, ``selective`` or ``selective:K``, whose top block is rebuilt first) + ``W`` of
      the largest block Linear (the three largest with ``prefetch``: in use and two in
      flight) + its ``dW`` (and :data:`~tetrad.spec.overlap.REDUCE_SCATTERS_IN_FLIGHT` more
      in flight with ``async_reduce_scatter`` and ``G_z > 1``);
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
    :mod:`tetrad.plan.memory.sharded_optimizer`. ``expert``: an MoE model's ``G_expert``
    (the expert axis folded over the stage's data x context x Z x Y x X ranks, innermost
    first: ``E / G_expert`` routed experts whole per rank); ``imbalance``: the busiest rank's
    received rows over the mean (``>= 1``), for its saved expert activations
    (:mod:`tetrad.plan.memory.moe`). ``compiled``: the blocks under ``torch.compile``
    (``--compile``), which save less
    (:func:`tetrad.plan.memory.activations.compiled_block_delta`). ``params``: the weights'
    stored format (``tetrad train --param-dtype``): ``fp32``, or ``bf16`` with the fp32
    masters among the optimizer states (sharded with them), fp32 gradients, the Z-gathered
    weights and the sharded optimizer's all-gathers in bf16 (:mod:`tetrad.plan.memory.states`);
    ``residual``: the residual stream's format (``--residual-dtype``: ``fp32`` or ``bf16``;
    None, the runtime's ``auto``, is ``dtype``): each norm's input and normalised tensor and a
    checkpointed block's input (:mod:`tetrad.plan.memory.activations`); the other saved
    activations are the compute dtype's.
    ``sequence_parallel``: the residual stream and norms split along the sequence over Y
    (``--sequence-parallel``, one tensor axis): their saved tensors divided by ``G_y``
    (:mod:`tetrad.plan.memory.activations`), and the LM head's input gathered along the
    sequence, ``e m h``, in its forward; it composes with ``params`` (the weights' terms and
    the activations' are apart). ``"regather"``: the same with
    ``--sequence-parallel-regather``, each pair's first Linear keeping its input's sequence
    shard (gathered again in backward) instead of the gathered input.

    Components (0 when not alive at the peak phase): ``parameters``, ``gradients``,
    ``optimizer_states``, ``activations`` (blocks, embedding, final norm), ``logits_and_loss``,
    ``recompute_activations``, ``gathered_weights``, ``reduce_scatter_buffers``,
    ``step_buffers``. Not counted: activation gradients (a few ``[m, h/G_x]`` / ``[m, f/G_y]``
    tensors in flight), CUDA context, communicator buffers, allocator fragmentation (the 20%
    margin of :attr:`MemoryBreakdown.fits`).

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
        tetrad.spec.activation_checkpointing.CheckpointingError: an unknown checkpointing mode.
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
        compiled,
        expert,
        imbalance,
        params,
        sequence_parallel,
        residual,
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
    compiled: bool = False,
    expert: int = 1,
    imbalance: float = 1.0,
    params: str = "fp32",
    sequence_parallel: bool | str = False,
    residual: str | None = None,
) -> dict[str, float]:
    """The total bytes at each phase of :func:`runtime_memory` (its ``phases``; the peak is their
    maximum) without the breakdown by component: what the search's memory lines need.

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
        tetrad.spec.activation_checkpointing.CheckpointingError: an unknown checkpointing mode.
    """
    g, a = _parts(
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
        compiled,
        expert,
        imbalance,
        params,
        sequence_parallel,
        residual,
    )
    # each phase: the base plus the sum of its components, in _phases' order (float sums
    # depend on it): equal to runtime_memory()'s phases bit for bit (tests/test_plan_memory_memo.py)
    base = g.base
    return {
        "forward: LM head": base + (a.all + a.head_forward + g.head_forward),
        "backward: LM head": base + (a.all + a.head_backward + g.head_backward + g.head_gradient),
        "backward: blocks": base + (a.blocks + a.recompute + g.blocks + g.block_gradients),
        "backward: end": base + (a.embedding + g.end_of_backward),
        "optimizer step": base + g.step,
    }


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
    expert: int = 1,
    imbalance: float = 1.0,
    params: str = "fp32",
    sequence_parallel: bool | str = False,
    residual: str | None = None,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """``(static components, {phase: live components})`` of :func:`runtime_memory`, bytes: what the
    pipeline's per-stage memory (:mod:`tetrad.plan.memory.pipeline`) adjusts.

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
        False,  # compiled: the pipeline's stages are modelled eager
        expert,
        imbalance,
        params,
        sequence_parallel,
        residual,
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
    compiled: bool = False,
    expert: int = 1,
    imbalance: float = 1.0,
    params: str = "fp32",
    sequence_parallel: bool | str = False,
    residual: str | None = None,
) -> tuple[GridBuffers, dict[str, dict[str, float]]]:
    """The grid's buffers and each phase's live components (bytes) of :func:`runtime_memory`."""
    g, a = _parts(
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
        compiled,
        expert,
        imbalance,
        params,
        sequence_parallel,
        residual,
    )
    phases = {
        "forward: LM head": {
            "activations": a.all,
            "logits_and_loss": a.head_forward,
            "gathered_weights": g.head_forward,
        },
        "backward: LM head": {
            "activations": a.all,
            "logits_and_loss": a.head_backward,
            "gathered_weights": g.head_backward,
            "reduce_scatter_buffers": g.head_gradient,
        },
        "backward: blocks": {
            "activations": a.blocks,
            "recompute_activations": a.recompute,
            "gathered_weights": g.blocks,
            "reduce_scatter_buffers": g.block_gradients,
        },
        "backward: end": {
            "activations": a.embedding,
            "reduce_scatter_buffers": g.end_of_backward,
        },
        "optimizer step": {"step_buffers": g.step},
    }
    return g, phases


def _parts(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: str | bool,
    dtype: str,
    prefetch: bool,
    async_reduce_scatter: bool,
    dp_overlap: bool,
    shard_optimizer: bool,
    compiled: bool = False,
    expert: int = 1,
    imbalance: float = 1.0,
    params: str = "fp32",
    sequence_parallel: bool | str = False,
    residual: str | None = None,
) -> tuple[GridBuffers, _ActivationTerms]:
    """The grid's buffers and the micro-batch's activation terms of :func:`runtime_memory`, checked
    in its order (sizes, dtype, grid, checkpointing mode), each memoised (the grid's per grid and
    options, the activations' per ``(G_context, G_y, G_x)``, micro-batch and mode)."""
    _checked_sizes(micro_batch, seq_len)
    more = {} if residual is None else {"residual": residual}
    if not model.n_experts:  # a dense model (cheaper to ask than is_moe)
        options = (dtype, prefetch, async_reduce_scatter, dp_overlap, shard_optimizer)
        if params == "fp32":  # the arguments every dense caller gives (one memo entry)
            g = checked_grid_buffers(model, tuple(grid), *options)
        else:
            g = checked_grid_buffers(model, tuple(grid), *options, 1, params)
        ckpt, sp = activation_checkpointing, sequence_parallel
        args = (model, g.shape, micro_batch, seq_len, ckpt, dtype, compiled)
        return g, _activation_terms(*args, sequence_parallel=sp, **_z(grid), **more)
    if imbalance < 1:
        raise PlanError(f"moe imbalance {imbalance} must be at least 1 (busiest over mean)")
    g = checked_grid_buffers(
        model,
        tuple(grid),
        dtype,
        prefetch,
        async_reduce_scatter,
        dp_overlap,
        shard_optimizer,
        expert,
        params,
    )
    moe = (expert, imbalance) if params == "fp32" else (expert, imbalance, params)
    ckpt = activation_checkpointing
    args = (model, g.shape, micro_batch, seq_len, ckpt, dtype, compiled, moe)
    sp = sequence_parallel  # MoE: refused
    return g, _activation_terms(*args, sequence_parallel=sp, **_z(grid), **more)


def _z(grid) -> dict:
    """:func:`_activation_terms`' ``z`` of ``grid``: absent (1) with ``G_z = 1``, else 2."""
    return {"z": 2} if grid_sizes(grid)[1] > 1 else {}


@functools.lru_cache(maxsize=1 << 10)
def _checked_sizes(micro_batch: int, seq_len: int) -> None:
    """:func:`check_positive` of the micro-batch and the sequence, once per pair (an error is
    not memoised)."""
    check_positive(micro_batch=micro_batch, seq_len=seq_len)


class _ActivationTerms(NamedTuple):
    """The components of :func:`runtime_memory`'s phases that grow with the micro-batch, bytes.

    Attributes:
        all: every saved activation (blocks, embedding, final norm).
        head_forward: the loss's saved tensors and the LM head's logits, in its forward;
            ``head_backward``: with the scaled ``dx`` ``e m h``, in its backward.
        blocks: the blocks' and the embedding's saved tensors; ``recompute``: the set rebuilt
            in a block's backward; ``embedding``: the embedding's saved tensors.
    """

    all: float
    head_forward: float
    head_backward: float
    blocks: float
    recompute: float
    embedding: float


@functools.lru_cache(maxsize=1 << 14)
def _activation_terms(
    model: ModelSpec,
    shape: tuple,
    micro_batch: int,
    seq_len: int,
    ckpt: str | bool,
    dtype: str,
    compiled: bool = False,
    moe: tuple = (1, 1.0),
    sequence_parallel: bool | str = False,
    residual: str | None = None,
    z: int = 1,
) -> _ActivationTerms:
    """:class:`_ActivationTerms` once per model, ``shape = (1, G_context, 1, G_y, G_x)``
    (:attr:`GridBuffers.shape`: nothing here depends on ``G_data``), micro-batch, sequence,
    mode, dtype, compilation (and an MoE model's ``(expert, imbalance)``; sequence
    parallelism; the residual stream's format) and ``z``: 1 with ``G_z = 1``, 2 for any
    ``G_z > 1`` (then the LM head keeps its ``dW`` for the Z reduce-scatter; nothing else here
    depends on ``G_z``)."""
    saved = saved_activations(
        model,
        (*shape[:2], z, *shape[3:]),
        micro_batch,
        seq_len,
        activation_checkpointing=ckpt,
        dtype=dtype,
        compiled=compiled,
        expert=moe[0],
        imbalance=moe[1],
        sequence_parallel=sequence_parallel,
        residual=residual,
        **({"params": moe[2]} if len(moe) > 2 else {}),
    )
    e = dtype_bytes(dtype)
    m = micro_batch * local_seq_len(seq_len, context_size(shape))  # this rank's tokens
    return _ActivationTerms(
        all=saved["blocks"] + saved["embedding"] + saved["final_norm"],
        head_forward=saved["loss"] + lm_head_logits_bytes(model, shape, m, e, sequence_parallel),
        head_backward=saved["loss"] + e * m * model.dim,
        blocks=saved["blocks"] + saved["embedding"],
        recompute=saved["recompute"],
        embedding=saved["embedding"],
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
    params: str = "fp32",
    sequence_parallel: bool | str = False,
    residual: str | None = None,
) -> str:
    """``selective:K`` with the fewest blocks ``K`` whose :func:`runtime_memory` estimate fits
    (80%), or ``selective`` when every block must be (``K = L``) or ``selective:1`` already fits;
    ``params``, ``sequence_parallel`` and ``residual``: as :func:`runtime_memory`'s.

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
        if params != "fp32":
            options["params"] = params
        if sequence_parallel:  # True, or "regather"
            options["sequence_parallel"] = sequence_parallel
        if residual is not None:
            options["residual"] = residual
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


@functools.lru_cache(maxsize=1 << 13)
def sharding_offsets(
    model: ModelSpec, grid: tuple, dtype: str, prefetch: bool, params: str = "fp32"
) -> dict:
    """Per phase of :func:`runtime_memory` (default overlaps): the bytes the sharded optimizer adds
    (negative: saves) to the unsharded total, the same for every micro-batch and checkpointing mode:
    the AdamW states in every phase, the end of backward's and the step's buffers in theirs
    (:mod:`tetrad.plan.memory.sharded_optimizer`): what lets the search derive a grid's sharded
    memory line from its unsharded one (``params``: the weights' stored format)."""
    if params == "fp32":  # the memo keys of the callers that never give it
        plain = grid_buffers(model, grid, dtype, prefetch, True, True, False)
        zero = grid_buffers(model, grid, dtype, prefetch, True, True, True)
    else:
        plain = grid_buffers(model, grid, dtype, prefetch, True, True, False, 1, params)
        zero = grid_buffers(model, grid, dtype, prefetch, True, True, True, 1, params)
    static = sum(v for _, v in zero.static) - sum(v for _, v in plain.static)
    out = dict.fromkeys(PHASES, static)
    out["backward: end"] += zero.end_of_backward - plain.end_of_backward
    out["optimizer step"] += zero.step - plain.step
    return out
