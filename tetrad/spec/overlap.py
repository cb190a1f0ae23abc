"""The overlap names and their defaults, and the sizes that tune them (plain Python): what the
runtime overlaps with computation (:mod:`tetrad.parallel.overlap`) and the planner models."""

from __future__ import annotations

from collections.abc import Iterable

from tetrad.spec.errors import TetradError
from tetrad.spec.units import GiB, MiB

OVERLAPS = (
    "prefetch",
    "reduce_scatter",
    "dx_all_reduce",
    "dp_all_reduce",
    "domino",
    "fine",
    "context",
    "expert",
)
"""What the runtime overlaps with computation (:mod:`tetrad.parallel.overlap`, where each is
described) and the planner models (:mod:`tetrad.plan.step_time`)."""

DEFAULT_OVERLAPS = tuple(o for o in OVERLAPS if o != "fine")
"""The overlaps of a model built without naming any (``ParallelLlama``, ``Overlap``): all but
``fine``, which is on only where named or where the planner predicts a gain
(:func:`tetrad.train.auto.fine_chunks`), as ``tetrad train --overlap all`` without a machine."""

DP_BUCKET_BYTES = 25 * MiB
"""Data-parallel all-reduce bucket size of the ``dp_all_reduce`` overlap, bytes: DDP's default
(``bucket_cap_mb=25``). On the 2-core CPU machine, separate spawns in ABBA order, 6 repeats each,
the ``small`` model's data-parallel step took 0.99x (4 ranks) and 0.99x (2 ranks) of its time
with 4 MiB buckets: fewer gloo calls (each costs about 1 ms of CPU at 4 ranks)."""

GATHER_GROUP_BYTES = DP_BUCKET_BYTES
"""Smallest all-gather of the sharded optimizer's parameters after the update, bytes (the
weights' stored format): consecutive units (embedding, blocks, final norm with head) are gathered
together until they reach it (:func:`gather_groups`), as Megatron-LM gathers buckets of about
40M parameters, so that a small model does not pay one call per block."""


def gather_groups(unit_bytes: list[float], least: float = GATHER_GROUP_BYTES) -> list[range]:
    """The sharded optimizer's all-gather groups after the update: ``unit_bytes`` (each unit's
    bytes, in forward order) cut into consecutive runs, each closed as soon as its bytes reach
    ``least`` (the last run may stay below). Returns the runs as index ranges; the runtime
    (:mod:`tetrad.parallel.zero`) and the planner's models cut alike."""
    out, start, total = [], 0, 0.0
    for i, b in enumerate(unit_bytes):
        total += b
        if total >= least:
            out.append(range(start, i + 1))
            start, total = i + 1, 0.0
    if start < len(unit_bytes):
        out.append(range(start, len(unit_bytes)))
    return out


DOMINO_MIN_ROWS = 256
"""The ``domino`` overlap splits a forward GEMM only when the micro-batch has at least twice
this many token rows (below it the extra launch costs more than the split hides)."""

LOSS_CHUNK_BYTES = {"cpu": 8 * MiB, "cuda": 1 * GiB}
"""Per device type, the largest fp32 block of logits ``[rows, V/(G_y G_x)]`` that the fused LM
head and cross-entropy (:func:`tetrad.parallel.loss.lm_head_loss`) forms at once, bytes: small
on the CPU (the block stays in cache from its GEMM through the softmax and the gradient's two
GEMMs), large on GPUs (few, large GEMMs and few partial weight-gradient sums)."""


