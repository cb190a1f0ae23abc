"""Part (a) of ``benchmarks/gpu_check.py``, resume: a checkpoint taken after one training step
and loaded into a fresh model and optimizer continues as the uninterrupted run.

On CUDA the trainer's AdamW is torch's fused kernel, which reads its step counters on the
device; a counter a checkpoint load left on the host failed its first step
(:func:`tetrad.parallel.masters.place_steps`). Run with fp32 weights (AdamW on the
parameters) and with bf16 weights (AdamW on fp32 masters). The same device, kernels and
batches on both sides: the second step's loss and the weights after it agree to round-off
(:data:`LOSS_REL`, :data:`WEIGHT_REL`).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from tetrad.grid import Grid
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.spec.precision import Precision, precision
from tetrad.spec.presets import PRESETS
from tetrad.train.checkpoint import Checkpointer
from tetrad.train.step import build_optimizer, train_step

from .common import SEED, say
from .equivalence import rel_norm
from .profiles import Profile

LOSS_REL = 1e-6
"""Largest relative difference of the second step's loss (nats per token)."""
WEIGHT_REL = 1e-5
"""Largest relative norm ``||a - b|| / ||b||`` of any weight after the second step."""


def _two_steps(
    grid: Grid, prof: Profile, policy: Precision, batches: list, ckpt: Checkpointer, resume: bool
) -> tuple[float, dict[str, torch.Tensor]]:
    """The check model trained on ``batches``: saved after the first step, or (``resume``)
    loaded from that checkpoint instead of taking it. ``(last loss, weights by name)``."""
    model = ParallelLlama(PRESETS[prof.check_model], grid)
    init_parameters(model, SEED, grid)
    opt = build_optimizer(model, 1e-3, 0.1, policy=policy)
    first = 0
    if resume:
        first = ckpt.load(model, opt, ckpt.run_dir / "checkpoints" / "step_0000001")
    loss = torch.zeros(())
    for i, batch in enumerate(batches[first:], start=first):
        loss, _ = train_step(model, opt, grid, batch, batch.shape[0] // 2, grad_clip=1.0)
        if i == 0:
            ckpt.save(model, opt, 1)
            ckpt.wait()
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return float(loss), weights


def resume_checks(grid: Grid, prof: Profile) -> list[dict]:
    """One record per policy: the losses, the worst weight's relative norm, the verdict."""
    cfg = PRESETS[prof.check_model]
    gen = torch.Generator().manual_seed(SEED)
    shape = (prof.check_batch, prof.check_seq + 1)
    batches = [torch.randint(0, cfg.vocab_size, shape, generator=gen) for _ in range(2)]
    device = grid.device.type
    policies = {"fp32 weights": precision(device), "bf16 weights": precision(device, "bf16")}
    records = []
    for name, policy in policies.items():
        say(f"(a) resume check: {name}")
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(prefix="gpu_check_resume_") as d:
                ckpt = Checkpointer(Path(d), grid)
                whole_loss, whole = _two_steps(grid, prof, policy, batches, ckpt, resume=False)
                loss, resumed = _two_steps(grid, prof, policy, batches, ckpt, resume=True)
                ckpt.close()
        except Exception as e:  # the failure this check looks for raises: record it, go on
            error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            records.append({"check": "resume after one step", "policy": name, "error": error})
            records[-1] |= {"seconds": time.perf_counter() - t0, "passed": False}
            continue
        worst = max(rel_norm(resumed[n], whole[n]) for n in whole)
        loss_rel = abs(loss - whole_loss) / abs(whole_loss)
        records.append(
            {
                "check": "resume after one step",
                "policy": name,
                "loss": loss,
                "uninterrupted_loss": whole_loss,
                "loss_rel": loss_rel,
                "weight_rel_norm_worst": worst,
                "tolerance": {"loss_rel": LOSS_REL, "weight_rel": WEIGHT_REL},
                "seconds": time.perf_counter() - t0,
                "passed": loss_rel <= LOSS_REL and worst <= WEIGHT_REL,
            }
        )
    return records
