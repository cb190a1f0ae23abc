"""The planner inside ``tetrad train``: ``--grid auto``, and whether the Domino split pays.

Both ask :mod:`tetrad.plan` (the analytical model of communication, compute and memory; see
docs/planner.md) about this run's model, batch and machine.
"""

from __future__ import annotations

import dataclasses
import os

from tetrad.models.config import ModelConfig
from tetrad.spec import GiB, parse_overlaps
from tetrad.train.config import ConfigError, TrainConfig

# Machine presets that match a CUDA device name, for --grid auto without --machine.
GPU_MACHINES = {"H200": "h200-node", "H100": "dgx-h100", "A100": "dgx-a100-80gb"}


def default_nproc(cfg: TrainConfig) -> int:
    """Processes for ``--grid auto`` outside torchrun: ``--nproc``, else every visible GPU
    (CUDA), else 4 (CPU)."""
    if cfg.nproc:
        return cfg.nproc
    if cfg.device == "cuda":
        from tetrad.device import gpu_count

        return max(1, gpu_count())
    return 4


def machine_for(cfg: TrainConfig):
    """The planner's :class:`~tetrad.plan.machines.Machine` for this run: ``--machine`` (a preset
    or the TOML file ``tetrad calibrate`` wrote), else a preset matching the CUDA device.

    Raises:
        ConfigError: no machine given and none can be inferred, or the machine is unknown.
    """
    from tetrad.plan.machines import get_machine
    from tetrad.plan.models import PlanError

    name = cfg.machine
    if not name and cfg.device == "cuda":
        from tetrad.device import device_name, local_device

        gpu = device_name(local_device("cuda"))
        name = next((m for key, m in GPU_MACHINES.items() if key in gpu), "")
    if not name:
        raise ConfigError(
            "--grid auto needs a machine description: pass --machine with a "
            "preset (e.g. dgx-h100) or the file `tetrad calibrate` writes"
        )
    try:
        return get_machine(name)
    except PlanError as e:
        raise ConfigError(str(e)) from None


def model_spec(mc: ModelConfig):
    """The planner's description of a runtime Llama."""
    from tetrad.plan.models import get_model

    return get_model(
        f"dim={mc.dim},n_layers={mc.n_layers},n_heads={mc.n_heads},"
        f"n_kv_heads={mc.n_kv_heads},ffn_dim={mc.ffn_dim},"
        f"vocab_size={mc.vocab_size}"
    )


def choose_grid(
    cfg: TrainConfig, world_size: int, vocab_size: int, verbose: bool = True
) -> TrainConfig:
    """Return ``cfg`` with the grid the planner ranks first for ``world_size`` ranks.

    The micro-batch, activation checkpointing and overlaps stay as configured; the planner ranks
    every 4D grid of ``world_size`` that shards the model, splits the batch and fits in 80% of
    the machine's memory by predicted step time.

    Raises:
        ConfigError: no machine, or no grid fits (the message says what to change).
    """
    from tetrad.plan.models import PlanError
    from tetrad.plan.search import plan

    machine = machine_for(cfg)
    mc = cfg.model_config(vocab_size)
    try:
        res = plan(
            model_spec(mc),
            machine,
            world_size,
            cfg.global_batch,
            cfg.seq_len,
            top=3,
            micro_batches=(cfg.micro_batch,),
            checkpointing=(cfg.activation_checkpointing,),
            overlaps=cfg.overlap,
            classic=False,
            dtype="bf16" if cfg.device == "cuda" else "fp32",
        )
    except PlanError as e:
        raise ConfigError(
            f"--grid auto found no grid of {world_size} ranks for this model, "
            f"global_batch={cfg.global_batch} and micro_batch={cfg.micro_batch} "
            f"(planner: {e})"
        ) from None
    if not res.rows:
        raise ConfigError(
            f"--grid auto: no grid of {world_size} ranks shards this model, "
            f"splits global_batch={cfg.global_batch} into micro-batches of "
            f"{cfg.micro_batch} and fits in 80% of {machine.name}'s memory: "
            "change --nproc, the batch or the model"
        )
    best = res.rows[0]
    if verbose:
        exposed = ", ".join(f"{a} {t * 1e3:.1f} ms" for a, t in best.exposed_s.items() if t)
        others = "; ".join(f"{r.label()} {r.step_s * 1e3:.1f} ms" for r in res.rows[1:])
        print(
            f"tetrad: --grid auto on {machine.name} with {world_size} ranks chose "
            f"{best.label()}: predicted step {best.step_s * 1e3:.1f} ms (compute "
            f"{best.compute_s * 1e3:.1f} ms, exposed communication {exposed or 'none'}), "
            f"memory {best.memory.total / GiB:.2f} GiB "
            f"({100 * best.memory.fraction:.0f}% of the GPU)"
            + (f"; next: {others}" if others else ""),
            flush=True,
        )
    return dataclasses.replace(cfg, grid=tuple(best.grid))


def domino_pays(cfg: TrainConfig, mc: ModelConfig) -> bool:
    """Whether the planner predicts a shorter step with the Domino split than without, for
    this run's grid, batch and ``--machine`` (True when no machine is given: the runtime's
    row threshold alone then decides)."""
    if not cfg.machine:
        return True
    from tetrad.plan.comm import Context, estimate

    machine = machine_for(cfg)
    spec = model_spec(mc)
    times = []
    for overlaps in (cfg.overlap, ",".join(sorted(_names(cfg.overlap) - {"domino"})) or "none"):
        ctx = Context(
            spec,
            machine,
            cfg.seq_len,
            cfg.global_batch,
            overlaps=overlaps,
            compute_bytes=2 if cfg.device == "cuda" else 4,
            domino_min_rows=cfg.domino_min_rows,
        )
        times.append(estimate(ctx, cfg.grid, cfg.micro_batch, cfg.activation_checkpointing).step_s)
    return times[0] < times[1]


def _names(text: str) -> set[str]:
    return set(parse_overlaps(text))


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"