def loss_chunk_rows(vocab_local: int, rows: int, device: str = "cuda") -> int:
    """Token rows per block of the fused LM head and cross-entropy: as many as fit
    :data:`LOSS_CHUNK_BYTES` of the device type (``cuda`` for any accelerator) at
    ``vocab_local`` fp32 logits each, at least 1 and at most ``rows``."""
    budget = LOSS_CHUNK_BYTES.get(device, LOSS_CHUNK_BYTES["cuda"])
    return max(1, min(rows, budget // (4 * vocab_local)))


def loss_blocks(vocab_local: int, rows: int, device: str = "cuda") -> int:
    """Row blocks of :func:`loss_chunk_rows` rows that ``rows`` token rows make (the last may be
    shorter): the fused loss's blocks, each with its own statistics all-reduces when the
    vocabulary is split."""
    return -(-rows // loss_chunk_rows(vocab_local, rows, device))


CONTEXT_PIECES = 8
"""Most pieces of the ``context`` overlap (:mod:`tetrad.parallel.context`): the K/V all-gather
of context-parallel attention is split over (micro-batch, KV head) into at most this many, each
piece's attention running while the next piece travels (the planner models the same rule,
:func:`context_pieces`)."""


def context_pieces(micro_batch: int, kv_heads_local: int, most: int = CONTEXT_PIECES) -> tuple:
    """``(n_b, n_h)``: the ``context`` overlap's pieces over the micro-batch's ``b`` samples and
    this rank's ``kv_heads / G_y`` KV heads: ``n_h`` the largest divisor of ``kv_heads_local``
    not above ``most``, then ``n_b`` the largest divisor of ``micro_batch`` not above
    ``most // n_h``; ``n_b n_h`` pieces in all (``(1, 1)``: one blocking all-gather)."""
    n_h = max(d for d in range(1, min(most, kv_heads_local) + 1) if kv_heads_local % d == 0)
    left = most // n_h
    n_b = max(d for d in range(1, min(left, micro_batch) + 1) if micro_batch % d == 0)
    return n_b, n_h


EXPERT_PIECES = 2
"""Pieces of the ``expert`` overlap (:mod:`tetrad.parallel.experts`): an MoE block's tokens on
a rank are cut into this many, and each piece's dispatch and combine all-to-alls run while
another piece's experts compute (Tutel's pipelining of the all-to-all with the expert GEMMs,
Hwang et al., arXiv 2206.03382, section 3.2; the planner models the same rule,
:func:`expert_pieces`)."""


def expert_pieces(tokens: int, most: int = EXPERT_PIECES) -> int:
    """Pieces of the ``expert`` overlap for an MoE block's ``tokens`` on a rank (the same on
    every rank of an expert group): ``most``, but no more than the tokens (1: the blocking
    all-to-alls)."""
    return max(1, min(most, tokens))


def piece_sizes(tokens: int, pieces: int) -> list[int]:
    """Tokens of each of ``pieces`` consecutive pieces of ``tokens`` (piece ``i`` ends at
    ``tokens (i+1) // pieces``), as the runtime cuts them and the planner counts them."""
    ends = [tokens * i // pieces for i in range(pieces + 1)]
    return [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]


FINE_CHUNKS = 2
"""Pieces per ring step of the ``fine`` overlap when no ``--machine`` chooses: the fewest that
overlap anything (with one piece per step each fused ``addmm`` waits for the running sum it
folds in, so the ring is serial)."""


class OverlapError(TetradError):
    """An overlap name that is not one of :data:`OVERLAPS`."""


def parse_overlaps(text: str | Iterable[str]) -> frozenset[str]:
    """``"all"``, ``"none"`` or a comma-separated subset of :data:`OVERLAPS` (or the names).

    Raises:
        OverlapError: an unknown name (the message lists the known ones).
    """
    names = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if names == ["all"]:
        return frozenset(OVERLAPS)
    if names in (["none"], []):
        return frozenset()
    bad = [n for n in names if n not in OVERLAPS]
    if bad:
        raise OverlapError(
            f"unknown overlap {bad[0]!r}: use all, none or a comma-separated list "
            f"of {', '.join(OVERLAPS)}"
        )
    return frozenset(names)


PREFETCH_DEPTH = 2
"""Z all-gathers the ``prefetch`` overlap keeps in flight ahead of the weight in use, in
execution order (tetrad/parallel/overlap.py; the planner's replay,
tetrad/plan/comm/zqueue.py): with two, a weight whose all-gather is longer than the layer
before it (Llama's ``w13`` after the short ``wo``) has two layers' compute to hide behind, for
one more gathered weight in memory."""

REDUCE_SCATTERS_IN_FLIGHT = 2
"""Z reduce-scatters of weight gradients the ``reduce_scatter`` overlap leaves in flight
(tetrad/parallel/overlap.py): issuing one more finishes the oldest beyond this count (on NCCL a
wait of the compute stream, not of the host), so every rank hands its gradients to the
data-parallel buckets at the same points of backward, whatever the timing, and issues its Z and
data collectives in one order (NCCL's rule for communicators used side by side). The Z
collectives run in issue order, so finishing a reduce-scatter also waits for the all-gathers
issued before it: with 1 the backward waits for the next weight's all-gather one layer early
(the prefetch depth halved), with ``PREFETCH_DEPTH + 1`` for nothing more, for two more
gradient blocks in memory. The planner replays the waits (tetrad/plan/comm/zqueue.py) and counts
the blocks (``block_gradients``, tetrad/plan/memory/grid_buffers.py); over its snapshot's 144
questions (tests/plan_snapshot.py) 2 is the best of 1, 2 and 3: the best plan at most 1.11x
the time of an unreachable "no wait, no extra block" (1: 1.18x, 3: 1.46x where memory is
tight), 3 of its 170 best plans newly behind the classic ones (1: 19, 3: 4)."""
