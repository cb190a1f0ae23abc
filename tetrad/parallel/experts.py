"""Grid side of the mixture-of-experts blocks (:mod:`tetrad.models.moe`): the step's expert
loads summed over the ranks that saw other tokens, for DeepSeek-V3's aux-loss-free bias update.
"""

from __future__ import annotations

import torch
from torch import nn

from tetrad.comm import all_reduce
from tetrad.grid import Grid
from tetrad.models.moe import Router
from tetrad.spec import Axis


def biased_routers(model: nn.Module) -> list[Router]:
    """The routers of ``model`` that carry a selection bias (``bias_update_rate > 0``)."""
    return [m for m in model.modules() if isinstance(m, Router) and m.bias is not None]


@torch.no_grad()
def update_expert_biases(model: nn.Module, grid: Grid) -> None:
    """Update every router's selection bias from the token slots its experts received this
    step (:meth:`Router.update_bias`), the counts ``[E]`` of all routers summed in one buffer
    over Z and data x context (every rank then holds the same biases). Call once per optimizer
    step, after the last micro-batch; nothing to do for a model without biased routers.
    """
    routers = biased_routers(model)
    if not routers:
        return
    counts = torch.cat([r.tokens_per_expert for r in routers])
    all_reduce(counts, grid, Axis.Z)
    all_reduce(counts, grid, Axis.DATA)
    for r, c in zip(routers, counts.split([r.n_experts for r in routers]), strict=True):
        r.update_bias(c)
