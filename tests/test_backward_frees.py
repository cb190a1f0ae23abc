"""Backward frees each block's saved activations as it passes, in every checkpointing mode.

Autograd releases a node's saved tensors after the node's backward, but the graph's nodes (and
any tensor a custom Function keeps as a ``ctx`` attribute) live until the whole graph is
dropped. A tensor reachable that way stays allocated for the rest of backward, so the peak of
backward grows back towards the forward peak of no recomputation: measured on an H200 before
the fix, selective recompute's backward peak was 7.8 GiB against its forward peak of 5.0 GiB
(llama-1b, micro-batch 2, seq 2048), and its step peak 1.28-1.43x the memory model's.
"""

import gc
import weakref

import torch

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.models import recompute
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.spec.activation_checkpointing import CHECKPOINTING
from tetrad.spec.presets import PRESETS


def _survivors(mode: str) -> list[str]:
    """Shapes of saved activations still alive after backward while the loss (and with it the
    graph) is still referenced."""
    grid = Grid.build((1, 1, 1, 1))
    cfg = PRESETS["tiny"]
    model = ParallelLlama(cfg, grid, mode)
    init_parameters(model, 0, grid)
    params = {id(p) for p in model.parameters()}
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params and t.requires_grad and t.grad_fn is not None:
            saved.append(weakref.ref(t))
        return t

    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    recompute.observer = pack  # tensors selective mode's own hook keeps
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.loss_sum(tokens[:, :-1], tokens[:, 1:])
    finally:
        recompute.observer = None
    assert saved, "no saved activation seen"
    loss.backward()
    gc.collect()
    alive = [tuple(t.shape) for r in saved if (t := r()) is not None]
    del loss
    return [str(s) for s in alive]


def _worker(out: str) -> None:
    lines = [f"{mode}: {' '.join(_survivors(mode))}" for mode in CHECKPOINTING]
    with open(out, "w") as fh:
        fh.write("\n".join(lines))


def test_backward_releases_saved_activations(tmp_path):
    out = tmp_path / "survivors.txt"
    run_distributed(_worker, 1, str(out))
    report = out.read_text().splitlines()
    assert len(report) == len(CHECKPOINTING)
    assert all(not line.split(":", 1)[1].strip() for line in report), "\n".join(report)
