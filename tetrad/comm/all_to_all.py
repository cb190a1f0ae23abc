"""All-to-all over one axis of the process grid (expert parallelism's token dispatch and
combine), counted in the grid's :class:`~tetrad.comm.collectives.CommLog` like every other
collective.

Bytes recorded per call: ``payload_bytes`` the larger of input and output, ``bytes`` what this
rank sends to the *other* ranks of the group (the rows of its own split stay in memory), which
is what :func:`tetrad.plan.comm.experts.all_to_all_bytes` predicts from the routing counts.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tetrad.comm.collectives import Groups, Handle, _axis_info, _issue
from tetrad.spec.grid import Axis


def all_to_all(
    t: torch.Tensor,
    grid: Groups,
    axis: Axis | str,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Send ``input_splits[j]`` rows of ``t [N, ...]`` (consecutive, in group order) to rank
    ``j`` of ``axis`` and receive ``output_splits[j]`` rows from it: ``[sum(output_splits),
    ...]`` (``torch.distributed.all_to_all_single``). Without splits, ``N`` is cut in ``G``
    equal pieces. On an axis of size 1, ``t`` itself.

    Raises:
        ValueError: (from torch) splits that do not add up to the rows.
    """
    g, group = _axis_info(grid, axis)
    if g == 1:
        return Handle(None, t, None, 0.0) if async_op else t
    t = t.contiguous()
    row = math.prod(t.shape[1:]) * t.element_size()  # bytes per dim-0 row (0 rows is fine)
    ins = input_splits if input_splits is not None else [t.shape[0] // g] * g
    outs = output_splits if output_splits is not None else [t.shape[0] // g] * g
    out = t.new_empty((sum(outs), *t.shape[1:]))
    me = dist.get_group_rank(group, dist.get_rank())
    sent = (sum(ins) - ins[me]) * row
    h = _issue(
        grid,
        axis,
        max(sum(ins), sum(outs)) * row,
        sent,
        lambda: dist.all_to_all_single(
            out, t, output_splits, input_splits, group=group, async_op=True
        ),
        out,
    )
    return h if async_op else h.wait()
