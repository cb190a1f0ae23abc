"""Which blocks each pipeline stage holds: contiguous runs of transformer blocks, balanced by
cost, with the embedding counted on the first stage and the final norm, LM head and loss on
the last (torchtitan counts them as extra layers, Megatron-Core's ``account-for-embedding/loss``
options do the same).

A split is a tuple of ``(start, stop)`` block ranges, one per stage in pipeline order (with
``v`` virtual stages per rank there are ``G_pipe v`` stages; stage ``s`` runs on pipeline rank
``s mod G_pipe``, the "loop" placement of interleaved 1F1B). Every stage holds at least one
block but the last, which may hold none: then it runs the final norm, the LM head and the loss
alone, as Megatron-Core's ``--account-for-loss-in-pipeline-split`` lets the last stage's loss
stand in for a block (the head weighs about two blocks of a large Llama, so with one block per
stage the head's stage is otherwise the slowest by that much).
"""

from __future__ import annotations

from collections.abc import Sequence

from tetrad.spec.errors import TetradError

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b")
"""``--pipeline-schedule`` values: ``torch.distributed.pipelining``'s ScheduleGPipe,
Schedule1F1B and ScheduleInterleaved1F1B."""


class PipelineSplitError(TetradError):
    """A pipeline that cannot be split: more stages than blocks, or an explicit split that
    does not cover the blocks in order."""


def balanced_split(
    block_cost: Sequence[float], first_extra: float, last_extra: float, stages: int
) -> tuple[tuple[int, int], ...]:
    """The contiguous split of ``len(block_cost)`` blocks into ``stages`` stages (every one
    non-empty but the last, module doc) that minimises the largest stage cost, where stage 0
    also pays ``first_extra`` (the embedding) and the last stage ``last_extra`` (final norm, LM
    head and loss); among splits with the same maximum, each stage ends at the first block
    from which the stages after it reach their own least maximum (in 1F1B earlier stages hold
    more in-flight micro-batches, so lighter early stages need less memory). So the last stage
    is left empty where that lowers the largest cost of the stages after the one before it: a
    heavy head, or on a tie of the whole maximum (``[1.0] * 3`` with 1.25 and 1.25 over 3
    stages gives ``(1, 2, 0)`` blocks where ``(1, 1, 1)`` has the same maximum); the runtime's
    default costs (1 and 1) never empty it up to 128 blocks.

    Costs are in any one unit (seconds, FLOP). Exact: dynamic programming over
    ``(stage, first block)``, ``O(stages * L^2)`` for ``L`` blocks.

    Raises:
        PipelineSplitError: ``stages`` < 1 or above the number of blocks.
    """
    n = len(block_cost)
    if not 1 <= stages <= n:
        raise PipelineSplitError(
            f"{stages} pipeline stages for {n} blocks: every stage needs at least one block; "
            f"choose pipe x virtual stages <= {n}"
        )
    prefix = [0.0]
    for c in block_cost:
        prefix.append(prefix[-1] + c)

    def cost(s: int, a: int, b: int) -> float:
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    # best[s][a]: the smallest maximum over stages s.. when stage s starts at block a
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[n] * (n + 1) for _ in range(stages + 1)]
    best[stages][n] = 0.0
    last = stages - 1
    best[last][n] = cost(last, n, n) if last else inf  # the last stage empty
    for s in range(stages - 1, -1, -1):
        # stages s+1 .. last-1 need a block each, the last none
        stop_max = n - max(0, last - 1 - s)
        for a in range(s, stop_max if s < last else n):
            for b in range(a + 1, stop_max + 1) if s < last else (n,):
                worst = max(cost(s, a, b), best[s + 1][b])
                if worst < best[s][a] - 1e-12 * max(1.0, worst):
                    best[s][a], cut[s][a] = worst, b
    split, a = [], 0
    for s in range(stages):
        b = cut[s][a]
        split.append((a, b))
        a = b
    return tuple(split)


