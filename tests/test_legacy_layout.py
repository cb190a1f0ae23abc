"""Checkpoints with the old interleaved ``w13`` (:mod:`tetrad.train.legacy_layout`): the rows a
rank reads with the old placement, de-interleaved, are its shard of the stacked weight on every
grid; whole tensors convert by name and shape; a checkpoint written in the old layout on one
grid resumes on another (it fails with the de-interleaving left out). (With the old code
itself, a run saved by d25e0c3 on 1,2,1,2 and resumed by this code on 2,1,2,1 repeated the old
run's losses exactly, and its exports and samples were the old code's: docs/checkpoints.md.)"""

import itertools
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.distributed import run_distributed
from tetrad.grid import Grid
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


def _legacy_resume(run_dir: str) -> None:
    """Trained a step on Z 2 x Y 2 and saved in the old layout (the stacked weights' local rows
    interleaved under the old placement, as d25e0c3 wrote them); loaded on data 2 x X 2: the
    next step's loss equals the one the saving model takes, so the weights and AdamW states
    came back."""
    from tetrad.parallel import init_parameters
    from tetrad.parallel.model import ParallelLlama
    from tetrad.spec.presets import PRESETS
    from tetrad.train.checkpoint import Checkpointer
    from tetrad.train.step import build_optimizer, train_step

    class LegacyWriter(Checkpointer):
        def _dtensor(self, t, placement):
            if not placement.stacked:
                return super()._dtensor(t, placement)
            rows = t.view(2, -1, t.shape[-1]).transpose(0, 1).reshape(t.shape)  # gate, up, ...
            return super()._dtensor(rows, interleaved_placement(placement))

    cfg = PRESETS["tiny"]
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, cfg.vocab_size, (4, 17), generator=gen) for _ in range(2)]
    losses = []
    for sizes, writer in (((1, 2, 2, 1), LegacyWriter), ((2, 1, 1, 2), Checkpointer)):
        grid = Grid.build(sizes)
        model = ParallelLlama(cfg, grid, "none")
        init_parameters(model, 5, grid)
        opt = build_optimizer(model, 1e-3, 0.1)
        ckpt = writer(run_dir, grid)
        if writer is LegacyWriter:
            train_step(model, opt, grid, batches[0], 2, 1.0)
            ckpt.save(model, opt, 1)
            ckpt.wait()
        else:
            assert ckpt.load(model, opt, Path(run_dir) / "checkpoints" / "step_0000001") == 1
        losses.append(float(train_step(model, opt, grid, batches[1], 2, 1.0)[0]))
        ckpt.close()
    assert abs(losses[0] - losses[1]) <= 1e-5 * losses[0], losses


def test_resume_from_the_old_layout_on_another_grid(tmp_path):
    run_distributed(_legacy_resume, 4, str(tmp_path))
