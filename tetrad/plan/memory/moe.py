"""Saved activations of one mixture-of-experts block on one rank of tetrad's runtime: what
autograd keeps of the router, the dispatch, the routed experts' grouped GEMMs, the combine, the
load-balancing statistics and the shared expert (tetrad/models/moe.py, tetrad/parallel/
experts.py and moe_tensor.py), per checkpointing mode; checked against autograd's saved
tensors (tests/test_memory_validation_moe.py). Bytes; symbols as in
:mod:`tetrad.plan.memory.runtime`, and per MoE block: ``E`` experts, ``k`` top-k, ``f_e`` the
expert width, ``f_s`` the shared expert's, ``P = G_expert``, ``n = G_y G_x`` tensor ranks,
``T = m / n`` tokens this rank routes (each tensor rank routes its own slice of the rank's
``m`` tokens), ``R`` rows its experts receive (``T k`` without expert parallelism; ``T k
imbalance`` on the busiest rank with it).

What one MoE block saves (``e`` compute-dtype bytes; fp32 ``e = 4``):

=============================  ===============================================================
router                         its input (the norm's output, or with ``n > 1`` the split's
                               ``[T, h]``), under bf16 the cast weight ``e E h``; the fp32
                               scores ``[T, E]``, the chosen ids ``[T, k]`` int64; with
                               ``router_renorm`` the chosen weights ``[T, k]`` and their sum
                               ``[T, 1]`` fp32; sigmoid scores also their sum ``[T, 1]``
dispatch                       the gather index ``[T k]`` int64; with ``P > 1`` the received
                               rows' order ``[R]`` int64 (its ``index_copy`` back keeps the
                               same tensor)
experts (grouped GEMMs)        the rows ``[R, h]``, gate, up, ``silu(gate)`` and the product
                               ``[R, f_e]`` each, in the compute dtype; the group ends ``[E/P]``
                               int32; under bf16 the cast weights ``3 e (E/P) f_e h``
combine                        the slot order ``[T k]`` int64, the slots' weights ``[T k, 1]``
                               and the expert outputs ``[T k, h]``, in the compute dtype
load-balancing loss            ``f [groups, E]`` fp32 (groups: ``b`` sequences, or 1 for
                               ``batch``), with the whole-sequence length ``[groups, 1]`` where
                               the sequence is split (context, Y or X)
shared expert                  as the dense SwiGLU of width ``f_s`` (``3 e m f_s / G_y``)
=============================  ===============================================================

``selective`` keeps all of it but the shared expert's rebuilt part (its ``w13`` output
``2 e m f_s/G_y`` only) and the norm's output (kept by the router when ``n = 1``: its flattened
view is no rebuild recipe's output). ``full`` keeps the block's input; its recompute rebuilds
the whole set.
"""

from __future__ import annotations

from tetrad.plan.memory.formats import dtype_bytes
from tetrad.plan.memory.states import optimizer_bytes_per_element, param_bytes
from tetrad.spec.model import ModelSpec
from tetrad.spec.units import FP32

INT64 = 8
"""Bytes of an int64 index."""


def routed_rows(tokens: float, model: ModelSpec, expert: int, imbalance: float) -> float:
    """Rows ``R`` the busiest rank's experts receive: ``T k`` without expert parallelism (its
    own slots), ``T k imbalance`` with it (``imbalance``: the busiest rank's rows over the
    mean, ``>= 1``)."""
    return tokens * model.top_k * (imbalance if expert > 1 else 1.0)


def routed_saved_bytes(
    model: ModelSpec,
    tokens: float,
    micro_batch: int,
    e: int,
    expert: int,
    imbalance: float,
    split_sequence: bool,
    params: str = "fp32",
) -> float:
    """What the router, the dispatch, the routed experts, the combine and the load-balancing
    statistics of one MoE block save on one rank (the module table), bytes: ``tokens`` = ``T``
    routed here, ``micro_batch`` = ``b`` sequences (the statistics' groups), ``e``
    compute-dtype bytes, ``expert`` = ``P``, ``split_sequence``: the sequences are split over
    context, Y or X (the statistics keep the whole length), ``params``: the weights' stored
    format (bf16 weights under bf16 compute are no copies: autograd keeps the parameters). The
    router's input is the norm's output or the split's, counted by
    :func:`moe_block_saved_bytes`."""
    t, k, h, n_e = tokens, model.top_k, model.dim, model.n_experts
    local, f = n_e // expert, model.expert_dim
    rows = routed_rows(t, model, expert, imbalance)
    # bf16 compute of fp32 weights: the weights' bf16 copies are saved, not the parameters
    cast = e != FP32 and params == "fp32"
    router = (e * n_e * h if cast else 0) + FP32 * t * n_e + INT64 * t * k
    if model.router_renorm:
        router += FP32 * t * k + FP32 * t
    if model.router_score == "sigmoid":
        router += FP32 * t
    if model.router_z_loss_coef > 0:  # logsumexp keeps the fp32 logits and its output
        router += FP32 * t * (n_e + 1)
    dispatch = INT64 * t * k + (INT64 * rows if expert > 1 else 0)
    experts = e * rows * (h + 4 * f) + 4 * local + (3 * e * local * f * h if cast else 0)
    combine = INT64 * t * k + e * t * k + e * t * k * h
    stats = 0.0
    if model.aux_loss_coef > 0:
        groups = micro_batch if model.aux_loss_scope == "sequence" else 1
        stats = FP32 * groups * n_e + (FP32 * groups if split_sequence else 0)
    return float(router + dispatch + experts + combine + stats)


