"""Context parallelism in the planner: what the runtime's sequence split
(tetrad/parallel/context.py) changes in compute, communication and memory.

With ``G_context = G`` each rank holds ``s = S / G`` tokens of every sample, as chunks ``r`` and
``2G - 1 - r`` of ``2G`` chunks of ``c = S / (2G)`` tokens. Everything token-wise scales with
``s`` (the planner's ``m = b s``). Attention differs:

- keys and values of the whole sequence are all-gathered over context once per block and
  micro-batch (forward, and again in recompute under ``full`` checkpointing), payload (the
  output) ``b S 2 kv_dim / G_y`` elements in the compute dtype; backward reduce-scatters their
  gradients, the same payload (the input). With the ``context`` overlap each is issued in
  ``n`` pieces of ``1/n`` of the payload (:func:`tetrad.spec.overlap.context_pieces` over the
  micro-batch's samples and the local KV heads): ``n`` calls, the same bytes, and each piece's
  transfer hidden behind the attention of the piece before it (:func:`pieces_exposed_seconds`);
  ``n = 1`` (or the overlap off) is one call. Both run behind the queries' RoPE too: the model
  hands over the keys and values before it forms the queries (``attend_to``), so the forward
  all-gather is issued before their RoPE and the backward's waits come after its backward.
- each chunk ``i`` attends over the ``(i + 1) c`` keys up to its end with a lower-right causal
  mask; on CUDA the mask is PyTorch's lower-right ``CausalBias``, whose kernels skip the masked
  upper triangle of the last ``c x c`` block: ``Q K^T`` and ``P V`` cost ``2 c (i + 1/2) c d``
  FLOPs per head each, over both chunks (``i = r`` and ``2G - 1 - r``)
  ``4 b d a / G_y c^2 2G = 2 b S^2 d a / (G G_y)`` forward, the ideal causal share. (The CPU
  kernel takes additive masks and computes the masked triangles too, ``(2G + 1) / (2G)`` of
  it; the planner models GPUs.)
- saved tensors per block: the gathered K/V (``2 b S kv_dim / G_y`` elements) instead of the
  local k and v; the attention output twice (SDPA's two halves, and their token-major
  concatenation, the out-projection's input); once for all blocks the chunk order, and on
  the CPU the additive masks (``c (2G + 1) c`` elements).

Where each part lives: the tokens per rank and the split's rules here (:func:`local_seq_len`,
:func:`context_problems`), with the K/V collectives (:func:`kv_gather_payload`, the pieces);
the attention FLOPs in :func:`tetrad.plan.compute.flops.attention_fwd_flops`; the saved tensors
in :func:`tetrad.plan.memory.activations.context_block_delta` and
:func:`~tetrad.plan.memory.activations.context_shared_bytes`.

A ring of point-to-point K/V exchanges (ring attention, Liu et al., arXiv 2310.01889; Megatron-LM)
sends the same bytes, ``(G - 1) / G`` of the gathered K/V per rank, in ``G - 1`` steps hidden
behind blocks of attention; the runtime's pieces hide theirs the same way
(tetrad/parallel/context.py says why pieces over heads and samples).
"""

from __future__ import annotations

from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import context_pieces


def local_seq_len(seq_len: int, gc: int) -> int:
    """Tokens per sample on one rank, ``S / G_context``."""
    return seq_len // gc


def kv_gather_payload(model: ModelSpec, micro_batch: int, seq_len: int, gy: int, c: int) -> float:
    """Bytes of one K/V all-gather's output (and of the backward reduce-scatter's input):
    ``b S 2 kv_dim / G_y * c``; ``seq_len`` is the whole sequence ``S``."""
    return float(micro_batch * seq_len * 2 * (model.kv_dim // gy) * c)


def kv_pieces(model: ModelSpec, micro_batch: int, gy: int, most: int) -> int:
    """Pieces of the K/V all-gather of the ``context`` overlap (``most`` 1: the overlap off):
    ``n_b n_h`` of :func:`tetrad.spec.overlap.context_pieces` over ``micro_batch`` samples and the
    ``kv_heads / G_y`` local KV heads, as the runtime splits them."""
    n_b, n_h = context_pieces(micro_batch, model.n_kv_heads // gy, most)
    return n_b * n_h


PIECE_CANDIDATES = (1, 2, 4, 8, 16)
"""The ``context_pieces`` (most pieces) the planner tries when not given one."""


def best_pieces(
    model: ModelSpec,
    micro_batch: int,
    gy: int,
    payload: float,
    times: tuple,
    attention: tuple[float, float],
    full: bool,
    candidates: tuple[int, ...],
    leads: tuple[float, float] = (0.0, 0.0),
) -> tuple[int, int]:
    """``(most, n)``: of ``candidates`` (values of the ``context_pieces`` option), the one whose
    pieces expose the least of one block's K/V collectives per micro-batch (the forward
    all-gather, again in recompute when ``full``, and the backward reduce-scatter), and its
    piece count; the fewest pieces on a tie. ``payload``: bytes of the whole all-gather;
    ``times``: ``(seconds of an all-gather, of a reduce-scatter)`` as functions of the payload
    (bytes); ``attention``: the block's attention ``(forward, backward)`` seconds; ``leads``:
    the compute besides it that the collectives run behind, ``(forward, backward)`` seconds
    (the queries' RoPE, :func:`pieces_exposed_seconds`)."""
    best, seen = None, set()
    for most in candidates:
        n = kv_pieces(model, micro_batch, gy, most)
        if n in seen:
            continue
        seen.add(n)
        gather = pieces_exposed_seconds(times[0](payload / n), attention[0] / n, n, leads[0])
        scatter = pieces_exposed_seconds(times[1](payload / n), attention[1] / n, n, leads[1])
        e = (2 if full else 1) * gather + scatter
        if best is None or e < best[0]:
            best = (e, most, n)
    return best[1], best[2]


def pieces_exposed_seconds(piece_s: float, work_s: float, n: int, lead: float = 0.0) -> float:
    """Exposed seconds of ``n`` transfers of ``piece_s`` each, queued back to back on one
    communicator, against ``n`` computations of ``work_s`` each that overlap them in a pipeline.

    Forward: all pieces are issued at once, piece ``k``'s attention starts when piece ``k`` has
    arrived and piece ``k - 1``'s attention has ended. Backward: piece ``k``'s reduce-scatter is
    issued when its attention backward ends, and all are waited after the last. Both end
    ``piece_s + (n - 1) max(piece_s, work_s) + work_s`` (forward) or ``n work_s + piece_s +
    (n - 1) max(0, piece_s - work_s)`` (backward) after the start, against ``n work_s`` of
    compute: exposed ``piece_s + (n - 1) max(0, piece_s - work_s)`` either way; ``n = 1``: the
    blocking transfer, ``piece_s``. ``lead``: seconds of other compute the transfers run behind,
    before the first piece's attention (forward: the queries' RoPE, issued after the
    all-gathers) or after the last one's and before the waits (backward: its backward), which
    the ends above are measured against too: exposed ``max(0, piece_s + (n - 1) max(0, piece_s
    - work_s) - lead)``."""
    return max(0.0, piece_s + (n - 1) * max(0.0, piece_s - work_s) - lead)
