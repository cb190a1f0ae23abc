"""The sharded optimizer (ZeRO-1): AdamW states split over data x context, and the routed
experts' over expert-data.

ZeRO stage 1 (Rajbhandari et al., arXiv 1910.02054, section 5.1 "P_os"), as Megatron-LM's
distributed optimizer does it: the weight gradients are reduce-scattered over the data group
(``G_data G_context`` ranks, :class:`tetrad.spec.grid.Axis`) instead of all-reduced, each rank
updates its piece of every parameter with AdamW and keeps ``exp_avg``/``exp_avg_sq`` for that
piece only, and the updated pieces are all-gathered back into the parameters.

A parameter's piece: its local shard (``n`` elements, whatever Z, Y and X left on this rank)
flattened and cut into ``G = G_data G_context`` pieces of ``c = ceil(n / G)`` elements; rank
``r`` of the data group owns elements ``[r c, min((r + 1) c, n))``. A group of parameters is
reduced in one collective: each one's gradient padded to ``G c`` and laid out ``[G, c]``, the
groups' columns side by side (``[G, sum c]``), so that row ``r`` holds rank ``r``'s pieces;
reduce-scatter leaves row ``r`` on rank ``r``. The all-gather after the update packs the same
way. The padding is zero (none when ``G`` divides ``n``).

The all-gathers after the update run one unit at a time, asynchronously (as Megatron-LM's
``overlap_param_gather``): a unit is one module of the forward (:func:`gather_units`: the
embedding, each block, the final norm with the LM head; consecutive units together while their
bytes are below :data:`tetrad.spec.overlap.GATHER_GROUP_BYTES`, so a small model makes few
calls), gathered in the order the next forward first reads them. The first unit's all-gather is
issued by the update; each is waited just before its first read (a forward pre-hook on every
module below the model, and :meth:`tetrad.parallel.overlap.Overlap` before a Z all-gather reads
a weight), copied into the parameters, and the next unit's is issued then, so it runs behind
this unit's forward. So at most one unit's buffers exist at a time (its output ``[G, sum c]``
and this rank's row ``[sum c]``, in the weights' format), where gathering every unit at once
would hold the whole model again: Megatron-LM gathers into its parameter buffer in place, and
dispatches the next bucket's all-gather when the current one is waited, likewise.
:meth:`DataShards.wait_all` finishes them all in order (before a checkpoint save, an evaluation,
the end of training, and the next update).

An MoE model's expert-sharded weights (split over the expert axis, their gradients summed over
expert-data only: :attr:`tetrad.parallel.placement.Placement.grad_sum_axes`) are sharded the
same way over their expert-data group, the stage's ``G_stage / G_expert`` ranks holding the
same experts (:attr:`DataShards.experts`, a second :class:`DataShards` on that axis): their
gradients reduce-scattered over it, their AdamW states (and masters) split over it, their pieces
all-gathered back after the update, one unit in flight as for the others (Megatron-LM's
distributed optimizer shards the expert parameters over the expert-data-parallel group
likewise: 6 + 12 / EDP bytes per expert parameter with bf16 weights).

Pieces depend only on the parameter and ``G``, never on the buckets, so a step whose buckets
differ from the last's still finds its states, and a checkpoint stores the whole local tensors
(:meth:`ShardedAdamW.full_states`): it loads on any grid, with or without sharding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tetrad.comm import Handle, all_gather, reduce_scatter
from tetrad.grid import Grid
from tetrad.parallel.masters import MasterAdamW, drop_grads, grad_dtype, grad_of, reduce_dtype
from tetrad.spec.grid import Axis
from tetrad.spec.overlap import GATHER_GROUP_BYTES, gather_groups


class DataShards:
    """Which piece of each parameter this rank owns, and the step's reduced pieces.

    Attributes:
        axis: the group the pieces split over: data (``G_data G_context`` ranks), or
            expert-data for the expert-sharded weights (:attr:`experts`).
        size: ``G``, the ranks of :attr:`axis`.
        rank: this rank's index in that group.
        experts: over data, with ``G > 1`` and an expert-data group of more than one rank: the
            expert-sharded weights' :class:`DataShards` over expert-data (sharing
            :attr:`grads`; :meth:`attach`, :meth:`wait_for`, :meth:`wait_all` and
            :meth:`all_gather` act on both); else None.
        grads: ``id(param) -> [len]`` this rank's piece of the gradient summed over every
            token axis, set by :meth:`take` (or :func:`tetrad.parallel.grads.sync_gradients`).
        groups: the parameter groups reduce-scattered this step, in order.
        pending: ``id(param) -> (its unit's params, Handle or None)`` for every parameter whose
            all-gather after the update is not yet copied in (None: queued, not yet issued;
            at most one unit has a handle).
    """

    def __init__(self, grid: Grid, axis: Axis = Axis.DATA):
        self.grid, self.axis = grid, axis
        self.size = grid.size(axis)
        group = grid.group(axis) if self.size > 1 else None
        self.rank = dist.get_group_rank(group, dist.get_rank()) if group is not None else 0
        self.grads: dict[int, torch.Tensor] = {}
        self.groups: list[list[nn.Parameter]] = []
        self.order: dict[int, int] = {}  # id(param) -> its place in the forward (attach)
        self.unit: dict[int, int] = {}  # id(param) -> its gather unit (attach)
        self._units = 0
        self.pending: dict[int, tuple] = {}  # id(param) -> (unit params, Handle or None)
        self._queue: list[list[nn.Parameter]] = []  # units not yet issued, in forward order
        self._in_flight: tuple | None = None  # (unit params, Handle) of the one issued
        self.least = GATHER_GROUP_BYTES  # bytes below which units are gathered together
        self._hooked: set[int] = set()
        self._attached: set[int] = set()  # id of each model given to attach
        self.experts: DataShards | None = None
        if (
            axis == Axis.DATA
            and self.size > 1
            and grid.expert > 1
            and grid.size(Axis.EXPERT_DATA) > 1
        ):
            self.experts = DataShards(grid, Axis.EXPERT_DATA)
            self.experts.grads = self.grads  # one dict of reduced pieces for the step

    def attach(self, *models: nn.Module) -> None:
        """Wait for a parameter's pending all-gather before the forward of any module that
        holds it: a forward pre-hook on every module below ``models`` (once per module; its
        own and its submodules' parameters, so that a block waits for all of its own even
        where a parent reads a child's weights); the parameters' order in ``models`` (as given:
        a pipeline's parts in order) is the order of the next forward, in which
        :meth:`all_gather` issues the groups."""
        if self.experts is not None:
            self.experts.attach(*models)
        for model in models:
            if id(model) in self._attached:  # every step attaches the same modules again
                continue
            self._attached.add(id(model))
            for p in model.parameters():
                self.order.setdefault(id(p), len(self.order))
            for unit in gather_units(model):
                fresh = [p for p in unit if id(p) not in self.unit]
                if fresh:
                    self.unit.update((id(p), self._units) for p in fresh)
                    self._units += 1
            for m in model.modules():
                own = list(m.parameters())
                if m is not model and own and id(m) not in self._hooked:
                    self._hooked.add(id(m))
                    m.register_forward_pre_hook(lambda _m, _a, own=own: self.wait_for(own))

    def wait_for(self, params) -> None:
        """Finish the all-gathers after the update (:meth:`all_gather`) of any of ``params``:
        those of the units before theirs first, in order (one in flight at a time)."""
        while any(id(p) in self.pending for p in params):
            self._finish_next()
        if self.experts is not None:
            self.experts.wait_for(params)

    def wait_all(self) -> None:
        """Finish every pending all-gather, in the order they were queued."""
        while self.pending:
            self._finish_next()
        if self.experts is not None:
            self.experts.wait_all()

    def _finish_next(self) -> None:
        """Wait the unit in flight (issuing the first queued one if none is), copy it into its
        parameters, and issue the next."""
        if self._in_flight is None:
            self._issue_next()
        params, handle = self._in_flight
        self._in_flight = None
        for p in params:
            self.pending.pop(id(p), None)
        self._copy_in(params, handle)
        self._issue_next()

    @torch.no_grad()
    def _issue_next(self) -> None:
        """Issue the first queued unit's all-gather (none while one is in flight)."""
        if self._in_flight is not None or not self._queue:
            return
        params = self._queue.pop(0)
        mine = self.pack_row([self.piece(p.data) for p in params], params)
        handle = all_gather(mine, self.grid, self.axis, async_op=True)
        self._in_flight = (params, handle)
        self.pending.update((id(p), (params, handle)) for p in params)

    def sharded(self, p: nn.Parameter) -> bool:
        """Whether ``p``'s optimizer state is split here: its gradient is summed over
        :attr:`axis`."""
        placement = getattr(p, "placement", None)
        axes = placement.grad_sum_axes if placement is not None else (Axis.DATA,)
        return self.size > 1 and self.axis in axes

    def of(self, p: nn.Parameter) -> DataShards | None:
        """The shards that split ``p``'s optimizer state: these, :attr:`experts`, or None."""
        if self.sharded(p):
            return self
        return self.experts if self.experts is not None and self.experts.sharded(p) else None

    def chunk(self, n: int) -> int:
        """Elements per piece of an ``n``-element tensor: ``ceil(n / G)``."""
        return -(-n // self.size)

    def piece(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``t`` (a 1-D view of its flattened elements, maybe empty)."""
        n = t.numel()
        c = self.chunk(n)
        return t.view(-1)[min(self.rank * c, n) : min((self.rank + 1) * c, n)]

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``[G * sum c]``: row ``r`` of ``[G, sum c]`` holds every tensor's piece ``r`` (each
        column block written once, padding included: no zero fill first)."""
        chunks = [self.chunk(t.numel()) for t in tensors]
        buf = torch.empty(self.size, sum(chunks), dtype=tensors[0].dtype, device=tensors[0].device)
        offset = 0
        for t, c in zip(tensors, chunks, strict=True):
            col = buf[:, offset : offset + c]
            if t.numel() == self.size * c:
                col.copy_(t.reshape(self.size, c))
            else:
                padded = torch.zeros(self.size * c, dtype=t.dtype, device=t.device)
                padded[: t.numel()] = t.reshape(-1)
                col.copy_(padded.view(self.size, c))
            offset += c
        return buf.view(-1)

    def reduce_scatter(
        self, params: list[nn.Parameter], grads: list[torch.Tensor], async_op: bool = False
    ) -> torch.Tensor | Handle:
        """Start the reduce-scatter over :attr:`axis` of ``grads`` (those of ``params``) packed
        (:meth:`pack`); returns this rank's row ``[sum c]`` (or its :class:`Handle`). Records
        the group for the all-gather after the update. The packed buffer takes the place of
        the gradients: ``param.grad`` is dropped (the step needs only the reduced pieces)."""
        self.groups.append(list(params))
        packed = self.pack(grads).to(reduce_dtype(params[0]))
        drop_grads(params)
        return reduce_scatter(packed, self.grid, self.axis, async_op=async_op)

    def take(self, params: list[nn.Parameter], row: torch.Tensor) -> None:
        """Record each parameter's reduced piece from the reduce-scattered ``row`` (cast to the
        gradients' dtype where it was summed in another)."""
        row, offset = row.to(grad_dtype(params[0])), 0
        for p in params:
            n, c = p.numel(), self.chunk(p.numel())
            length = max(0, min(c, n - self.rank * c))
            self.grads[id(p)] = row[offset : offset + length]
            offset += c

    def units(self) -> list[list[nn.Parameter]]:
        """The parameters reduce-scattered this step (:attr:`groups`) in gather units: the
        modules of :func:`gather_units` (:meth:`attach`) in the order of the next forward's
        first reads, consecutive ones together until their bytes reach :attr:`least`
        (:func:`tetrad.spec.overlap.gather_groups`); a parameter of no attached module stays
        with its reduce-scatter group, after them."""
        params = [p for group in self.groups for p in group]
        params.sort(key=lambda p: self.order.get(id(p), len(self.order)))  # stable
        where = {id(p): i for i, group in enumerate(self.groups) for p in group}
        units: dict[tuple, list[nn.Parameter]] = {}
        for p in params:
            key = (0, self.unit[id(p)]) if id(p) in self.unit else (1, where[id(p)])
            units.setdefault(key, []).append(p)
        attached = [u for k, u in units.items() if k[0] == 0]
        sizes = [sum(p.numel() * p.element_size() for p in u) for u in attached]
        merged = [[p for i in run for p in attached[i]] for run in gather_groups(sizes, self.least)]
        return merged + [u for k, u in units.items() if k[0] == 1]

    @torch.no_grad()
    def all_gather(self, async_op: bool = False) -> None:
        """After the update: all-gather this rank's pieces over :attr:`axis` into the
        parameters (and :attr:`experts`' theirs), one
        call per unit (:meth:`units`), one unit in flight at a time, then forget the step.
        ``async_op``: the first unit's issued and the rest queued, each finished by the next
        forward's first read of its parameters (:meth:`wait_for`) or :meth:`wait_all`; else
        all finished now."""
        self.wait_all()
        for params in self.units():
            self._queue.append(params)
            self.pending.update((id(p), (params, None)) for p in params)
        self.groups = []
        self.grads.clear()  # (the dict :attr:`experts` shares)
        if async_op:
            self._issue_next()
        else:
            self.wait_all()
        if self.experts is not None:
            self.experts.all_gather(async_op)

    @torch.no_grad()
    def _copy_in(self, params: list[nn.Parameter], handle) -> None:
        full = handle.wait().view(self.size, -1)
        offset = 0
        for p in params:
            n, c = p.numel(), self.chunk(p.numel())
            p.data.view(-1).copy_(full[:, offset : offset + c].reshape(-1)[:n])
            offset += c

    def pack_row(self, pieces: list[torch.Tensor], params: list[nn.Parameter]) -> torch.Tensor:
        """``[sum c]``: ``pieces`` (this rank's of ``params``) side by side, zero-padded, in
        the pieces' dtype."""
        chunks = [self.chunk(p.numel()) for p in params]
        row = torch.zeros(sum(chunks), dtype=pieces[0].dtype, device=params[0].device)
        offset = 0
        for piece, c in zip(pieces, chunks, strict=True):
            row[offset : offset + piece.numel()] = piece
            offset += c
        return row

    @torch.no_grad()
    def gather_full(self, pieces: list[torch.Tensor], like: list[nn.Parameter]) -> list:
        """The whole local tensors (shaped as ``like``) of which ``pieces`` are this rank's
        (one all-gather over :attr:`axis`); for checkpoints."""
        full = all_gather(self.pack_row(pieces, like), self.grid, self.axis).view(self.size, -1)
        out, offset = [], 0
        for p in like:
            n, c = p.numel(), self.chunk(p.numel())
            out.append(full[:, offset : offset + c].reshape(-1)[:n].view_as(p).clone())
            offset += c
        return out


def gather_units(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters the sharded optimizer all-gathers together after the update
    (:meth:`DataShards.all_gather`), in ``model``'s order: those held by ``model`` itself, then
    each child module's, a container's (``ModuleList``, ``ModuleDict``, ``Sequential``) children
    each apart; a module with no matrix (a norm) joins the next unit (the last: the one before),
    so that it neither costs a call of its own nor delays the next unit's all-gather by a
    forward of nothing. A parameter shared with an earlier module (a tied head's table) counts
    with that one. For :class:`tetrad.models.llama.Transformer`: the embedding, each block, and
    the final norm with the LM head."""
    units = [list(model.parameters(recurse=False))]
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            units += [list(c.parameters()) for c in child.children()]
        else:
            units.append(list(child.parameters()))
    seen: set[int] = set()
    out: list[list[nn.Parameter]] = []
    carry: list[nn.Parameter] = []
    for unit in units:
        unit = carry + [p for p in unit if id(p) not in seen]
        seen.update(id(p) for p in unit)
        if any(p.dim() > 1 for p in unit):
            out.append(unit)
            carry = []
        else:
            carry = unit
    if carry:
        if out:
            out[-1] += carry
        else:
            out.append(carry)
    return out


class ShardedAdamW(MasterAdamW):
    """torch's AdamW over this rank's pieces (:class:`DataShards`) of the parameters whose
    gradients are summed over data, and of an MoE model's expert-sharded weights over
    expert-data (:attr:`DataShards.experts`); the others whole (none in a dense model).

    Without masters each piece is a view of its parameter, so the update writes into the
    parameter; with masters (weights stored in bf16, :class:`tetrad.parallel.masters.MasterAdamW`)
    each piece's master is an fp32 copy of that piece only (Megatron-LM's distributed optimizer:
    masters sharded with the states), copied back into the parameter's piece after the update.
    A piece's gradient is the reduced piece (:attr:`DataShards.grads`). :meth:`step` then
    all-gathers the pieces, in the parameters' format (:meth:`DataShards.all_gather`). AdamW is
    elementwise, so the update of the pieces equals the update of the whole tensors. States:
    ``2 * 4 * ceil(n / G)`` bytes per sharded parameter of ``n`` local elements, plus
    ``4 * ceil(n / G)`` for its master (``G`` the ranks of the parameter's shards' axis).

    Args:
        groups: parameter groups as for ``torch.optim.AdamW`` (the model's parameters).
        shards: the grid's :class:`DataShards`.
        overlap_gather: leave the all-gathers pending after :meth:`step`, each waited before
            the next forward's first read of its parameters (:meth:`DataShards.attach`) or by
            :meth:`DataShards.wait_all`; else :meth:`step` returns with the parameters whole.
        masters: keep fp32 masters of the pieces (weights stored in another format).
        **kwargs: ``lr``, ``betas``, ``eps``, ``fused``, ``foreach`` of ``torch.optim.AdamW``.
    """

    def __init__(
        self,
        groups: list[dict],
        shards: DataShards,
        overlap_gather: bool = True,
        masters: bool = False,
        **kwargs,
    ):
        self.shards, self.overlap_gather = shards, overlap_gather
        super().__init__(groups, masters=masters, **kwargs)

    def target(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s piece (a view, or an fp32 copy with masters), or ``p`` (its master)."""
        shards = self.shards.of(p)
        if shards is None:
            return super().target(p)
        piece = shards.piece(p.data)
        return piece.to(torch.float32, copy=True) if self.masters else piece

    def stored(self, p: nn.Parameter) -> torch.Tensor:
        """Where ``p``'s updated master is copied: its piece of ``p``'s data."""
        shards = self.shards.of(p)
        return shards.piece(p.data) if shards is not None else p.data

    def gradient(self, p: nn.Parameter) -> torch.Tensor | None:
        """The reduced piece of ``p``'s gradient (or its whole gradient, unsharded)."""
        return self.shards.grads.get(id(p)) if self.shards.of(p) is not None else grad_of(p)

    @torch.no_grad()
    def step(self, closure=None):
        """The AdamW update of every piece with a reduced gradient, then the all-gather
        (pending with ``overlap_gather``; any still pending from the last step first finish)."""
        self.shards.wait_all()
        out = super().step(closure)
        self.shards.all_gather(async_op=self.overlap_gather)
        return out

    def full_states(self, params: list[nn.Parameter]) -> list[dict]:
        """For each of ``params`` (every rank of the data group passing the same list),
        ``{"step", "exp_avg", "exp_avg_sq", "master"}`` of the whole local tensor, gathered
        over data (zeros before the first step; ``master`` the fp32 weights): what a
        checkpoint stores, whatever the sharding and the stored format."""
        out = super().full_states(params)
        for shards in (self.shards, self.shards.experts):
            split = [
                i for i, p in enumerate(params) if shards is not None and shards.of(p) is shards
            ]
            like = [params[i] for i in split]
            for k in ("exp_avg", "exp_avg_sq", "master"):
                pieces = [out[i][k] for i in split]
                if k == "master" and not self.masters:
                    for i in split:
                        out[i][k] = params[i].data
                elif like:
                    for i, full in zip(split, shards.gather_full(pieces, like), strict=True):
                        out[i][k] = full
        return out

    @torch.no_grad()
    def load_full_states(self, params: list[nn.Parameter], states: list[dict]) -> None:
        """Set the state (and master) of each of ``params`` from the whole local tensors in
        ``states`` (as :meth:`full_states` returns them): each rank keeps its piece; then the
        stored weights from the masters."""
        pieces = []
        for p, full in zip(params, states, strict=True):
            shards = self.shards.of(p)
            if shards is not None:
                full = {**full, **{k: shards.piece(full[k]) for k in ("exp_avg", "exp_avg_sq")}}
                p.data.copy_(full["master"])  # whole: other ranks' pieces too
                full["master"] = shards.piece(full["master"] if self.masters else p.data)
            pieces.append(full)
        super().load_full_states(params, pieces)


def settle_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Finish the sharded optimizer's pending parameter all-gathers ,
    before anything but the next training forward reads the parameters: a checkpoint save, an
    evaluation, an export, the end of training. A no-op for other optimizers."""
    shards = getattr(optimizer, "shards", None)
    if shards is not None:
        shards.wait_all()


def optimizer_shards(optimizer: torch.optim.Optimizer) -> DataShards | None:
    """The :class:`DataShards` of a sharded optimizer (None: not sharded, or a data group of
    one rank)."""
    shards = getattr(optimizer, "shards", None)
    return shards if shards is not None and shards.size > 1 else None
