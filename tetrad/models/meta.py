"""Models built on the meta device, then given storage where they live.

A model is built inside ``with torch.device("meta")``: its parameters have shapes and dtypes but
no memory, and nothing is drawn (``torch.nn``'s own initialisers do nothing on meta). Then
:func:`materialize` allocates each tensor on its device, uninitialised: on a grid, each rank
only its own shards (:func:`tetrad.parallel.placement.sharded_parameter` makes them at their
local shape), and a parameter's value is written once, where it lives, by
:func:`tetrad.parallel.init_parameters` (or a checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Give every meta parameter and buffer of ``module`` storage on ``device``, in place.

    A parameter gets an uninitialised tensor of its shape and dtype; a buffer gets zeros (the
    model code's only buffers, the MoE routers' selection biases and expert loads, start at
    zero: ``tests/test_init.py`` checks it against a model built off meta). Unlike
    ``nn.Module.to_empty``, which makes new ``Parameter`` objects, each parameter stays the
    same Python object with its attributes (``placement``, ``init``) and its ties
    (``torch.utils.swap_tensors``), so lists of parameters taken on meta remain valid. Tensors
    already on a real device are left alone; with ``device`` meta nothing changes.

    Returns:
        ``module``.
    """
    device = torch.device(device)
    if device.type == "meta":
        return module
    for mod in module.modules():
        for p in mod._parameters.values():
            if p is not None and p.is_meta:
                new = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                new.__dict__.update(p.__dict__)
                torch.utils.swap_tensors(p, new)
        for key, b in mod._buffers.items():
            if b is not None and b.is_meta:
                new = torch.zeros_like(b, device=device)
                new.__dict__.update(b.__dict__)
                mod._buffers[key] = new
    return module