def check_split(split: Sequence[tuple[int, int]], n_blocks: int) -> tuple[tuple[int, int], ...]:
    """``split`` if its ranges are contiguous, cover ``0..n_blocks`` and are non-empty but
    perhaps the last (module doc).

    Raises:
        PipelineSplitError: naming the first range that is not.
    """
    a = 0
    for i, (start, stop) in enumerate(split):
        if start != a or stop < start or (stop == start and i < len(split) - 1):
            raise PipelineSplitError(
                f"pipeline split {list(split)}: stage {i} is blocks {start}..{stop}, expected "
                f"a non-empty range starting at {a}"
            )
        a = stop
    if a != n_blocks:
        raise PipelineSplitError(f"pipeline split {list(split)} ends at {a}, not {n_blocks}")
    return tuple((int(s), int(e)) for s, e in split)


def explicit_split(text: str, n_blocks: int, n_stages: int) -> tuple[tuple[int, int], ...]:
    """The ``(start, stop)`` blocks of each stage given as ``--pipeline-split`` (blocks per
    stage in pipeline order, comma-separated, ``G_pipe v`` of them: ``"20,20,20,20"``;
    Megatron-LM's even split, or its uneven first and last stages, or any other; the last may
    be 0: ``"11,11,10,0"``, the LM head's stage without blocks).

    Raises:
        PipelineSplitError: not ``n_stages`` whole numbers of at least 1 (0 for the last)
            summing to ``n_blocks`` (one line that says so).
    """
    try:
        blocks = [int(b) for b in text.split(",")]
    except ValueError:
        blocks = []
    least = min(blocks[:-1], default=1)
    if len(blocks) != n_stages or least < 1 or blocks[-1] < 0 or sum(blocks) != n_blocks:
        raise PipelineSplitError(
            f"--pipeline-split {text}: give {n_stages} block counts of at least 1 (the last "
            f"may be 0; G_pipe x virtual stages, in pipeline order) that sum to the model's "
            f"{n_blocks} blocks"
        )
    return split_of_blocks(blocks, n_blocks)


def split_of_blocks(blocks: Sequence[int], n_blocks: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` per stage of ``blocks`` blocks per stage, in pipeline order.

    Raises:
        PipelineSplitError: a stage of no blocks but the last, or not ``n_blocks`` in all
            (:func:`check_split`).
    """
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    return check_split([(a, a + b) for a, b in zip(starts, blocks, strict=True)], n_blocks)


def stages_of_rank(pipe_rank: int, pipe: int, virtual: int) -> tuple[int, ...]:
    """The stages pipeline rank ``pipe_rank`` runs, "loop" placement: ``pipe_rank + k G_pipe``
    for ``k < virtual``."""
    return tuple(pipe_rank + k * pipe for k in range(virtual))


def check_schedule(schedule: str, pipe: int, virtual: int, micro_batches: int) -> None:
    """Check that ``schedule`` runs ``micro_batches`` per step on ``pipe`` ranks with
    ``virtual`` stages each.

    Raises:
        PipelineSplitError: an unknown schedule, virtual stages with a single-stage schedule (or
            none with the interleaved one), fewer micro-batches than stages for 1F1B, or a
            micro-batch count the interleaved schedule cannot split into rounds.
    """
    if schedule not in SCHEDULE_NAMES:
        raise PipelineSplitError(
            f"--pipeline-schedule {schedule!r}: choose one of {', '.join(SCHEDULE_NAMES)}"
        )
    interleaved = schedule == "interleaved-1f1b"
    if interleaved != (virtual > 1):
        raise PipelineSplitError(
            f"--virtual-stages {virtual} with --pipeline-schedule {schedule}: interleaved-1f1b "
            "needs 2 or more virtual stages per rank, gpipe and 1f1b exactly 1"
        )
    if schedule != "gpipe" and micro_batches < pipe:
        raise PipelineSplitError(
            f"{micro_batches} micro-batches per step for {pipe} pipeline stages: {schedule} "
            f"needs at least {pipe}; lower --micro-batch or raise --global-batch"
        )
    if interleaved and micro_batches % pipe:
        raise PipelineSplitError(
            f"{micro_batches} micro-batches per step: interleaved-1f1b needs a multiple of the "
            f"{pipe} pipeline stages"
        )
