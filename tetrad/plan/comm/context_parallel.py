"""Context parallelism in the planner: what the runtime's sequence split
(tetrad/parallel/context.py) changes in compute, communication and memory.

With ``G_context = G`` each rank holds ``s = S / G`` tokens of every sample, as chunks ``r`` and
``2G - 1 - r`` of ``2G`` chunks of ``c = S / (2G)`` tokens. Everything token-wise scales with
``s`` (the planner's ``m = b s``). Attention differs:

- keys and values of the whole sequence are all-gathered over context once per block and
  micro-batch (forward, and again in recompute under ``full`` checkpointing), payload (the
  output) ``b S 2 kv_dim / G_y`` elements in the compute dtype; backward reduce-scatters their
  gradients, the same payload (the input). Both are blocking (nothing to hide them behind: q,
  k and v come from one GEMM).
- each chunk ``i`` attends over the ``(i + 1) c`` keys up to its end with an additive
  lower-right causal mask, so the kernel computes the masked upper triangle of the last
  ``c x c`` block too: ``Q K^T`` and ``P V`` cost ``2 c (i+1) c d`` FLOPs per head each, over
  both chunks ``4 b d a/G_y c^2 (2G + 1)`` forward (against the ideal causal
  ``2 b S^2 d a / (G G_y)``: ``(2G + 1) / (2G)`` of it).
- saved tensors per block: the gathered K/V (``2 b S kv_dim / G_y`` elements) instead of the
  local k and v; the attention output twice (SDPA's two halves, and their token-major
  concatenation, the out-projection's input); the masks (``c (2G + 1) c`` elements) once for
  all blocks.

A ring of point-to-point K/V exchanges (ring attention, Liu et al., arXiv 2310.01889) would send
the same bytes, ``(G - 1) / G`` of the gathered K/V per rank, and hide each step behind a
block of attention; the runtime does not implement it (:func:`ring_exposed_seconds` estimates
what it would hide, for the docs' comparison).
"""

from __future__ import annotations

from tetrad.plan.model.grids import context_size, grid_sizes
from tetrad.plan.model.spec import ModelSpec


def local_seq_len(seq_len: int, gc: int) -> int:
    """Tokens per sample on one rank, ``S / G_context``."""
    return seq_len // gc


def context_problems(seq_len: int, gc: int) -> list[str]:
    """Why ``seq_len`` cannot be split over ``G_context = gc`` ranks (empty when it can): each
    rank holds two of ``2 G_context`` equal chunks."""
    if gc > 1 and seq_len % (2 * gc):
        return [f"seq_len {seq_len} % (2*G_context = {2 * gc}) == 0"]
    return []


def kv_gather_payload(model: ModelSpec, micro_batch: int, seq_len: int, gy: int, c: int) -> float:
    """Bytes of one K/V all-gather's output (and of the backward reduce-scatter's input):
    ``b S 2 kv_dim / G_y * c``; ``seq_len`` is the whole sequence ``S``."""
    return float(micro_batch * seq_len * 2 * (model.kv_dim // gy) * c)


def attention_fwd_flops(
    model: ModelSpec, micro_batch: int, seq_len: int, gy: int, gc: int = 1
) -> float:
    """Causal attention forward FLOPs on one rank. ``G_context = 1``: ``2 b S^2 d a / G_y``
    (half of ``4 b S^2 d a`` for the causal mask: PaLM, Chowdhery et al., arXiv 2204.02311,
    appendix B). ``G_context = G > 1``: ``4 b d a / G_y c^2 (2G + 1)``, ``c = S / (2G)`` (the
    module doc)."""
    a_d = model.head_dim * model.n_heads / gy
    if gc == 1:
        return 2.0 * micro_batch * seq_len * seq_len * a_d
    c = seq_len / (2 * gc)
    return 4.0 * micro_batch * a_d * c * c * (2 * gc + 1)


def context_shared_bytes(seq_len: int, gc: int, e: int) -> float:
    """Saved tensors shared by every block (bytes): the two additive masks ``[c, (i+1) c]`` in
    the compute dtype (``e`` bytes) and the chunk order ``[2G]`` int64; 0 without context
    parallelism."""
    if gc == 1:
        return 0.0
    c = seq_len // (2 * gc)
    return float(e * c * c * (2 * gc + 1) + 8 * 2 * gc)


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


def ring_exposed_seconds(gather_s: float, attention_s: float, gc: int) -> float:
    """Exposed seconds of one block's K/V exchange as a ring of ``G - 1`` point-to-point steps,
    each of ``1/G`` of the all-gather's time, hidden behind the attention of the block received
    before it (``attention_s / G`` each): the first step waits, the rest expose
    ``max(0, step - compute)``. For comparison with the all-gather (fully exposed)."""
    if gc == 1:
        return 0.0
    step, work = gather_s / (gc - 1), attention_s / gc
    return step + (gc - 2) * max(0.0, step - work)
