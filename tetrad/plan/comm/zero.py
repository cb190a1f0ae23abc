"""The sharded optimizer (ZeRO-1, tetrad/parallel/zero.py) in the planner's time model: which
contexts model it (:func:`shards_optimizer`) and a context that does (:func:`sharded`).

A :class:`~tetrad.plan.comm.context.Context` models the runtime with or without the sharded
optimizer for every grid it is asked about; the flag lives on the context because the estimates
memoised in it (a pipeline rank's times) depend on it. What changes
(:func:`tetrad.plan.comm.layers.data_gradients`, :func:`~tetrad.plan.comm.layers.step_scalars`):
the data-parallel all-reduces become reduce-scatters of the same payload, one all-gather of the
updated parameters per reduce-scatter follows the update (hidden by the next step's forward as
far as :func:`~tetrad.plan.comm.layers.gather_exposed` says), and the gradient norm is
summed over the world. The optimizer's element-wise time is left as AdamW's over the whole local
shard: the update of ``1/G`` of the elements plus the runtime's packing copies (gradients into
the reduce-scatter's buffer, the gathered parameters back) move about as many bytes.
"""

from __future__ import annotations

import copy

from tetrad.plan.comm.context import Context

FLAG = "shard_optimizer"


def shards_optimizer(ctx: Context) -> bool:
    """Whether ``ctx`` models the sharded optimizer."""
    return bool(getattr(ctx, FLAG, False))


def sharded(ctx: Context) -> Context:
    """A context like ``ctx`` that models the sharded optimizer (made once per ``ctx`` and
    kept in it): it shares the memos that do not depend on the optimizer (shapes, compute, the
    X/Y records, a block's X/Y seconds) and has its own pipeline rank times and stage contexts
    (:func:`tetrad.plan.pipe.estimate.stage_context` passes the flag on)."""
    got = ctx.__dict__.get("_sharded")
    if got is None:
        got = copy.copy(ctx)
        for memo in ("_rank_times", "_sharded", "_stage_contexts"):
            got.__dict__.pop(memo, None)
        setattr(got, FLAG, True)
        ctx.__dict__["_sharded"] = got
    return got
