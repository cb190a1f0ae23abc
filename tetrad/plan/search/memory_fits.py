"""What fits in memory on the grids of the 4D search (:class:`MemoryFits`, which
:class:`tetrad.plan.search.four_d.Search4D` asks): per role assignment ``(G_data, G_context,
G_z, G_y, G_x)`` and optimizer variant, the checkpointing modes and micro-batches whose
:func:`tetrad.plan.memory.runtime.runtime_memory` estimate is within 80% of GPU memory
(:class:`RoleFits`), from memory lines in the micro-batch alone (:func:`memory_line`): every
phase's total is affine in ``b``, so two evaluations give the peak for every ``b``; a cheaper
floor of the same before the lines are built (:meth:`MemoryFits.may_fit`); and the fitting
configurations with their compute seconds, only for the groups the search times
(:meth:`MemoryFits.expand`).

The optimizer variants tried (:func:`optimizer_variants`): the AdamW states unsharded, sharded
over the data group (data x context, ZeRO-1), or both under ``auto``, each where it fits
(:mod:`tetrad.plan.memory.sharded_optimizer`; neither is always the faster: the sharded one's
all-gather after the update is exposed, but with bf16 weights it carries half the bytes, and
in a pipeline the reduce-scatter leaves less of the tail to the cool-down)."""

from __future__ import annotations

import bisect

from tetrad.plan.memory.activations import saved_activations
from tetrad.plan.memory.breakdown import FIT_FRACTION
from tetrad.plan.memory.runtime import fewest_selective, phase_totals, sharding_offsets
from tetrad.plan.memory.sharded_optimizer import state_bytes_per_element
from tetrad.plan.memory.states import local_parameter_elements
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.space import divisors_of
from tetrad.spec.grid import role_sizes
from tetrad.spec.model import ModelSpec


class RoleFits:
    """What fits on one role assignment ``(G_data, G_context, G_z, G_y, G_x)``
    (:func:`tetrad.spec.grid.role_sizes`), from its memory lines alone: per optimizer variant and
    checkpointing mode the fitting micro-batches; and, once asked for
    (:meth:`MemoryFits.expand`), the configurations with their compute seconds.

    Attributes:
        modes: ``(sharded, mode, fitting micro-batches, the mode-none line or None)`` in
            enumeration order; the line (``selective`` only) picks ``selective:K`` per
            micro-batch where ``none`` does not fit.
        added: ``(candidates, fitting)``: what these added to the search's statistics.
        expanded: sharded -> its configurations (:meth:`MemoryFits.expand`).
    """

    __slots__ = ("modes", "added", "expanded")

    def __init__(self) -> None:
        self.modes: list[tuple] = []
        self.added = (0, 0)
        self.expanded: dict = {}

    def variants(self) -> list[bool]:
        """The optimizer variants with something that fits, in enumeration order."""
        return list(dict.fromkeys(zero for zero, _, sizes, _ in self.modes if sizes))

    def classes(self, zero: bool) -> dict[bool, list[int]]:
        """Per ``full`` (whether the mode is ``full``): the micro-batches that fit in variant
        ``zero`` in some mode of that class."""
        out: dict[bool, set] = {}
        for z, mode, sizes, _ in self.modes:
            if z == zero and sizes:
                out.setdefault(mode == "full", set()).update(sizes)
        return {full: sorted(sizes) for full, sizes in out.items()}


def sequence_parallel_memory(on: bool, regather: bool = False) -> bool | str:
    """The ``sequence_parallel`` keyword of the memory and step models
    (:func:`~tetrad.plan.memory.runtime.runtime_memory`,
    :class:`~tetrad.plan.question.StepQuestion`) where sequence parallelism runs (``on``; on a
    grid: its sequence split over Y, :meth:`~tetrad.plan.question.StepQuestion.sequence_split`,
    above 1): False where it does not, else ``"regather"`` with ``regather``
    (``--sequence-parallel-regather``: each pair's first Linear keeps its input's sequence
    shard), else True."""
    if not on:
        return False
    return "regather" if regather else True


