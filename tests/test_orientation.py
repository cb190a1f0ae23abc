"""The layer pairs turned (orientation ``yx``: the grid's X dimension plays the Y role): the
whole model against the single-process reference on every grid of ``tests/test_model.py`` with
a tensor axis, and checkpoints that move between orientations.

``tests/test_model.py`` runs the same grids in ``xy``; ``tests/test_plan_validation.py`` checks
the planner's bytes against the runtime's in both; ``tests/test_plan_orientation.py`` the choice.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_model import GRIDS, reference_run, run_one
from tests.test_train import config as train_config
from tetrad.grid import Grid
from tetrad.spec.overlap import OVERLAPS
from tetrad.train import trainer

TURNED = {n: [g for g in grids if g[-1] > 1 or g[-2] > 1] for n, grids in GRIDS.items() if n > 1}


def _turned_runs(ref_curves, ref_weights, grids) -> None:
    for sizes in grids:
        grid = Grid.build(sizes, "cpu", "yx")
        run_one(grid, sizes, ref_curves, ref_weights, "none", OVERLAPS, False)


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.mark.parametrize("world_size", sorted(TURNED))
def test_turned_grids_match_reference(world_size, reference):
    """Loss, gradient norm and every updated weight shard as ``tests/test_model.py`` checks
    them, with every overlap on."""
    run_distributed(_turned_runs, world_size, *reference, TURNED[world_size])


# ---------------------------------------------------------------- checkpoints across orientations


def _config(corpus, run_dir, steps: int, grid: str, **extra):
    extra = {"val_every": 1000, "log_every": 1, "warmup_steps": 100, "checkpoint_every": 0} | extra
    return train_config(corpus, run_dir, steps, grid=grid, **extra)


def _train(cfg) -> None:
    trainer.train(cfg)


def _run(cfg, world: int) -> None:
    trainer.preflight(cfg)
    run_distributed(_train, world, cfg)


def _losses(run_dir) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(corpus, tmp_path_factory):
    """Four uninterrupted steps on one rank: what both resumes below are compared with."""
    root = tmp_path_factory.mktemp("orientation")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TETRAD_CACHE", str(root / "cache"))
        _run(_config(corpus, root / "whole", 4, "1,1,1,1"), 1)
    return root / "whole"


@pytest.mark.parametrize("to_grid,world", [("1,1,2,1", 2), ("1,1,2,2", 4)])
def test_checkpoint_of_x_alone_resumes_on_other_grids(
    corpus, whole, tmp_path, monkeypatch, to_grid, world
):
    """Two steps on 1,1,1,2 (turned: X plays Y), resumed for two more on ``to_grid`` (DCP
    reshards from the roles' layout), against four uninterrupted steps."""
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    _run(_config(corpus, run, 2, "1,1,1,2"), 2)
    meta = json.loads((run / "checkpoints" / "step_0000002" / "tetrad.json").read_text())
    assert meta["grid"] == [1, 1, 1, 1, 2] and meta["orientation"] == "yx"
    _run(_config(corpus, run, 4, to_grid, resume=True), world)
    assert _losses(run) == pytest.approx(_losses(whole), abs=1e-5)


# ---------------------------------------------------------------- Hugging Face folders


def _hf_folder(folder) -> torch.Tensor:
    """A Hugging Face Llama folder of the ``tiny`` reference (seed 0) and its mean loss on a
    fixed batch ``[4, 17]``; returns the batch."""
    from safetensors.torch import save_file

    from tetrad.models.hf import hf_config, to_hf
    from tetrad.models.reference import Llama as Reference
    from tetrad.parallel import init_parameters
    from tetrad.spec.presets import PRESETS

    cfg = PRESETS["tiny"]
    ref = Reference(cfg)
    init_parameters(ref, 0)
    tensors = {}
    for name, p in ref.named_parameters():
        tensors |= {
            k: v.contiguous() for k, v in to_hf(name, p.detach(), cfg, cfg.vocab_size).items()
        }
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(cfg, cfg.vocab_size, None, "float32")))
    batch = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    loss = ref.loss_sum(batch[:, :-1], batch[:, 1:]) / batch[:, 1:].numel()
    (folder / "loss.json").write_text(json.dumps(loss.item()))
    return batch


def _load_turned(folder, sizes, batch, out) -> None:
    from tetrad.parallel.model import ParallelLlama
    from tetrad.spec.presets import PRESETS
    from tetrad.train.preflight import init_from_hf
    from tetrad.train.step import evaluate

    grid = Grid.build(sizes, "cpu", "yx")
    model = ParallelLlama(PRESETS["tiny"], grid)
    init_from_hf(model, grid, folder)
    loss = evaluate(model, grid, [batch], micro_batch=1)
    if not any(grid.coord.values()):
        (out / f"{'-'.join(map(str, sizes))}.json").write_text(json.dumps(loss))


@pytest.mark.parametrize("sizes", [(1, 1, 1, 2), (1, 1, 2, 2)])
def test_hugging_face_folder_loads_into_turned_grids(tmp_path, sizes):
    """Each rank reads its slices of the roles' layout (placements are by role): the loss of
    the loaded model equals the reference's."""
    batch = _hf_folder(tmp_path / "hf")
    run_distributed(_load_turned, sizes[2] * sizes[3], tmp_path / "hf", sizes, batch, tmp_path)
    got = json.loads((tmp_path / f"{'-'.join(map(str, sizes))}.json").read_text())
    want = json.loads((tmp_path / "hf" / "loss.json").read_text())
    assert got == pytest.approx(want, rel=1e-5)
