"""Memory floors of the pipeline search (:class:`MemoryFloors`, a part of
:class:`tetrad.plan.search.pipelined.PipeSearch`): bytes that a configuration's worst pipeline
rank holds at least under :func:`tetrad.plan.memory.pipeline.pipeline_memory`, cheap enough to
reject a whole ``(G_pipe, G_context, G_y, G_x, b, mode)`` group before its collectives are
timed, a grid before its floors, a schedule before its memory.

Pipeline rank ``r`` with ``k_r`` blocks and ``n_r`` chunk passes in flight
(:func:`tetrad.plan.pipe.schedule.in_flight_chunks`) holds in its phase ``backward: blocks``
(:mod:`tetrad.plan.memory.pipeline`) at least

    16 k_r E + (n_r / v) A(k_r) - 16 H

bytes: ``E`` a block's local weight elements (fp32 parameters, gradients and two AdamW states,
:mod:`tetrad.plan.memory.states`, integer shards as there); ``A(k)`` the saved activations of a
``k``-block model's blocks for one micro-batch
(:func:`tetrad.plan.memory.activations.saved_activations`, which depends on ``G_z`` not at
all); ``H`` the LM head's local elements when the head is tied to the embedding (a rank without
the last stage drops a head the states never counted), else 0; every other term is at least 0.
The floor of a schedule is the largest over its ranks (their stage split is the estimate's,
:func:`tetrad.plan.pipe.estimate.split_ranks`); of a group or a grid, the least over its
schedules. ``E`` and ``H`` fall with ``G_z``: the group's floor (every ``G_z`` dividing ``G_data
G_z``) takes ``E`` at the largest and ``H`` at the smallest.
"""

from __future__ import annotations

import dataclasses

from tetrad.plan.comm.bounds import MARGIN
from tetrad.plan.memory.activations import saved_activations
from tetrad.plan.pipe.estimate import split_key, split_ranks
from tetrad.plan.pipe.schedule import in_flight_chunks
from tetrad.plan.search.space import divisors_of
from tetrad.spec import role_sizes


