"""Overlap of collectives with computation: which ones, and the state that makes it happen.

Eight overlaps, each switchable (AxoNN, arXiv 2305.13525, "aggressively overlap expensive
collective operations"; Domino, arXiv 2409.15241, for the forward split; T3, arXiv 2401.16677,
for ``fine``):

``prefetch``        the Z all-gathers of the next two weights
                    (:data:`tetrad.spec.overlap.PREFETCH_DEPTH`)
                    in *execution* order (recorded on the first training micro-batch, so it
                    covers forward, backward and activation recomputation, and running on into
                    the step's next micro-batch: its embedding table is gathered during this
                    one's last layers' backward) are in flight while the current layer
                    computes;
``reduce_scatter``  the Z reduce-scatter of each weight gradient is issued asynchronously (after
                    the next prefetch, so the next weight does not wait behind it on the Z
                    stream) and completed before the micro-batch ends;
``dx_all_reduce``   the backward all-reduce of the input gradient runs during the dW GEMM;
``dp_all_reduce``   data-parallel gradient all-reduces are bucketed and issued during the last
                    micro-batch's backward as buckets fill (AxoNN leaves this synchronous);
                    an MoE block's expert gradients' sum over expert-data as its experts'
                    backward ends (:mod:`tetrad.parallel.expert_grads`);
``domino``          the forward activation all-reduce: the micro-batch's rows are split in two so
                    the first half's all-reduce runs during the second half's GEMM;
``fine``            a Linear's all-reduce (forward over its input axis, backward dx over its
                    output axis) becomes a reduce-scatter fused with the GEMM that produces it
                    (:func:`tetrad.comm.fused.ring_matmul_reduce_scatter`, ``fine_chunks``
                    pieces per ring step) and a plain all-gather: T3's layout, which fuses the
                    reduce-scatter half only. In backward the all-gather runs during the dW GEMM
                    (with ``dx_all_reduce``). Used when the rows split evenly over the group;
                    takes precedence over ``domino``.
``context``         context-parallel attention's K/V all-gather is issued in up to
                    ``context_pieces`` pieces (over micro-batch samples and KV heads), each
                    piece's attention running while the next piece travels; in backward each
                    piece's K/V gradient reduce-scatter runs during the next piece's attention
                    backward (:mod:`tetrad.parallel.context`).
``expert``          an MoE block's expert-parallel dispatch and combine all-to-alls are cut into
                    ``expert_pieces`` pieces of its tokens, each piece's exchanges running
                    while another piece's experts compute, in forward and backward (Tutel's
                    pipelining; :mod:`tetrad.parallel.experts`).

All collectives are issued from the main thread in program order, so every rank of a group issues
the same sequence. Waits use the work handles only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from tetrad.comm import Handle, all_gather, all_reduce, reduce_scatter
from tetrad.comm.fused import ring_matmul_reduce_scatter
from tetrad.dtypes import fp8_recipe
from tetrad.grid import Grid
from tetrad.parallel.buckets import GradBuckets
from tetrad.parallel.expert_grads import ExpertGradSums
from tetrad.parallel.masters import add_grad, grad_dtype, grad_of, set_grad
from tetrad.parallel.sequence import scatter_sequence
from tetrad.spec.grid import Axis
from tetrad.spec.overlap import (
    CONTEXT_PIECES,
    DEFAULT_OVERLAPS,
    DOMINO_MIN_ROWS,
    DP_BUCKET_BYTES,
    EXPERT_PIECES,
    FINE_CHUNKS,
    PREFETCH_DEPTH,
    REDUCE_SCATTERS_IN_FLIGHT,
)


class Overlap:
    """Switches and state of the overlaps of one model on one grid.

    The training step drives it: :meth:`begin_micro_batch` before a micro-batch's forward,
    :meth:`end_micro_batch` after its backward (waits outstanding reduce-scatters and, on the
    last micro-batch, the data-parallel all-reduces of :attr:`buckets`, a
    :class:`~tetrad.parallel.buckets.GradBuckets`). Outside a training step (evaluation) every
    collective is blocking and nothing is prefetched.

    Args:
        enabled: names from :data:`tetrad.spec.overlap.OVERLAPS` (default: all but ``fine``).
        bucket_bytes: data-parallel bucket size in bytes.
        domino_min_rows: split the forward GEMM only when the micro-batch has at least twice
            this many token rows (below it the split's extra launch costs more than it hides).
        fine_chunks: pieces per ring step of the ``fine`` overlap's fused reduce-scatter.
        context_pieces: most pieces of the ``context`` overlap's K/V all-gather
            (:func:`tetrad.spec.overlap.context_pieces`).
        expert_pieces: most pieces of the ``expert`` overlap's all-to-alls
            (:func:`tetrad.spec.overlap.expert_pieces`).
    """

    def __init__(
        self,
        grid: Grid,
        enabled: Iterable[str] = DEFAULT_OVERLAPS,
        bucket_bytes: int = DP_BUCKET_BYTES,
        domino_min_rows: int = DOMINO_MIN_ROWS,
        fine_chunks: int = FINE_CHUNKS,
        context_pieces: int = CONTEXT_PIECES,
        expert_pieces: int = EXPERT_PIECES,
    ):
        if fine_chunks < 1:
            raise ValueError(f"fine_chunks={fine_chunks}: give at least 1 piece per ring step")
        if min(context_pieces, expert_pieces) < 1:
            raise ValueError(
                f"context_pieces={context_pieces}, expert_pieces={expert_pieces}: give at "
                "least 1 piece"
            )
        self.grid = grid
        self.enabled = frozenset(enabled)
        self._prefetching = self.on("prefetch") and grid.z > 1  # G_z = 1: nothing to gather
        self.domino_min_rows, self.fine_chunks = domino_min_rows, fine_chunks
        self.context_pieces = context_pieces if self.on("context") else 1
        self.expert_pieces = expert_pieces if self.on("expert") else 1
        self._in_step = self._last = False
        # [(param, dtype)] of one micro-batch per phase, in execution order
        self._orders: dict[str, list] = {}
        self._order: list | None = None  # the current phase's
        self._phase = "step"
        self._recording: list | None = None
        self._pos = 0
        # (param, dtype, Handle) of the prefetched all-gathers in flight, in order; the last
        # index of the order issued; those issued for the step's next micro-batch
        self._prefetched: list[tuple] = []
        self._issued = -1
        self._carried: list[tuple] = []
        self._pending_rs: list[tuple[torch.nn.Parameter, Handle]] = []
        # (param, full-block gradient) whose reduce-scatter waits for the next prefetch
        self._deferred_rs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        # What actually ran (prefetch_hits, prefetch_misses, async_reduce_scatters, dp_buckets,
        # domino_splits, async_dx_all_reduces, fine_fused), for logs and tests; reset by the
        # caller.
        self.counts: Counter[str] = Counter()
        # With a list here, every Z all-gather and reduce-scatter issued appends ``(kind,
        # param)`` in issue order (tests compare it with the planner's replay).
        self.trace: list | None = None
        self.buckets = GradBuckets(grid, bucket_bytes, self.counts)
        # Parameters replicated over Z (norm weights), set by the model: autograd accumulates
        # their gradients, which join the last data-parallel bucket when G_z = 1 (their sum is
        # then over data only).
        self.late: list[torch.nn.Parameter] = []
        # the routed experts' expert-data sums during backward (set by the model)
        self.expert_sums: ExpertGradSums | None = None

    def on(self, name: str) -> bool:
        return name in self.enabled

    # -- step protocol -------------------------------------------------------------------
    def begin_micro_batch(self, last: bool, phase: str = "step") -> None:
        """Start a training micro-batch (``last``: the step's final one). ``phase``: ``step``
        (forward and backward together), or ``forward`` / ``backward`` when a pipeline
        schedule runs them apart (each phase's order of Z all-gathers is recorded apart); with
        phases, ``last`` marks the final micro-batch's backward."""
        self._in_step, self._last, self._pos = True, last, 0
        if last:
            self.buckets.clear()
        if self.expert_sums is not None:
            self.expert_sums.shards = self.buckets.shards
            self.expert_sums.begin(last and phase != "forward")
        self._phase = phase
        self._order = self._orders.get(phase)
        if self._order is None and self._prefetching:
            self._recording = []
        # the first weights, prefetched by the previous micro-batch of the step
        self._prefetched, self._carried = self._carried, []
        self._issued = len(self._prefetched) - 1

    def end_micro_batch(self) -> None:
        """Finish the micro-batch: complete reduce-scatters; on the last one, the data-parallel
        buckets. Afterwards every weight gradient is in ``param.grad``."""
        while self._pending_rs:
            self._finish_rs(*self._pending_rs.pop(0))
        if self._last:
            self.buckets.finish(self.late if self.folds_late() else ())
            if self.expert_sums is not None and self._phase != "forward":
                self.expert_sums.finish(self.buckets.reduced)
        if self._recording is not None:
            self._orders[self._phase], self._recording = self._recording, None
        self._drop_prefetch()
        self._in_step = False

    def folds_late(self) -> bool:
        """Whether :attr:`late`'s gradients go in the last data-parallel bucket: with the
        ``dp_all_reduce`` overlap, ``G_data G_context > 1`` and ``G_z = 1``."""
        return self.on("dp_all_reduce") and self.grid.size(Axis.DATA) > 1 and self.grid.z == 1

    # -- weights: all-gather over Z ------------------------------------------------------
    def gather_weight(self, param: torch.nn.Parameter, dtype) -> torch.Tensor:
        """The Z all-gather of ``param`` (a dim-0 shard) cast to ``dtype`` (a torch dtype, or
        the FP8 format :class:`tetrad.parallel.fp8.Fp8WeightGather`: the FP8 shard's bytes
        gathered, the result an FP8 tensor): prefetched when it was; before returning, the
        all-gathers of the next :data:`PREFETCH_DEPTH` weights of the recorded order (running
        on into the step's next micro-batch when there is one and the micro-batches run
        whole, ``phase="step"``), then the reduce-scatters deferred since the last call."""
        got = None
        if self._prefetched:
            p, dt, h, meta = self._prefetched.pop(0)
            w = h.wait()
            if p is param and dt == dtype:
                got = _received(dt, w, meta)
                self.counts["prefetch_hits"] += 1
            else:
                self.counts["prefetch_misses"] += 1
        if got is None:
            self._traced("all_gather", param)
            self._settle(param)
            shard, meta = _to_send(param, dtype)
            got = _received(dtype, all_gather(shard, self.grid, Axis.Z), meta)
        if self._in_step and self._prefetching:
            if self._recording is not None:
                self._recording.append((param, dtype))
            elif self._order is not None:
                self._prefetch_next(param)
        self._issue_deferred()  # after the prefetch: the next weight does not wait behind them
        return got

    def _prefetch_next(self, param) -> None:
        order, pos = self._order, self._pos
        if pos >= len(order) or order[pos][0] is not param:  # order broken: stop prefetching
            self._pos = len(order)
            self._drop_prefetch()
            return
        self._pos += 1
        n = len(order)
        wrap = not self._last and self._phase == "step"
        self._issued = max(self._issued, pos)  # this one came now if it was not prefetched
        while self._issued < pos + PREFETCH_DEPTH:
            k = self._issued = self._issued + 1
            if k < n:
                self._prefetched.append(self._start_gather(*order[k]))
            elif wrap and k - n < n:  # the next micro-batch's first weights
                self._carried.append(self._start_gather(*order[k - n]))
            else:
                break

    def _traced(self, kind: str, param) -> None:
        if self.trace is not None and self.grid.z > 1:
            self.trace.append((kind, param))

    def _settle(self, param) -> None:
        """The sharded optimizer's pending all-gather of ``param`` over data, waited before a
        Z all-gather reads it (a prefetch runs ahead of the module's forward pre-hook)."""
        if self.buckets.shards is not None:
            self.buckets.shards.wait_for((param,))

    def _start_gather(self, param, dtype) -> tuple:
        self._traced("all_gather", param)
        self._settle(param)
        with torch.no_grad():
            shard, meta = _to_send(param, dtype)
            h = all_gather(shard, self.grid, Axis.Z, async_op=True)
        return (param, dtype, h, meta)

    def _drop_prefetch(self) -> None:
        while self._prefetched:
            self._prefetched.pop(0)[2].wait()

    # -- weight gradients: reduce-scatter over Z, then all-reduce over data --------------
    def grad_slot(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """Where a layer may write ``param``'s full-block weight gradient directly: its place
        in its data-parallel bucket (:meth:`GradBuckets.slot`, shaped like ``param``) during a
        training step whose buckets take the gradients as they are (:meth:`folds_late`:
        ``G_z = 1``, no reduce-scatter between), when ``param`` has no gradient yet (later
        micro-batches then accumulate into the slot); None otherwise. Hand the written slot on
        with :meth:`reduce_weight_grad` as usual."""
        if self._in_step and self.folds_late():
            return self.buckets.slot(param)
        return None

    def grad_to_add_into(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """``param``'s gradient, when a layer may add its next full-block weight gradient into
        it in place (a later micro-batch: the gradient exists; ``G_z = 1``: no Z reduce-scatter
        stands between the block and the gradient); None otherwise. Hand the sum on with
        :meth:`weight_grad_added`."""
        return grad_of(param) if self.grid.z == 1 else None

    def grad_for_forward(self, param: torch.nn.Parameter) -> tuple[torch.Tensor, bool] | None:
        """``(gradient, fresh)`` for a layer that writes its full-block weight gradient in place
        before backward reaches it (the fused LM head and loss, in forward), ``G_z = 1``:
        ``param``'s gradient where it exists (add into it), else a new one made ``param``'s at
        once, uninitialised (``fresh``: write it, do not add), in its data-parallel bucket where
        the buckets take the gradients as they are (:meth:`folds_late`; also outside a
        micro-batch's phase: a pipeline schedule computes the loss after the stage's forward),
        so that a later micro-batch's forward, even one before this one's backward (GPipe),
        adds into it. None with ``G_z > 1``. Hand it on with :meth:`weight_grad_added` in
        backward."""
        if self.grid.z > 1:
            return None
        have = grad_of(param)
        if have is not None:
            return have, False
        fresh = self.buckets.slot(param) if self.folds_late() else None
        if fresh is None:
            fresh = torch.empty_like(param, dtype=grad_dtype(param))
        set_grad(param, fresh)
        return fresh, True

    def weight_grad_added(self, param: torch.nn.Parameter) -> None:
        """:meth:`reduce_weight_grad` for a block gradient already added into ``param``'s
        gradient (:meth:`grad_to_add_into`, :meth:`grad_for_forward`): ``param`` is ready for
        its data-parallel bucket."""
        self._grad_ready(param, None)

    def reduce_weight_grad(self, param: torch.nn.Parameter, block_grad: torch.Tensor) -> None:
        """Sum a full-block weight gradient over Z into ``param.grad`` (this rank's rows),
        asynchronously when ``reduce_scatter`` overlap is on."""
        if self._in_step and self.on("reduce_scatter"):
            if self._gathers_follow():
                self._deferred_rs.append((param, block_grad))
                return
            self._issue_deferred()
            self._issue_rs(param, block_grad)
        else:
            self._traced("reduce_scatter", param)
            self._grad_ready(param, reduce_scatter(block_grad, self.grid, Axis.Z))

    def _gathers_follow(self) -> bool:
        """Whether a prefetching micro-batch has Z all-gathers left in its recorded order
        (``G_z > 1``): then a reduce-scatter waits until the next one is issued, so that the
        Z stream, which runs collectives in issue order, gathers the next weight first."""
        order = self._order
        return (
            self._prefetching and self._recording is None and order is not None
        ) and self._pos < len(order)

    def _issue_deferred(self) -> None:
        while self._deferred_rs:
            self._issue_rs(*self._deferred_rs.pop(0))

    def _issue_rs(self, param, block_grad: torch.Tensor) -> None:
        self._traced("reduce_scatter", param)
        self._pending_rs.append(
            (param, reduce_scatter(block_grad, self.grid, Axis.Z, async_op=True))
        )
        self.counts["async_reduce_scatters"] += self.grid.z > 1
        # hand on, in order, the gradients beyond REDUCE_SCATTERS_IN_FLIGHT (at once with
        # G_z = 1: no collective, so its data-parallel bucket can start now). A fixed count,
        # not whether a collective looks complete: that differs between ranks and runs (and on
        # NCCL, whose host runs ahead of the GPU, is almost never true during backward).
        pending = self._pending_rs
        while pending and (len(pending) > REDUCE_SCATTERS_IN_FLIGHT or pending[0][1].work is None):
            self._finish_rs(*pending.pop(0))

    def _finish_rs(self, param, handle: Handle) -> None:
        self._grad_ready(param, handle.wait())

    def _grad_ready(self, param, shard: torch.Tensor | None) -> None:
        if shard is not None:  # None: added in place already (:meth:`weight_grad_added`)
            add_grad(param, shard)
        if (
            self._in_step
            and self._last
            and self.on("dp_all_reduce")
            and self.grid.size(Axis.DATA) > 1
        ):
            self.buckets.add(param)

    # -- activations: a Linear's GEMM and its all-reduce -----------------------------------
    def _fine(self, axis: Axis, rows: int) -> bool:
        """Whether ``fine`` fuses this GEMM with its reduce-scatter: not under an FP8 recipe
        (whose GEMMs run whole, and whose small Linears the planner models without it)."""
        g = self.grid.size(axis)
        fine = self._in_step and self.on("fine") and g > 1 and rows % g == 0
        fine = fine and fp8_recipe() == "off"
        self.counts["fine_fused"] += fine
        return fine

    def forward_gemm_all_reduce(self, x: torch.Tensor, w: torch.Tensor, axis: Axis) -> torch.Tensor:
        """``all_reduce_axis(x @ w^T)`` for ``x [rows, k]``, ``w [n, k]`` -> ``[rows, n]``:
        fused with its GEMM (``fine``), split in halves (``domino``) or plain."""
        rows = x.shape[0]
        if self._fine(axis, rows):
            with torch.autocast(x.device.type, enabled=False):  # operands are in compute dtype
                part = ring_matmul_reduce_scatter(x, w, self.grid, axis, self.fine_chunks)
            return all_gather(part, self.grid, axis)
        if self._in_step and self.on("domino") and self.grid.size(axis) > 1:
            if rows >= 2 * self.domino_min_rows:
                # Domino: the first half's all-reduce runs during the second half's GEMM.
                self.counts["domino_splits"] += 1
                half = rows // 2
                h1 = all_reduce(x[:half] @ w.t(), self.grid, axis, async_op=True)
                h2 = all_reduce(x[half:] @ w.t(), self.grid, axis, async_op=True)
                return torch.cat([h1.wait(), h2.wait()])
        return all_reduce(x @ w.t(), self.grid, axis)

    def backward_gemm_all_reduce(self, dy: torch.Tensor, w: torch.Tensor, axis: Axis) -> Handle:
        """Start ``all_reduce_axis(dy @ w)`` for ``dy [rows, n]``, ``w [n, k]`` -> ``[rows, k]``
        and return its :class:`Handle`: with ``fine`` the reduce-scatter is fused with the GEMM
        and the all-gather left in flight; with ``dx_all_reduce`` the all-reduce is left in
        flight (both run during the caller's dW GEMM); otherwise blocking."""
        in_flight = self._in_step and self.on("dx_all_reduce")
        if self._fine(axis, dy.shape[0]):
            with torch.autocast(dy.device.type, enabled=False):
                part = ring_matmul_reduce_scatter(dy, w.t(), self.grid, axis, self.fine_chunks)
            if in_flight:
                return all_gather(part, self.grid, axis, async_op=True)
            return Handle(None, all_gather(part, self.grid, axis), None, 0.0)
        return self.backward_all_reduce(dy @ w, axis)

    def backward_all_reduce(self, dx: torch.Tensor, axis: Axis) -> Handle:
        """Start the dx all-reduce; returns a :class:`Handle` (async when ``dx_all_reduce``)."""
        if self._in_step and self.on("dx_all_reduce"):
            self.counts["async_dx_all_reduces"] += self.grid.size(axis) > 1
            return all_reduce(dx, self.grid, axis, async_op=True)
        return Handle(None, all_reduce(dx, self.grid, axis), None, 0.0)

    def backward_scatter_sequence(self, dx: torch.Tensor) -> Handle:
        """Start the sequence-parallel input gradient's reduce-scatter over Y along the sequence
        (``[b, s, k]`` -> ``[b, s/G_y, k]``, :func:`tetrad.parallel.sequence.scatter_sequence`);
        in flight during the caller's dW GEMM with ``dx_all_reduce``, else blocking."""
        if self._in_step and self.on("dx_all_reduce"):
            self.counts["async_dx_all_reduces"] += self.grid.y > 1
            return scatter_sequence(dx, self.grid, async_op=True)
        return Handle(None, scatter_sequence(dx, self.grid), None, 0.0)


def _to_send(param: torch.nn.Parameter, dtype) -> tuple[torch.Tensor, object]:
    """What the Z all-gather of ``param`` in ``dtype`` sends: ``(the shard cast, None)``, or
    for an FP8 format its ``pack`` (the FP8 bytes and their scale)."""
    if isinstance(dtype, torch.dtype):
        return param.detach().to(dtype), None
    return dtype.pack(param)


def _received(dtype, gathered: torch.Tensor, meta) -> torch.Tensor:
    """The gathered weight: as it came, or an FP8 format's ``unpack`` of it."""
    return gathered if meta is None else dtype.unpack(gathered, meta)
