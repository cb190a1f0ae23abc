"""Memory floors of the pipeline search (:class:`MemoryFloors`, which
:class:`tetrad.plan.search.pipeline.pipe_search.PipeSearch` and its group bounds ask): bytes that
a configuration's worst pipeline
rank holds at least under :func:`tetrad.plan.memory.pipeline.pipeline_memory`, cheap enough to
reject a whole ``(G_pipe, G_context, G_y, G_x, b, mode)`` group before its collectives are
timed, a grid before its floors, a schedule before its memory.

Pipeline rank ``r`` with ``k_r`` blocks holds in its phase ``backward: blocks``
(:mod:`tetrad.plan.memory.pipeline`) at least

    16 k_r E - 16 H + sum_j c_j (A(b_j) - C) + C - [c_last = 0] F + (i_r + q_r) P

bytes: ``E`` a block's local weight elements (fp32 parameters, gradients and two AdamW states,
:mod:`tetrad.plan.memory.states`, integer shards as there); ``H`` the LM head's local elements
when the head is tied to the embedding (a rank without the last stage drops a head the states
never counted), else 0; ``A(b)`` the saved activations of a ``b``-block stage's blocks for one
micro-batch (:func:`tetrad.plan.memory.activations.saved_activations`, taken with ``G_z = 1``:
``G_z > 1`` adds the LM head's saved ``dW`` to ``A`` and ``F`` alike, which the floor leaves
out), ``C`` of which the context masks and chunk order each stage saves once
(:func:`tetrad.plan.memory.activations.context_shared_bytes`; 0 under ``full``); ``F`` the
final norm's and loss's saved bytes, ``P`` a receive buffer's (``[b, S / G_context, h /
G_x]`` in the compute dtype).

``c_j`` are the passes in flight on the rank's ``j``-th stage (``b_j`` blocks; the sums run
over the stages that hold blocks: the LM head's stage may hold none) in one set of
:func:`tetrad.plan.memory.pipeline.in_flight_sets`, those its schedule holds at its peak: the
memory counts the set with the most bytes, at least this one's. GPipe and 1F1B hold
:func:`tetrad.plan.pipe.schedule.in_flight_chunks` of their one stage. Interleaved 1F1B's order
(:func:`tetrad.plan.memory.pipeline.interleaved_order`) runs its warm-up forwards, then one
forward and one backward per step: the set after the first of those forwards (or after all
forwards) holds the most passes, the warm-up's plus one, ``per`` micro-batches per stage in
turn (:func:`warm_passes`). The last rank's one micro-batch's final norm and loss, which the
phase counts besides, are among its passes' unless its last stage holds none
(``c_last = 0``). Its receive buffers are at least the ``q_r`` posted ahead
(:func:`tetrad.plan.pipe.schedule.boundaries_of_rank`) and the inputs of its passes in flight,
``i_r = sum_j c_j`` but on the rank of stage 0 (0 there). Every other term is at least 0.

The floor of a schedule is the largest over its ranks (their stage split is the estimate's,
:func:`tetrad.plan.pipe.pipeline_step.split_ranks`); of a group or a grid, the least over its
schedules. ``E`` and ``H`` fall with ``G_z``: the group's floor (every ``G_z`` dividing ``G_data
G_z``) takes ``E`` at the largest and ``H`` at the smallest.

Where the search may shard the optimizer (``shard_optimizer`` not ``off``) and ``G = G_data
G_context > 1``, 16 becomes ``8 + 8 / G`` (the AdamW states over the data group,
:func:`tetrad.plan.memory.sharded_optimizer.state_bytes_per_element`), a floor of both variants;
with ``G_data G_z = q`` fixed, ``(8 + 8 G_z / (q G_context)) E`` still falls with ``G_z``.
"""

from __future__ import annotations

import dataclasses

