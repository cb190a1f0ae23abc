"""The routed experts' gradient sums over expert-data, issued during backward.

The expert-sharded weights (split over the expert axis, :mod:`tetrad.parallel.experts`) are
summed over their expert-data group alone (:attr:`tetrad.parallel.placement.Placement.
grad_sum_axes`), never in the data-parallel buckets. Without this, that sum is one blocking
all-reduce after backward (:func:`tetrad.parallel.grads.sync_gradients`). With the
``dp_all_reduce`` overlap it is issued per MoE block instead, on the step's last micro-batch,
once the block's experts have finished their backward (a full backward hook on the experts
module: its input's gradient comes after every expert GEMM's, whose weight gradients autograd
accumulates first; every rank of the group runs it, whatever its experts received, so the
collectives match), and runs while the earlier blocks compute their backward; the end of the
micro-batch waits for them all. Megatron-LM's distributed data parallelism reduces its
expert-parallel gradient buffers during backward likewise.

With the sharded optimizer (:attr:`tetrad.parallel.zero.DataShards.experts`) each block's sum
is a reduce-scatter over expert-data that leaves this rank its pieces; else an all-reduce of
the block's three gradients flattened in the ``--grad-reduce-dtype`` format, copied back. Either
way :func:`~tetrad.parallel.grads.sync_gradients` finds the weights in the reduced set and sums
nothing more for them.
"""

from __future__ import annotations

import torch
from torch import nn

from tetrad.comm import Handle, all_reduce
from tetrad.grid import Grid
from tetrad.parallel.masters import grad_dtype, grad_of, reduce_dtype, set_grad
from tetrad.spec.grid import Axis


class ExpertGradSums:
    """The in-flight expert-data sums of one model part's MoE blocks.

    Args:
        grid: the grid (its expert-data group has more than one rank).
        modules: the part's experts modules (:class:`tetrad.parallel.experts.
            ExpertParallelExperts`), each summed as one when its backward ends.

    Attributes:
        shards: the sharded optimizer's :class:`~tetrad.parallel.zero.DataShards` (set by the
            training step with the buckets'); None: all-reduces.
    """

    def __init__(self, grid: Grid, modules: list[nn.Module]):
        self.grid = grid
        self.shards = None
        self._in_flight: list[tuple[list[nn.Parameter], list[torch.Tensor] | None, Handle]] = []
        self._active = False
        for m in modules:
            m.register_full_backward_hook(self._finished)

    def begin(self, last: bool) -> None:
        """Start a training micro-batch: on the step's ``last`` one, issue each block's sum as
        its experts' backward ends."""
        self._active = last

    def _finished(self, module: nn.Module, _grad_in, _grad_out) -> None:
        if self._active:
            self._issue(list(module.parameters()))

    @torch.no_grad()
    def _issue(self, params: list[nn.Parameter]) -> None:
        grads = []
        for p in params:  # a weight no row reached on this rank: a zero gradient
            if grad_of(p) is None:
                set_grad(p, torch.zeros_like(p, dtype=grad_dtype(p)))
            grads.append(grad_of(p))
        shards = self.shards.experts if self.shards is not None else None
        if shards is not None:
            self._in_flight.append((params, None, shards.reduce_scatter(params, grads, True)))
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).to(reduce_dtype(params[0]))
        handle = all_reduce(flat, self.grid, Axis.EXPERT_DATA, async_op=True)
        self._in_flight.append((params, grads, handle))

    @torch.no_grad()
    def finish(self, reduced: set[int]) -> None:
        """Wait for every block's sum of the step, put the results in place (the gradients,
        or the sharded optimizer's pieces) and add the weights' ids to ``reduced``."""
        for params, grads, handle in self._in_flight:
            row = handle.wait()
            if grads is None:
                self.shards.experts.take(params, row)
            else:
                offset = 0
                for g in grads:
                    g.copy_(row[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
            reduced.update(id(p) for p in params)
        self._in_flight, self._active = [], False