def moe_block_saved_bytes(
    model: ModelSpec,
    m: int,
    micro_batch: int,
    gy: int,
    gx: int,
    e: int,
    mode: str,
    expert: int = 1,
    imbalance: float = 1.0,
    split_sequence: bool = False,
    params: str = "fp32",
) -> float:
    """An MoE block's feed-forward saves on one rank beyond the ffn norm's own statistics
    (input, ``rstd`` and the normalised tensor, counted with the block's norms), bytes:
    ``m`` tokens on the rank, ``micro_batch`` sequences, tensor grid ``G_y x G_x``, ``e``
    compute-dtype bytes, ``mode`` ``none`` or ``selective`` (``full`` keeps the block input
    only: :func:`tetrad.plan.memory.activations.block_input_bytes`), ``expert`` =
    ``G_expert``, ``imbalance`` as :func:`routed_rows`; ``split_sequence``: context, Y or X
    split the sequences; ``params``: the weights' stored format (:func:`routed_saved_bytes`).

    The ffn norm's output ``[m, h/G_x]``: with ``n = 1`` the router keeps it (one tensor, the
    shared expert's ``w13`` takes the same); with ``n > 1`` the router keeps the split's
    ``[T, h]`` instead and only a shared expert keeps the norm's output (``none``; rebuilt
    under ``selective``).
    """
    n = gy * gx
    t = m / n
    hx = model.dim // gx
    out = FP32 * m * hx if e == FP32 else e * m * hx
    if n == 1:
        router_input = out
    else:
        router_input = e * t * model.dim + (out if model.shared_ffn_dim and mode == "none" else 0)
    shared = 0.0
    if model.shared_ffn_dim:
        width = model.shared_ffn_dim // gy
        shared = (3 if mode == "none" else 2) * e * m * width  # w13 output and product
    routed = routed_saved_bytes(model, t, micro_batch, e, expert, imbalance, split_sequence, params)
    return float(router_input + routed + shared)


def moe_terms(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    *,
    activation_checkpointing: str = "none",
    dtype: str = "bf16",
    expert: int = 1,
    imbalance: float = 1.0,
    shard_optimizer: bool = False,
    params: str = "fp32",
) -> dict[str, float]:
    """The mixture-of-experts terms inside :func:`tetrad.plan.memory.runtime.runtime_memory`
    of one rank, bytes, for ``tetrad memory`` (``grid``: four or five sizes): the routed
    experts' and the routers' fp32 parameters, gradients and AdamW states (with
    ``shard_optimizer`` the experts' AdamW states split over their expert-data group, where
    it and the data group have more than one rank; ``params``: the weights' stored format,
    bf16 with fp32 masters among the states), and what the
    ``L_m`` MoE blocks of one micro-batch save (module table; under ``full`` checkpointing one
    block's set, rebuilt in backward), split into the router, the dispatch and combine, the
    experts' rows and intermediates, the cast expert weights (bf16) and the shared expert.
    Empty for a dense model.

    Raises:
        PlanError: an unknown dtype.
    """
    from tetrad.spec.grid import context_size, grid_sizes

    if not model.is_moe:
        return {}
    gd, gz, gy, gx = grid_sizes(grid)
    gc, e = context_size(grid), dtype_bytes(dtype)
    m = micro_batch * (seq_len // gc)
    t, lm, k, h = m / (gy * gx), model.moe_layers, model.top_k, model.dim
    local, f = model.n_experts // expert, model.expert_dim
    rows = routed_rows(t, model, expert, imbalance)
    cast = e != FP32 and params == "fp32"
    full = activation_checkpointing.partition(":")[0] == "full"
    blocks = 1 if full else lm
    router = FP32 * t * model.n_experts + INT64 * t * k + (e * model.n_experts * h if cast else 0)
    moves = 2 * INT64 * t * k + e * t * k * (1 + h) + (INT64 * rows if expert > 1 else 0)
    edp = gd * gc * gz * gy * gx // expert if expert > 1 else 1  # the experts' expert-data
    split = shard_optimizer and gd * gc > 1 and edp > 1
    states = optimizer_bytes_per_element(params)
    per_expert = param_bytes(params) + FP32 + (states / edp if split else states)
    shared = 0.0
    if model.shared_ffn_dim:
        mode = "none" if full else activation_checkpointing.partition(":")[0]
        shared = (3 if mode == "none" else 2) * e * m * (model.shared_ffn_dim // gy)
    return {
        f"routed expert states ({params} weights, fp32 gradients, AdamW)": per_expert
        * lm
        * local
        * 3
        * f
        * h,
        "router states": 16.0 * lm * model.n_experts * h,
        f"router activations ({blocks} block(s))": blocks * router,
        "dispatch and combine (indices, weights, outputs)": blocks * moves,
        f"expert rows and intermediates ({rows:.0f} rows x (h + 4 f_e))": blocks
        * e
        * rows
        * (h + 4 * f),
        "cast expert weights (bf16 copies saved for backward)": (
            blocks * 3 * e * local * f * h if cast else 0.0
        ),
        "shared expert activations": blocks * shared,
    }