class MemoryFits:
    """What fits in memory on the grids of one 4D search, memoised per role assignment.

    Args:
        ctx: the question (:class:`~tetrad.plan.question.StepQuestion`).
        mem_bytes: GPU memory, bytes; a configuration fits within :data:`FIT_FRACTION` of it.
        dtype: ``"bf16"`` or ``"fp32"`` (the memory model's compute dtype).
        prefetch: the ``prefetch`` overlap is on (the memory model's gathered weights).
        shard_optimizer: ``"off"``, ``"on"`` or ``"auto"`` (:func:`optimizer_variants`).
        modes: the checkpointing modes tried, in enumeration order.
        params: the weights' stored format (``fp32``; ``bf16`` with fp32 masters).
        residual: the residual stream's format (``--residual-dtype``: ``fp32`` or ``bf16``;
            None, ``auto``: ``dtype``'s), as :func:`~tetrad.plan.memory.runtime.runtime_memory`'s.
        regather: with sequence parallelism, each pair's first Linear keeps its input's sequence
            shard (``--sequence-parallel-regather``; :func:`sequence_parallel_memory`).
        allowed: the micro-batches allowed (None: every divisor).
        stats: the search's statistics, whose ``candidates`` (configurations enumerated: every
            mode and micro-batch up to the first that does not fit) and ``fitting`` counts the
            fits add to.
    """

    def __init__(
        self,
        ctx: StepQuestion,
        mem_bytes: float,
        dtype: str,
        prefetch: bool,
        shard_optimizer: str,
        modes: tuple[str, ...],
        allowed: set | None,
        stats: dict,
        params: str = "fp32",
        residual: str | None = None,
        regather: bool = False,
    ):
        self.ctx, self.mem_bytes, self.dtype, self.prefetch = ctx, mem_bytes, dtype, prefetch
        self.params, self.residual, self.regather = params, residual, regather
        self.limit = FIT_FRACTION * mem_bytes
        self.shard_optimizer, self.modes, self.allowed = shard_optimizer, modes, allowed
        self.stats = stats
        self.by_roles: dict = {}  # roles' sizes -> their RoleFits
        self.may_fit_memo: dict = {}  # roles' sizes -> what may fit (may_fit)
        self.saved_memo: dict = {}  # (G_context, G_y, G_x, full) -> saved bytes' line

    def oriented_fits(self, grid, turn: str) -> RoleFits:
        """The :class:`RoleFits` of ``grid`` in orientation ``turn`` (memory and compute follow
        the roles' sizes), with the optimizer sharded or not (:meth:`variants`), in the modes
        and micro-batches the search tries.

        A grid in ``yx`` has the roles of the grid with X and Y swapped in ``xy``: the fits and
        the counts they added to ``self.stats`` are kept per roles in ``self.by_roles`` and
        replayed for the second grid with those roles."""
        stats, roles = self.stats, role_sizes(grid, turn)
        got = self.by_roles.get(roles)
        if got is None:
            before = (stats["candidates"], stats["fitting"])
            got = self.by_roles[roles] = self._role_fits(roles, self.modes, self.allowed)
            got.added = (stats["candidates"] - before[0], stats["fitting"] - before[1])
        else:
            stats["candidates"] += got.added[0]
            stats["fitting"] += got.added[1]
        return got

    def _role_fits(
        self, roles: tuple, checkpointing: tuple[str, ...], allowed: set | None
    ) -> RoleFits:
        """The :class:`RoleFits` of the roles' sizes ``roles``."""
        ctx, out = self.ctx, RoleFits()
        gd, gc = roles[:2]
        local, sizes = self._cell(roles, allowed)
        model, dt, pre = ctx.model, self.dtype, self.prefetch
        if not sizes:
            return out
        raw: dict = {}  # mode -> its phases' lines, once per roles
        lines: dict = {}  # (mode, sharded) -> its memory line

        sp = sequence_parallel_memory(ctx.sequence_split(gc, roles[3], roles[4]) > 1, self.regather)

        def line(mode: str, zero: bool):
            if (mode, zero) not in lines:
                if mode not in raw:
                    args = (model, roles, ctx.seq_len, mode, dt, pre, sizes, self.params)
                    raw[mode] = phase_lines(*args, sp, self.residual)
                shift = sharding_offsets(model, roles, dt, pre, self.params) if zero else None
                lines[(mode, zero)] = line_of(raw[mode], self.limit, sizes, shift)
            return lines[(mode, zero)]

        # exact: 16 B per local element (18 with bf16 weights and fp32 masters)
        plain_fits = state_bytes_per_element(False, 1, self.params) * local <= self.limit
        for zero in self.variants(gd * gc):
            # with the states sharded 8 + 8 / (G_data G_context) B per local element
            if zero and state_bytes_per_element(True, gd * gc, self.params) * local > self.limit:
                continue
            if not zero and not plain_fits:
                continue
            for ckpt in checkpointing:
                out.modes.append(self._mode_fits(ckpt, zero, sizes, line))
        return out

    def _cell(self, roles: tuple, allowed: set | None) -> tuple[int, list[int]]:
        """``(local elements, micro-batches)`` of the roles ``roles``: this rank's parameter
        elements (:func:`tetrad.plan.memory.states.local_parameter_elements`, whose 16 B each,
        8 + 8 / (G_data G_context) with the states sharded, the memory model counts) and the
        micro-batches dividing the samples of a (data, Z) cell, ``B / (G_data G_z)``, that
        ``allowed`` (None: all) allows."""
        elements = local_parameter_elements(self.ctx.model, roles)
        per_cell = self.ctx.global_batch // (roles[0] * roles[2])
        sizes = [b for b in divisors_of(per_cell) if allowed is None or b in allowed]
        return elements["matrices"] + elements["vectors"], sizes

    def _mode_fits(self, ckpt, zero, sizes, line) -> tuple:
        """``(sharded, mode, fitting micro-batches, the mode-none line or None)`` of one
        checkpointing mode ``ckpt`` (``zero``: the states sharded), ``line(mode, zero)`` the
        memory lines."""
        stats = self.stats
        peak = line(ckpt, zero)
        plain = None  # selective where none does not fit: only as many blocks as needed
        if ckpt == "selective" and self.ctx.model.n_layers > 1:
            plain = line("none", zero)
        fit = []
        for b in sizes:
            stats["candidates"] += 1
            if peak(b) > self.limit:
                break  # memory grows with the micro-batch
            stats["fitting"] += 1
            fit.append(b)
        return zero, ckpt, fit, plain

    def expand(self, roles: tuple, fits: RoleFits, zero: bool) -> list[tuple]:
        """``(compute seconds, index, b, mode)`` of every fitting configuration of ``roles`` in
        variant ``zero``, ascending in compute seconds (then enumeration order; ``index``
        numbers them in enumeration order), memoised in ``fits``. The compute seconds (all
        micro-batches, recompute included) are a lower bound of the step."""
        got = fits.expanded.get(zero)
        if got is not None:
            return got
        ctx, got = self.ctx, []
        model = ctx.model
        per_cell = ctx.global_batch // (roles[0] * roles[2])
        mem, dt, pre = self.mem_bytes, self.dtype, self.prefetch
        sp = sequence_parallel_memory(
            ctx.sequence_split(roles[1], roles[3], roles[4]) > 1, self.regather
        )
        for z, ckpt, sizes, plain in fits.modes:
            if z != zero:
                continue
            for b in sizes:
                mode = ckpt
                if plain is not None and plain(b) > self.limit:
                    args = (model, roles, b, ctx.seq_len, mem, dt, pre, zero, self.params)
                    mode = fewest_selective(*args, sequence_parallel=sp, residual=self.residual)
                fwd, bwd, rec = ctx.micro_batch_seconds(roles, b, mode)
                got.append(((per_cell // b) * (fwd + bwd + rec), len(got), b, mode))
        got.sort(key=lambda c: c[:2])
        fits.expanded[zero] = got
        return got

    def may_fit(self, roles: tuple) -> dict[bool, dict[bool, list[int]]]:
        """Per optimizer variant, per ``full`` (whether the mode is ``full``): the micro-batches
        that may fit on the roles' sizes ``roles``, by a floor of the memory taken before its
        lines (:meth:`oriented_fits`): the states, 16 B per local element (8 + 8 / (G_data
        G_context) sharded), and the blocks' saved tensors in the class's leanest mode
        (``full``: the block inputs; else ``selective`` or ``none``:
        :func:`tetrad.plan.memory.activations.saved_activations`, affine in the micro-batch),
        both in the total of the ``backward: blocks`` phase. Memoised per roles."""
        got = self.may_fit_memo.get(roles)
        if got is not None:
            return got
        got = {}
        gd, gc = roles[:2]
        local, sizes = self._cell(roles, self.allowed)
        for zero in self.variants(gd * gc):
            room = self.limit - state_bytes_per_element(zero, gd * gc, self.params) * local
            classes = {}
            for full in (False, True):
                line = self._saved_line(roles, full)
                if line is None or not sizes:
                    continue
                one, slope = line
                n = bisect.bisect_right(sizes, False, key=lambda b: one + (b - 1) * slope > room)
                if n:
                    classes[full] = sizes[:n]
            if classes:
                got[zero] = classes
        self.may_fit_memo[roles] = got
        return got

    def _saved_line(self, roles: tuple, full: bool) -> tuple[float, float] | None:
        """``(bytes at b = 1, bytes per further sample)`` of the blocks' saved tensors in the
        leanest of the modes tried in the class (``full``: ``full``; else ``selective`` or
        ``none``), per ``(G_context, G_y, G_x)`` (memoised); None where no such mode is tried."""
        key = (roles[1], roles[3], roles[4], full)
        if key in self.saved_memo:
            return self.saved_memo[key]
        got = None
        modes = [m for m in self.modes if (m == "full") == full]
        if modes:
            at = []
            for b in (1, 2):
                at.append(min(self._saved_blocks(roles, b, m) for m in modes))
            got = (at[0], at[1] - at[0])
        self.saved_memo[key] = got
        return got

    def _saved_blocks(self, roles: tuple, b: int, mode: str) -> float:
        """The blocks' saved tensors of a micro-batch of ``b`` on ``roles`` in ``mode``,
        bytes (:func:`tetrad.plan.memory.activations.saved_activations`)."""
        ctx = self.ctx
        sp = sequence_parallel_memory(
            ctx.sequence_split(roles[1], roles[3], roles[4]) > 1, self.regather
        )
        saved = saved_activations(
            ctx.model,
            roles,
            b,
            ctx.seq_len,
            activation_checkpointing=mode,
            dtype=self.dtype,
            sequence_parallel=sp,
            residual=self.residual,
        )
        return saved["blocks"]

    def variants(self, data_group: int) -> tuple[bool, ...]:
        """:func:`optimizer_variants` of this search on a data group of ``data_group``
        ranks."""
        return optimizer_variants(self.shard_optimizer, data_group)


def optimizer_variants(shard_optimizer: str, data_group: int) -> tuple[bool, ...]:
    """Whether the optimizer is sharded, the choices tried under ``shard_optimizer`` on a grid
    whose data group has ``data_group = G_data G_context`` ranks: ``off`` unsharded; ``on``
    sharded (unsharded with one rank); ``auto`` both (each where it fits: the search ranks
    them by their step times, module doc)."""
    if data_group == 1 or shard_optimizer == "off":
        return (False,)
    return (True,) if shard_optimizer == "on" else (False, True)


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
    params: str = "fp32",
    residual: str | None = None,
):
    """(The search builds these lines itself, per roles: :meth:`MemoryFits.oriented_fits`; this
    one, for a grid, is what tests and docs check against the memory model.)

    ``b -> peak bytes`` of :func:`tetrad.plan.memory.runtime.runtime_memory` from two evaluations:
    every phase's total is affine in the micro-batch (activations, logits and recompute sets grow
    with ``m``; weights, gathered blocks and step buffers do not), so the peak is the maximum of the
    phases' lines. ``inf`` for every ``b`` when ``b = 1`` already does not fit. With
    ``shard_optimizer`` the phases move by :func:`tetrad.plan.memory.runtime.sharding_offsets`
    (constants in ``b``). ``params`` and ``residual``: as ``runtime_memory``'s."""
    if not sizes:
        return lambda b: float("inf")
    lines = phase_lines(model, grid, seq_len, ckpt, dtype, prefetch, sizes, params, False, residual)
    offsets = (
        sharding_offsets(model, tuple(grid), dtype, prefetch, params) if shard_optimizer else None
    )
    return line_of(lines, FIT_FRACTION * mem_bytes, sizes, offsets)


class PhaseLines:
    """Per phase of :func:`tetrad.plan.memory.runtime.runtime_memory` (unsharded optimizer): its
    bytes at ``b = 1`` (:attr:`lo`) and their growth per sample of the micro-batch (:meth:`slopes`,
    evaluated at ``b = 2`` only when asked: a grid that does not fit at ``b = 1`` needs none)."""

    def __init__(
        self,
        model,
        grid,
        seq_len,
        ckpt,
        dtype,
        prefetch,
        sizes: list[int],
        params: str = "fp32",
        sp: bool | str = False,
        residual: str | None = None,
    ):
        self._args = (model, grid, seq_len, ckpt, dtype, prefetch, params)
        self.sp, self.residual = sp, residual  # sequence parallelism, the stream's format
        self.last = sizes[-1]
        self.lo = self._at(1)
        self._slopes: dict | None = None

    def _at(self, b: int) -> dict[str, float]:
        model, grid, seq_len, ckpt, dtype, prefetch, params = self._args
        options = {"activation_checkpointing": ckpt, "dtype": dtype, "prefetch": prefetch}
        if params != "fp32":  # the memo keys of the callers that never give it
            options["params"] = params
        if self.sp:  # True, or "regather"
            options["sequence_parallel"] = self.sp
        if self.residual is not None:
            options["residual"] = self.residual
        return phase_totals(model, grid, b, seq_len, **options)

    def slopes(self) -> dict[str, float]:
        if self._slopes is None:
            hi = self._at(2) if self.last > 1 else self.lo
            self._slopes = {k: hi[k] - self.lo[k] for k in self.lo}
        return self._slopes


def phase_lines(
    model: ModelSpec,
    grid,
    seq_len: int,
    ckpt: str,
    dtype: str,
    prefetch: bool,
    sizes: list[int],
    params: str = "fp32",
    sp: bool | str = False,
    residual: str | None = None,
) -> PhaseLines:
    """The :class:`PhaseLines` of a grid and mode (``params``: the weights' stored format;
    ``sp``: with sequence parallelism, ``"regather"`` with the first Linears' inputs kept
    split; ``residual``: the residual stream's format, None for the compute dtype's)."""
    return PhaseLines(model, grid, seq_len, ckpt, dtype, prefetch, sizes, params, sp, residual)


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
