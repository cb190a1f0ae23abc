"""What tests/test_hf.py runs on gloo ranks, in a module that does not import transformers
(each rank imports the module of the function it runs: transformers took 0.6 s a rank)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tetrad.grid import Grid
from tetrad.models.hf import read_config
from tetrad.parallel.batch import local_samples
from tetrad.parallel.model import ParallelLlama
from tetrad.train import trainer
from tetrad.train.preflight import init_from_hf
from tetrad.train.step import evaluate


def loss_on_grid(folder: Path, sizes, batch: torch.Tensor, logits, out: Path) -> None:
    """On every rank: its logits block equals transformers'; rank 0 writes the loss."""
    grid = Grid.build(sizes)
    cfg = read_config(folder)[0]
    model = ParallelLlama(cfg, grid)
    init_from_hf(model, grid, folder)
    model.eval()
    with torch.no_grad():
        loss = evaluate(model, grid, [batch], micro_batch=1)
        rows = local_samples(batch, grid)[:, :-1]
        n = rows.shape[0]
        block = cfg.vocab_size // (grid.size("y") * grid.size("x"))
        first = (grid.coord["y"] * grid.size("x") + grid.coord["x"]) * block
        want = local_samples(logits, grid)[:n, :, first : first + block]
        torch.testing.assert_close(model(rows), want, rtol=1e-5, atol=1e-5)
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(loss))


def train(cfg) -> None:
    """``tetrad train`` on this rank."""
    trainer.train(cfg)