from tetrad.plan.memory.activations import context_shared_bytes, saved_activations
from tetrad.plan.memory.formats import dtype_bytes
from tetrad.plan.memory.sharded_optimizer import state_bytes_per_element
from tetrad.plan.pipe.pipeline_step import split_ranks
from tetrad.plan.pipe.schedule import boundaries_of_rank, in_flight_chunks, p2p_bytes
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.memory_fits import sequence_parallel_memory
from tetrad.plan.search.pipeline.configs import schedules
from tetrad.plan.search.pipeline.floor_terms import FloorTerms
from tetrad.plan.search.space import divisors_of
from tetrad.plan.search.step_bounds import MARGIN
from tetrad.spec.grid import role_sizes


class MemoryFloors:
    """The floors of the module doc, memoised.

    Args:
        ctx: the question (:class:`~tetrad.plan.question.StepQuestion`).
        limit: bytes a rank may hold (80% of GPU memory): a floor above it, less
            :data:`~tetrad.plan.search.step_bounds.MARGIN`, rejects.
        dtype: ``"bf16"`` or ``"fp32"`` (the saved activations' and receive buffers' bytes).
        shard_optimizer: ``"off"``, ``"on"`` or ``"auto"``: the states take ``8 + 8 / G`` bytes
            per element where the search may shard them, 16 otherwise.
        terms: the floors' memoised terms (the split's cost ratios).
        params: the weights' stored format (``bf16``: 18 bytes per element, ``6 + 12 / G``
            where the search may shard the states with their fp32 masters).
        residual: the residual stream's format (None: ``dtype``'s): the saved activations'.
        regather: with sequence parallelism, the first Linears' inputs kept split
            (``--sequence-parallel-regather``): the saved activations'.
    """

    def __init__(
        self,
        ctx: StepQuestion,
        limit: float,
        dtype: str,
        shard_optimizer: str,
        terms: FloorTerms,
        params: str = "fp32",
        residual: str | None = None,
        regather: bool = False,
    ):
        self.ctx, self.limit, self.dtype, self.params = ctx, limit, dtype, params
        self.residual, self.regather = residual, regather
        self.shard_optimizer, self.terms = shard_optimizer, terms
        self.saved_memo: dict = {}  # (G_context, G_y, G_x, b, mode) -> (A(1), A(2) - A(1), C, F)
        self.flight_memo: dict = {}  # ((embedding, head), cfg, m) -> per rank kind, its terms
        self.flights_memo: dict = {}  # ((embedding, head), p, m) -> those of its schedules
        self.terms_memo: dict = {}  # (G_context, G_y, G_x, b, mode) -> (A(1), .., P, split)
        self.pairs_memo: dict = {}  # (group, cfg) -> ((k, bytes besides 16 k E), ...)
        self.elem_memo: dict = {}  # G_y G_x G_z -> (16 E, 16 H), bytes
        self.gz_memo: dict = {}  # group -> the G_z whose memory floor fits
        self.z_states_memo: dict = {}  # (G_data G_z, G_context, G_y, G_x) -> ((G_z, 16 E), ..)
        self.stage_models: dict = {}  # blocks -> the model of that many blocks

    def _saved_line(self, gc: int, gy: int, gx: int, b: int, mode: str) -> tuple:
        """``(A(1), A(2) - A(1), C, F)`` of the module doc: ``A(s)`` is affine in ``s`` (every
        block saves the same; the positions and the context's masks are one set for the stage,
        :func:`tetrad.plan.memory.activations.saved_activations`), bytes."""
        key = (gc, gy, gx, b, mode)
        got = self.saved_memo.get(key)
        if got is None:
            ctx, saved = self.ctx, []
            for k in (1, 2):
                saved.append(
                    saved_activations(
                        self._stage_model(k),
                        (1, gc, 1, gy, gx),
                        b,
                        ctx.seq_len,
                        activation_checkpointing=mode,
                        dtype=self.dtype,
                        sequence_parallel=sequence_parallel_memory(
                            ctx.sequence_split(gc, gy, gx) > 1, self.regather
                        ),
                        residual=self.residual,
                    )
                )
            one, two = saved[0]["blocks"], saved[1]["blocks"]
            shared = 0.0
            if mode.partition(":")[0] != "full":
                shared = context_shared_bytes(ctx.seq_len, gc, dtype_bytes(self.dtype))
            ends = saved[0]["final_norm"] + saved[0]["loss"]
            got = self.saved_memo[key] = (one, two - one, shared, ends)
        return got

    def _stage_model(self, k: int):
        """The model of ``k`` blocks (memoised)."""
        got = self.stage_models.get(k)
        if got is None:
            got = self.stage_models[k] = dataclasses.replace(self.ctx.model, n_layers=k)
        return got

    def _state_bytes(self, shard: int, group: int = 1) -> tuple[float, float]:
        """``(16 E, 16 H)`` of the module doc on ``G_y G_x G_z = shard`` ranks, bytes; where
        the search may shard the optimizer over a data group of ``group = G_data G_context > 1``
        ranks, ``8 + 8 / group`` bytes per element instead of 16 (a floor of both)."""
        sharded = self.shard_optimizer != "off" and group > 1
        per = state_bytes_per_element(sharded, group, self.params)
        key = (shard, per)
        got = self.elem_memo.get(key)
        if got is None:
            model = self.ctx.model
            block = sum(lin.weight_elements // shard * lin.count for lin in model.linears())
            head = model.vocab_size * model.dim // shard if model.tied_embeddings else 0
            got = self.elem_memo[key] = (per * block, per * head)
        return got

    def _in_flight(self, split: tuple, cfg, m: int) -> tuple:
        """``((k, passes, sum_j c_j (b_j - 1), stages holding some, drops F, buffers),
        ...)``: per rank of ``cfg``'s split (``split``: its
        :func:`~tetrad.plan.pipe.pipeline_step.split_key`'s embedding and head), the terms of the
        module doc's floor; ranks alike once, and none whose floor another's is at least
        whatever the bytes (:func:`_undominated`)."""
        key = (split, cfg, m)
        got = self.flight_memo.get(key)
        if got is None:
            ranks = set()
            L, costs, p, v = self.ctx.model.n_layers, (1.0, *split), cfg.pipe, cfg.virtual
            for r in split_ranks(L, costs, p, v):
                if cfg.schedule == "interleaved-1f1b":
                    c = warm_passes(p, r.rank, v, m)
                else:
                    c = (in_flight_chunks(cfg.schedule, p, r.rank, v, m),)
                # a stage of no blocks (the LM head's alone) saves no block's tensors
                full = [(n_j, b_j) for n_j, b_j in zip(c, r.chunk_blocks, strict=True) if b_j]
                n = sum(n_j for n_j, _ in full)
                more = sum(n_j * (b_j - 1) for n_j, b_j in full)
                buffers = (0 if r.first else sum(c)) + sum(boundaries_of_rank(p, r.rank, v))
                drop = r.last and c[-1] == 0
                ranks.add((r.blocks, n, more, sum(bool(n_j) for n_j, _ in full), drop, buffers))
            got = self.flight_memo[key] = _undominated(ranks)
        return got

    def _flights(self, split: tuple, pipe: int, m: int) -> tuple:
        """:meth:`_in_flight` of each schedule of ``p = pipe`` and ``m`` micro-batches, in
        :func:`~tetrad.plan.search.pipeline.configs.schedules` order (memoised)."""
        key = (split, pipe, m)
        got = self.flights_memo.get(key)
        if got is None:
            got = tuple(
                self._in_flight(split, cfg, m)
                for cfg in schedules(pipe, m, self.ctx.model.n_layers)
            )
            self.flights_memo[key] = got
        return got

    def _group_terms(self, pipe, gc, gy, gx, b, mode, m) -> tuple:
        """``(A(1), A(2) - A(1), C, F, P, split)`` of the group (module doc; ``split``: the
        embedding's and head's cost of :func:`~tetrad.plan.pipe.pipeline_step.split_key`)."""
        key = (gc, gy, gx, b, mode)  # the split's ratios do not depend on p
        got = self.terms_memo.get(key)
        if got is None:
            ctx = self.ctx
            split = ctx.sequence_split(gc, gy, gx)
            e = dtype_bytes(self.dtype)
            out = p2p_bytes(b, ctx.seq_len, ctx.model.dim, gc, gx, e, split)
            split = self.terms.micro_batch_costs(gc, gy, gx, b, mode)[3]
            got = (*self._saved_line(gc, gy, gx, b, mode), out, split)
            self.terms_memo[key] = got
        return got

    def _pairs(self, gc, gy, gx, b, mode, m, cfg) -> tuple:
        """``((k, floor less 16 k E - 16 H), ...)`` of schedule ``cfg`` in the group, one per
        kind of rank (memoised)."""
        key = (gc, gy, gx, b, mode, cfg)
        got = self.pairs_memo.get(key)
        if got is None:
            one, slope, shared, ends, out, split = self._group_terms(
                cfg.pipe, gc, gy, gx, b, mode, m
            )
            got = self.pairs_memo[key] = tuple(
                (k, n * (one - shared) + more * slope + held * shared - ends * drop + q * out)
                for k, n, more, held, drop, q in self._in_flight(split, cfg, m)
            )
        return got

    def _too_big(self, pairs, per_block: float, head: float) -> bool:
        """Whether the floor of one schedule (its ``pairs``) with ``16 E = per_block`` and
        ``16 H = head`` is above the limit (80% of GPU memory), less :data:`MARGIN`."""
        floor = max(per_block * k + act for k, act in pairs) - head
        return floor * (1 - MARGIN) > self.limit

    def grid_too_big(self, pipe, roles, b, mode) -> bool:
        """Whether no schedule of the group fits on the grid of roles ``roles``."""
        gd, gc, gz, gy, gx = roles
        m = self.ctx.global_batch // (gd * gz * b)
        per_block, head = self._state_bytes(gy * gx * gz, gd * gc)
        return all(
            self._too_big(self._pairs(gc, gy, gx, b, mode, m, cfg), per_block, head)
            for cfg in schedules(pipe, m, self.ctx.model.n_layers)
        )

    def fitting_z(self, pipe, q, gc, gy, gx, b, mode) -> tuple[int, ...]:
        """The ``G_z`` dividing ``q = G_data G_z`` on which some schedule of the group has its
        floor within the limit (memoised). Without a tied head (``H = 0``) a schedule's floor
        is within it where ``16 E <= min over ranks of (limit - floor less 16 k E) / k``: the
        largest such number over the schedules decides every ``G_z`` (no more schedules once
        it admits the smallest ``G_z``)."""
        key = (pipe, gc, gy, gx, b, mode)
        got = self.gz_memo.get(key)
        if got is None:
            zs, m = divisors_of(q), self.ctx.global_batch // (q * b)
            if self.ctx.model.tied_embeddings:
                got = tuple(
                    gz
                    for gz in zs
                    if not self.grid_too_big(pipe, (q // gz, gc, gz, gy, gx), b, mode)
                )
            else:
                states = self._z_states(q, gc, gy, gx)
                most = self._weights_room(pipe, gc, gy, gx, b, mode, m, states[0][1])
                got = tuple(gz for gz, per_block in states if per_block <= most)
            self.gz_memo[key] = got
        return got

    def _z_states(self, q: int, gc: int, gy: int, gx: int) -> tuple:
        """``((G_z, 16 E), ...)`` for each ``G_z`` dividing ``q = G_data G_z`` in ascending
        order (:meth:`_state_bytes`; memoised: every micro-batch and mode of a shape asks)."""
        key = (q, gc, gy, gx)
        got = self.z_states_memo.get(key)
        if got is None:
            got = tuple(
                (gz, self._state_bytes(gy * gx * gz, q // gz * gc)[0]) for gz in divisors_of(q)
            )
            self.z_states_memo[key] = got
        return got

    def _weights_room(self, pipe, gc, gy, gx, b, mode, m, need: float) -> float:
        """The largest ``16 E`` (bytes per block, no tied head) with which some schedule of the
        group has its floor within the limit: the largest over the schedules of the least over
        their ranks of ``(limit - floor less 16 k E) / k`` (the first at least ``need``, the
        ``16 E`` of the smallest ``G_z``, ends it)."""
        one, slope, shared, ends, out, split = self._group_terms(pipe, gc, gy, gx, b, mode, m)
        room = self.limit / (1 - MARGIN)
        most = -float("inf")
        for flight in self._flights(split, pipe, m):
            least = min(
                [
                    _per_block(
                        room
                        - n * (one - shared)
                        - more * slope
                        - held * shared
                        + ends * drop
                        - q * out,
                        k,
                    )
                    for k, n, more, held, drop, q in flight
                ]
            )
            if least > most:
                most = least
                if most >= need:
                    break
        return most

    def schedule_fails(self, grid, turn, b, mode, cfg) -> bool:
        """Whether the floor of ``cfg`` on ``grid`` (its roles in ``turn``) is above the
        limit."""
        gd, gc, gz, gy, gx = role_sizes(grid, turn)
        m = self.ctx.global_batch // (gd * gz * b)
        pairs = self._pairs(gc, gy, gx, b, mode, m, cfg)
        return self._too_big(pairs, *self._state_bytes(gy * gx * gz, gd * gc))


def _per_block(free: float, k: int) -> float:
    """The most bytes per block that a rank of ``k`` blocks leaves room for, ``free`` bytes
    left besides its blocks' states: ``free / k``; a rank of no blocks (the LM head's stage
    alone) fits any or none."""
    if k:
        return free / k
    return float("inf") if free >= 0 else -float("inf")


def warm_passes(pipe: int, rank: int, virtual: int, micro_batches: int) -> tuple[int, ...]:
    """The passes in flight per local stage of pipeline rank ``rank`` under interleaved 1F1B
    after its warm-up forwards and the first steady one, before any backward (all forwards
    when the warm-up takes them all): :func:`tetrad.plan.memory.pipeline.interleaved_order`'s
    forwards ``i`` run local stage ``(i // per) % v``, ``per = m / max(1, m // p)`` micro-batches
    per round; a set of :func:`tetrad.plan.memory.pipeline.in_flight_sets` (module doc)."""
    per = micro_batches // max(1, micro_batches // pipe)
    total = micro_batches * virtual
    warmup = min((virtual - 1) * per + 2 * (pipe - 1 - rank), total)
    cycles, rest = divmod(min(warmup + 1, total), per * virtual)
    return tuple(cycles * per + min(per, max(0, rest - j * per)) for j in range(virtual))


def _undominated(ranks) -> tuple:
    """The ranks' terms ``(k, passes, more, held, drops F, buffers)`` less those another
    rank's are at least: as many blocks or more, each count at least as large and ``F`` not
    dropped where it is (every byte count of the floor is at least 0, so that rank's floor is
    at least this one's whatever they are, and its room per block at most this one's)."""
    kept: list[tuple] = []
    for r in sorted(ranks, reverse=True):  # most blocks first: a dominating rank comes first
        if not any(
            o[0] >= r[0]
            and all(a >= b for a, b in zip(o[1:4], r[1:4], strict=True))
            and o[5] >= r[5]
            and (not o[4] or r[4])
            for o in kept
        ):
            kept.append(r)
    return tuple(kept)
