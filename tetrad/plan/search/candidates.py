"""The fitting configurations of one grid of the 4D search, in one orientation, with or
without the sharded optimizer (:class:`Candidates`, a part of
:class:`tetrad.plan.search.four_d._Search4D`), and the memory lines that decide the fit
(:func:`memory_line`)."""

from __future__ import annotations

import bisect

from tetrad.plan.memory.breakdown import FIT_FRACTION
from tetrad.plan.memory.offsets import sharding_offsets
from tetrad.plan.memory.runtime import fewest_selective, phase_totals
from tetrad.plan.memory.zero import state_bytes_per_element
from tetrad.plan.model.spec import ModelSpec
from tetrad.plan.search.space import divisors
from tetrad.spec import role_sizes


class Candidates:
    """The search's per-grid candidates; ``self.ctx``, ``self.stats``, ``self.limit``,
    ``self.mem_bytes``, ``self.dtype``, ``self.prefetch``, ``self.shard_optimizer`` and
    ``self.by_roles`` (an empty dict) come from the search."""

    def _oriented_candidates(
        self, grid, turn: str, checkpointing: tuple[str, ...], allowed: set | None
    ) -> list:
        """The fitting ``(compute seconds, grid, b, mode, turn, sharded)`` of ``grid`` in
        orientation ``turn`` (memory and compute follow the roles' sizes), with the optimizer
        sharded or not (:meth:`variants`); ``checkpointing`` and ``allowed`` are the search's
        (the same in every call).

        Memory and compute depend on the roles' sizes only, and a grid in ``yx`` has the roles
        of the grid with X and Y swapped in ``xy``: the ``(compute seconds, b, mode, sharded)``
        and the counts they added to ``self.stats`` are kept per roles in ``self.by_roles``
        and replayed for the second grid with those roles (same list, same order, same
        counts)."""
        stats, roles = self.stats, role_sizes(grid, turn)
        got = self.by_roles.get(roles)
        if got is None:
            before = (stats["candidates"], stats["fitting"])
            found = self._role_candidates(roles, checkpointing, allowed)
            added = (stats["candidates"] - before[0], stats["fitting"] - before[1])
            got = self.by_roles[roles] = (found, added)
        else:
            stats["candidates"] += got[1][0]
            stats["fitting"] += got[1][1]
        return [(t, grid, b, mode, turn, zero) for t, b, mode, zero in got[0]]

    def _role_candidates(
        self, roles: tuple, checkpointing: tuple[str, ...], allowed: set | None
    ) -> list:
        """The fitting ``(compute seconds, b, mode, sharded)`` of the roles' sizes ``roles =
        (G_data, G_context, G_z, G_y, G_x)`` (:func:`tetrad.spec.role_sizes`)."""
        ctx = self.ctx
        L = ctx.model.n_layers
        gd, gc, gz, gy, gx = roles
        _, block_el, head_el, emb_el = ctx.weight_shards(gx, gy, gz)
        local = L * block_el + head_el + emb_el + ctx.vector_elements(gx, gy)
        per_cell = ctx.global_batch // (gd * gz)
        sizes = [b for b in divisors(per_cell) if allowed is None or b in allowed]
        out, model, dt, pre = [], ctx.model, self.dtype, self.prefetch
        if not sizes:
            return out
        raw: dict = {}  # mode -> its phases' lines, once per roles
        lines: dict = {}  # (mode, sharded) -> its memory line

        def line(mode: str, zero: bool):
            if (mode, zero) not in lines:
                if mode not in raw:
                    raw[mode] = phase_lines(model, roles, ctx.seq_len, mode, dt, pre, sizes)
                shift = sharding_offsets(model, roles, dt, pre) if zero else None
                lines[(mode, zero)] = line_of(raw[mode], self.limit, sizes, shift)
            return lines[(mode, zero)]

        plain_fits = 16.0 * local <= self.limit  # exact floor: 16 B per local element
        for zero in self.variants(gd * gc):
            # with the states sharded 8 + 8 / (G_data G_context) B per local element
            if zero and state_bytes_per_element(True, gd * gc) * local > self.limit:
                continue
            if not zero and not plain_fits:
                continue
            for ckpt in checkpointing:
                # auto: sharded only where the same mode unsharded does not fit
                other = None
                if zero and self.shard_optimizer == "auto" and plain_fits:
                    other = line(ckpt, False)
                    if other(sizes[-1]) <= self.limit:
                        continue  # every micro-batch fits unsharded (memory grows with it)
                out += self._mode_candidates(roles, ckpt, zero, sizes, line, other)
        return out

    def _mode_candidates(self, roles, ckpt, zero, sizes, line, other) -> list:
        """The fitting candidates of one checkpointing mode ``ckpt`` (``zero``: the states
        sharded), ``line(mode, zero)`` the memory lines, ``other`` the unsharded line of a
        sharded variant under ``auto`` (None otherwise: every fitting micro-batch counts)."""
        ctx, stats, out = self.ctx, self.stats, []
        model, L = ctx.model, ctx.model.n_layers
        per_cell = ctx.global_batch // (roles[0] * roles[2])
        peak = line(ckpt, zero)
        plain = None  # selective where none does not fit: only as many blocks as needed
        if ckpt == "selective" and L > 1:
            plain = line("none", zero)
        if other is not None:  # the micro-batches too large to fit unsharded (the later ones)
            sizes = sizes[bisect.bisect_left(sizes, True, key=lambda b: other(b) > self.limit) :]
        for b in sizes:
            stats["candidates"] += 1
            if peak(b) > self.limit:
                break
            stats["fitting"] += 1
            mode = ckpt
            if plain is not None and plain(b) > self.limit:
                mem, dt, pre = self.mem_bytes, self.dtype, self.prefetch
                mode = fewest_selective(model, roles, b, ctx.seq_len, mem, dt, pre, zero)
            fwd, bwd, rec = ctx.micro_batch_seconds(roles, b, mode)
            out.append(((per_cell // b) * (fwd + bwd + rec), b, mode, zero))
        return out

    def variants(self, data_group: int) -> tuple[bool, ...]:
        """Whether the optimizer is sharded, the choices tried on a grid whose data group has
        ``data_group = G_data G_context`` ranks: ``off`` unsharded; ``on`` sharded (unsharded
        with one rank); ``auto`` both, sharded only where unsharded does not fit."""
        if data_group == 1 or self.shard_optimizer == "off":
            return (False,)
        return (True,) if self.shard_optimizer == "on" else (False, True)


def memory_line(
    model: ModelSpec,
    grid,
    seq_len: int,
    mem_bytes: float,
    ckpt: str,
    dtype: str,
    prefetch: bool,
    sizes: list[int],
    shard_optimizer: bool = False,
):
    """``b -> peak bytes`` of :func:`tetrad.plan.memory.runtime.tetrad` from two evaluations: every
    phase's total is affine in the micro-batch (activations, logits and recompute sets grow with
    ``m``; weights, gathered blocks and step buffers do not), so the peak is the maximum of the
    phases' lines. ``inf`` for every ``b`` when ``b = 1`` already does not fit. With
    ``shard_optimizer`` the phases move by :func:`tetrad.plan.memory.runtime.sharding_offsets`
    (constants in ``b``)."""
    if not sizes:
        return lambda b: float("inf")
    lines = phase_lines(model, grid, seq_len, ckpt, dtype, prefetch, sizes)
    offsets = sharding_offsets(model, tuple(grid), dtype, prefetch) if shard_optimizer else None
    return line_of(lines, FIT_FRACTION * mem_bytes, sizes, offsets)


class PhaseLines:
    """Per phase of :func:`tetrad.plan.memory.runtime.tetrad` (unsharded optimizer): its bytes
    at ``b = 1`` (:attr:`lo`) and their growth per sample of the micro-batch (:meth:`slopes`,
    evaluated at ``b = 2`` only when asked: a grid that does not fit at ``b = 1`` needs none)."""

    def __init__(self, model, grid, seq_len, ckpt, dtype, prefetch, sizes: list[int]):
        self._args = (model, grid, seq_len, ckpt, dtype, prefetch)
        self.last = sizes[-1]
        self.lo = self._at(1)
        self._slopes: dict | None = None

    def _at(self, b: int) -> dict[str, float]:
        model, grid, seq_len, ckpt, dtype, prefetch = self._args
        options = {"activation_checkpointing": ckpt, "dtype": dtype, "prefetch": prefetch}
        return phase_totals(model, grid, b, seq_len, **options)

    def slopes(self) -> dict[str, float]:
        if self._slopes is None:
            hi = self._at(2) if self.last > 1 else self.lo
            self._slopes = {k: hi[k] - self.lo[k] for k in self.lo}
        return self._slopes


def phase_lines(
    model: ModelSpec, grid, seq_len: int, ckpt: str, dtype: str, prefetch: bool, sizes: list[int]
) -> PhaseLines:
    """The :class:`PhaseLines` of a grid and mode."""
    return PhaseLines(model, grid, seq_len, ckpt, dtype, prefetch, sizes)


def line_of(lines: PhaseLines, limit: float, sizes: list[int], offsets: dict | None = None):
    """``b -> peak bytes`` from :func:`phase_lines` (each phase moved by ``offsets``); ``inf``
    for every ``b`` when ``b = 1`` is above ``limit``."""
    lo = lines.lo
    if offsets:
        lo = {k: v + offsets[k] for k, v in lo.items()}
    peak = max(lo.values())  # MemoryBreakdown.total: the peak phase's
    if peak > limit:
        return lambda b: float("inf")
    if sizes[-1] == 1:
        return lambda b: peak
    slopes = lines.slopes()
    pairs = [(lo[k], slopes[k]) for k in lo]

    def peak_at(b: int) -> float:
        d = b - 1
        return max([a + d * s for a, s in pairs])  # a list: faster than a generator here

    return peak_at
