"""Checkpoints with the old interleaved ``w13`` (:mod:`tetrad.train.legacy_layout`): the rows a
rank reads with the old placement, de-interleaved, are its shard of the stacked weight on every
grid; whole tensors convert by name and shape. (End to end, a run saved by d25e0c3 on 1,2,1,2
and resumed by this code on 2,1,2,1 repeated the old run's losses exactly, and its exports and
samples were the old code's: docs/checkpoints.md.)"""

import itertools
from types import SimpleNamespace

import torch

from tetrad.parallel.placement import Placement
from tetrad.spec.grid import Axis
from tetrad.train.legacy_layout import (
    interleaved_placement,
    is_interleaved,
    stacked_from_interleaved,
    whole_from_saved,
)

F, H = 24, 8


def _grid(y: int, z: int, x: int, cy: int, cz: int, cx: int) -> SimpleNamespace:
    sizes = {Axis.Y: y, Axis.Z: z, Axis.X: x}
    return SimpleNamespace(size=sizes.__getitem__, coord={Axis.Y: cy, Axis.Z: cz, Axis.X: cx})


def test_old_rows_are_the_new_shard_on_every_grid():
    stacked = torch.arange(2 * F * H, dtype=torch.float32).view(2, F, H)
    old_full = stacked.transpose(0, 1).reshape(2 * F, H)  # gate_0, up_0, gate_1, up_1, ...
    new = Placement((2, F, H), ((), (Axis.Y, Axis.Z), (Axis.X,)), stacked=True)
    old = interleaved_placement(new)
    assert old.shape == (2 * F, H) and is_interleaved(new, old.shape)
    assert not is_interleaved(new, new.shape)
    for y, z, x in itertools.product((1, 2, 4), (1, 3), (1, 2)):
        for cy, cz, cx in itertools.product(range(y), range(z), range(x)):
            grid = _grid(y, z, x, cy, cz, cx)
            rows = old_full[old.local_slices(grid)]
            got = stacked_from_interleaved(rows).view(new.param_shape(grid))
            assert torch.equal(got, new.shard_of(stacked, grid)), (y, z, x, cy, cz, cx)


def test_whole_tensors_convert_by_name_and_shape():
    stacked = torch.randn(2, F, H)
    old = stacked.transpose(0, 1).reshape(2 * F, H)
    for name in (
        "model.layers.3.feed_forward.w13.weight",
        "layers.0.feed_forward.shared.w13.weight",
    ):
        assert torch.equal(whole_from_saved(name, old), stacked.view(2 * F, H))
        assert torch.equal(whole_from_saved(name, stacked), stacked.view(2 * F, H))
    other = torch.randn(2 * F, H)
    assert whole_from_saved("model.layers.3.attention.wqkv.weight", other) is other