class MemoryFloors:
    """The floors of the module doc; ``self.ctx`` and ``self.s`` (the 4D search: ``limit``,
    ``dtype``) come from the search, ``_mb_costs`` and ``_configs`` too."""

    def _mem_init(self) -> None:
        self.saved_memo: dict = {}  # (G_context, G_y, G_x, b, mode) -> (A(1), A(2) - A(1))
        self.flight_memo: dict = {}  # ((embedding, head), cfg, m) -> ((k, max n / v), ...)
        self.pairs_memo: dict = {}  # group -> {cfg: ((k, (n / v) A(k)), ...)}
        self.elem_memo: dict = {}  # G_y G_x G_z -> (16 E, 16 H), bytes
        self.gz_memo: dict = {}  # group -> the G_z whose memory floor fits

    def _saved_line(self, gc: int, gy: int, gx: int, b: int, mode: str) -> tuple[float, float]:
        """``(A(1), A(2) - A(1))``: ``A(k)`` of the module doc is affine in ``k`` (every block
        saves the same; the positions and the context's masks are one set for all blocks,
        :func:`tetrad.plan.memory.activations.saved_activations`), bytes."""
        key = (gc, gy, gx, b, mode)
        got = self.saved_memo.get(key)
        if got is None:
            ctx, one_two = self.ctx, []
            for k in (1, 2):
                saved = saved_activations(
                    self._stage_model(k),
                    (1, gc, 1, gy, gx),
                    b,
                    ctx.seq_len,
                    activation_checkpointing=mode,
                    dtype=self.s.dtype,
                )
                one_two.append(saved["blocks"])
            got = self.saved_memo[key] = (one_two[0], one_two[1] - one_two[0])
        return got

    def _stage_model(self, k: int):
        """The model of ``k`` blocks (memoised)."""
        models = self.__dict__.setdefault("stage_models", {})
        got = models.get(k)
        if got is None:
            got = models[k] = dataclasses.replace(self.ctx.model, n_layers=k)
        return got

    def _state_bytes(self, shard: int) -> tuple[float, float]:
        """``(16 E, 16 H)`` of the module doc on ``G_y G_x G_z = shard`` ranks, bytes."""
        got = self.elem_memo.get(shard)
        if got is None:
            model = self.ctx.model
            block = sum(lin.weight_elements // shard * lin.count for lin in model.linears())
            head = model.vocab * model.hidden // shard if model.tied_embeddings else 0
            got = self.elem_memo[shard] = (16.0 * block, 16.0 * head)
        return got

    def _in_flight(self, split: tuple, cfg, m: int) -> tuple:
        """``((k, n / v), ...)``: per distinct block count ``k`` of the ranks of ``cfg``'s
        split (``split``: its :func:`~tetrad.plan.pipe.estimate.split_key`'s embedding and
        head), the most chunk passes in flight of a rank with ``k`` blocks over ``v``."""
        key = (split, cfg, m)
        got = self.flight_memo.get(key)
        if got is None:
            most: dict[int, float] = {}
            L, costs = self.ctx.model.n_layers, (1.0, *split)
            for r in split_ranks(L, costs, cfg.pipe, cfg.virtual):
                n = in_flight_chunks(cfg.schedule, cfg.pipe, r.rank, cfg.virtual, m)
                most[r.blocks] = max(most.get(r.blocks, 0.0), n / cfg.virtual)
            got = self.flight_memo[key] = tuple(most.items())
        return got

    def _group_pairs(self, pipe, gc, gy, gx, b, mode, m) -> dict:
        """``{cfg: ((k, (n / v) A(k)), ...)}`` of every schedule of the group (memoised)."""
        key = (pipe, gc, gy, gx, b, mode)
        got = self.pairs_memo.get(key)
        if got is None:
            one, slope = self._saved_line(gc, gy, gx, b, mode)
            costs = self._mb_costs(gc, gy, gx, b, mode)[2]
            split = split_key(self.ctx.model.n_layers, costs, pipe, 1)[1:3]
            got = self.pairs_memo[key] = {
                cfg: tuple(
                    (k, w * (one + (k - 1) * slope)) for k, w in self._in_flight(split, cfg, m)
                )
                for cfg in self._configs(pipe, m)
            }
        return got

    def _too_big(self, pairs, per_block: float, head: float) -> bool:
        """Whether the floor of one schedule (its ``pairs``) with ``16 E = per_block`` and
        ``16 H = head`` is above the limit (80% of GPU memory), less :data:`MARGIN`."""
        floor = max(per_block * k + act for k, act in pairs) - head
        return floor * (1 - MARGIN) > self.s.limit

    def _grid_too_big(self, pipe, roles, b, mode) -> bool:
        """Whether no schedule of the group fits on the grid of roles ``roles``."""
        gd, gc, gz, gy, gx = roles
        m = self.ctx.global_batch // (gd * gz * b)
        per_block, head = self._state_bytes(gy * gx * gz)
        pairs = self._group_pairs(pipe, gc, gy, gx, b, mode, m)
        return all(self._too_big(p, per_block, head) for p in pairs.values())

    def _fitting_z(self, pipe, q, gc, gy, gx, b, mode) -> tuple[int, ...]:
        """The ``G_z`` dividing ``q = G_data G_z`` on which some schedule of the group has its
        floor within the limit (memoised). Without a tied head (``H = 0``) a schedule's floor
        is within it where ``16 E <= min over k of (limit - (n / v) A(k)) / k``, so one number
        per group decides every ``G_z``."""
        key = (pipe, gc, gy, gx, b, mode)
        got = self.gz_memo.get(key)
        if got is None:
            zs, m = divisors_of(q), self.ctx.global_batch // (q * b)
            if self.ctx.model.tied_embeddings:
                got = tuple(
                    gz
                    for gz in zs
                    if not self._grid_too_big(pipe, (q // gz, gc, gz, gy, gx), b, mode)
                )
            else:
                room = self.s.limit / (1 - MARGIN)
                pairs = self._group_pairs(pipe, gc, gy, gx, b, mode, m)
                most = max(min((room - act) / k for k, act in p) for p in pairs.values())
                got = tuple(gz for gz in zs if self._state_bytes(gy * gx * gz)[0] <= most)
            self.gz_memo[key] = got
        return got

    def _memory_floor_fails(self, grid, turn, b, mode, cfg) -> bool:
        """Whether the floor of ``cfg`` on ``grid`` (its roles in ``turn``) is above the
        limit."""
        gd, gc, gz, gy, gx = role_sizes(grid, turn)
        m = self.ctx.global_batch // (gd * gz * b)
        pairs = self._group_pairs(cfg.pipe, gc, gy, gx, b, mode, m)[cfg]
        return self._too_big(pairs, *self._state_bytes(gy * gx * gz))
