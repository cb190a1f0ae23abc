"""The planner inside ``tetrad train``: ``--grid auto``, and whether the Domino split and the
fine-grained fusion (``fine``) pay.

Both ask :mod:`tetrad.plan` (the analytical model of communication, compute and memory; see
docs/planner.md) about this run's model, batch and machine.
"""

from __future__ import annotations

import dataclasses
import os

from tetrad.spec.activation_checkpointing import CHECKPOINTING, recompute_order
from tetrad.spec.errors import TetradError
from tetrad.spec.grid import parse_grid
from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import FINE_CHUNKS
from tetrad.spec.precision import DTYPE_BYTES
from tetrad.spec.units import GiB
from tetrad.train.config import ConfigError, TrainConfig

# Machine presets that match a CUDA device name, for --grid auto without --machine.
GPU_MACHINES = {"H200": "h200-node", "H100": "dgx-h100", "A100": "dgx-a100-80gb"}


def default_nproc(cfg: TrainConfig) -> int:
    """Processes for ``--grid auto`` outside torchrun: ``--nproc``, else every visible GPU
    (CUDA), else 4 (CPU)."""
    if cfg.parallelism.nproc:
        return cfg.parallelism.nproc
    if cfg.training.device == "cuda":
        from tetrad.device import gpu_count

        return max(1, gpu_count())
    return 4


def machine_for(cfg: TrainConfig):
    """The planner's :class:`~tetrad.plan.machine.description.Machine` for this run: ``--machine``
    (a
    preset or the TOML file ``tetrad calibrate`` wrote), else a preset matching the CUDA device.

    Raises:
        ConfigError: no machine given and none can be inferred, or the machine is unknown.
    """
    from tetrad.plan.errors import PlanError
    from tetrad.plan.machine.description import get_machine

    name = cfg.parallelism.machine
    if not name and cfg.training.device == "cuda":
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


def calibrated_peak(cfg: TrainConfig) -> float | None:
    """The peak FLOP/s measured into the machine file ``--machine FILE`` names (``tetrad
    calibrate`` writes it); None without ``--machine`` or for a preset.

    Raises:
        ConfigError: an unreadable machine file.
    """
    from tetrad.plan.machine.description import preset_names

    name = cfg.parallelism.machine
    if not name or name in preset_names():
        return None
    return machine_for(cfg).peak_flops


def choose_grid(
    cfg: TrainConfig, world_size: int, vocab_size: int, verbose: bool = True
) -> TrainConfig:
    """Return ``cfg`` with the grid the planner ranks first for ``world_size`` ranks.

    The planner ranks every grid of ``world_size`` (data, context, Z, Y, X, and pipelines of
    ``G_pipe`` ranks with their schedule and virtual stages on top) that shards the model,
    splits the batch and fits in 80% of the machine's memory by predicted step time; the
    returned config carries the winner's ``pipe``, schedule and virtual stages (and a
    mixture-of-experts model's expert axis, :mod:`tetrad.plan.search.moe`).
    Activation checkpointing ``auto`` is chosen with the grid among ``none``, ``selective`` (on
    the fewest blocks that fit: ``selective:K``) and ``full`` (the returned config names the
    winner's mode); a named mode, the micro-batch and the overlaps stay as configured.

    Raises:
        ConfigError: no machine, or no grid fits (the message says what to change).
    """
    from tetrad.plan.search.plan import plan

    machine = machine_for(cfg)
    t, par = cfg.training, cfg.parallelism
    batch = f"global_batch={t.global_batch} and micro_batch={t.micro_batch}"
    mode = par.activation_checkpointing
    modes = CHECKPOINTING if mode == "auto" else (mode,)
    hint = {
        "full": "",
        "auto": "",
        "selective": ", or use --activation-checkpointing full",
    }.get(
        mode.partition(":")[0], ", or use --activation-checkpointing selective (or full, or auto)"
    )
    try:
        res = plan(
            cfg.model_config(vocab_size),
            machine,
            world_size,
            t.global_batch,
            t.seq_len,
            top=3,
            micro_batches=(t.micro_batch,),
            checkpointing=modes,
            overlaps=par.overlap,
            classic=False,
            dtype=cfg.policy.compute,
            shard_optimizer="on" if par.shard_optimizer else "auto",
            params=cfg.policy.params,
            residual=cfg.policy.residual,
            # --sequence-parallel with grid auto: on the chosen grid where it runs and pays
            sequence_parallel="auto" if par.sequence_parallel else "off",
            regather=par.sequence_parallel and par.sequence_parallel_regather,
            fp8=cfg.policy.fp8,
        )
    except TetradError as e:  # the planner's PlanError, or a grid or model the rules refuse
        raise ConfigError(
            f"--grid auto found no grid of {world_size} ranks for this model, {batch} "
            f"(planner: {e}){hint}"
        ) from None
    if not res.rows:
        raise ConfigError(
            f"--grid auto: no grid of {world_size} ranks shards this model, "
            f"splits global_batch={t.global_batch} into micro-batches of "
            f"{t.micro_batch} and fits in 80% of {machine.name}'s memory: "
            "change --nproc, the batch or the model" + hint
        )
    # a tie (within 0.1%, as for a model too small to time) goes to the least recomputation
    best = min(
        (r for r in res.rows if r.step_s <= res.rows[0].step_s * 1.001),
        key=lambda r: recompute_order(r.activation_checkpointing),
    )
    if verbose:
        exposed = ", ".join(f"{a} {x * 1e3:.1f} ms" for a, x in best.exposed_s.items() if x)
        others = "; ".join(
            f"{r.label()} {r.activation_checkpointing} {r.step_s * 1e3:.1f} ms"
            for r in res.rows
            if r is not best
        )
        print(
            f"tetrad: --grid auto on {machine.name} with {world_size} ranks chose "
            f"{best.label()} (checkpointing {best.activation_checkpointing}): predicted step "
            f"{best.step_s * 1e3:.1f} ms (compute "
            f"{best.compute_s * 1e3:.1f} ms, exposed communication {exposed or 'none'}), "
            f"memory {best.memory.total / GiB:.2f} GiB "
            f"({100 * best.memory.fraction:.0f}% of the GPU)"
            + (f"; next: {others}" if others else ""),
            flush=True,
        )
    # the winner's mode is the named one unless it was auto
    par = dataclasses.replace(
        par,
        grid=parse_grid(best.grid),
        pipe=best.pipe,
        pipeline_schedule=best.schedule or par.pipeline_schedule,
        virtual_stages=best.virtual_stages,
        activation_checkpointing=best.activation_checkpointing,
        orientation=best.orientation,
        shard_optimizer=par.shard_optimizer or best.shard_optimizer,
        sequence_parallel=best.sequence_parallel,
        # asked with --sequence-parallel: kept where the planner chose it (and planned with it)
        sequence_parallel_regather=par.sequence_parallel_regather and best.sequence_parallel,
        expert_parallel=best.expert or par.expert_parallel,  # an MoE model's expert axis
    )
    return dataclasses.replace(cfg, parallelism=par)


def pipeline_split(cfg: TrainConfig, mc: ModelSpec) -> tuple[tuple[int, int], ...] | None:
    """The planner's stage split for this pipeline grid where a machine is known (``--machine``,
    or the preset of the CUDA device, as ``--grid auto`` finds it): blocks balanced by the
    planner's compute of a block, of the embedding and of the final norm, LM head and loss on
    this grid, micro-batch and checkpointing (:func:`tetrad.plan.pipe.pipeline_step.planner_split`),
    the split the planner's estimate and memory of this configuration take, so that ``--grid
    auto`` runs the split it ranked; ``(start, stop)`` blocks per stage. ``--pipeline-split``
    when given (:func:`tetrad.spec.pipeline_split.explicit_split`). None without a machine
    (the runtime's default: the embedding and the head count one block each).

    Raises:
        tetrad.spec.pipeline_split.PipelineSplitError: a ``--pipeline-split`` that does not
            fit the model's blocks and the grid's stages.
    """
    from tetrad.plan.pipe.pipeline_step import planner_split
    from tetrad.plan.pipe.stages import split_costs
    from tetrad.plan.question import StepQuestion
    from tetrad.spec.grid import role_sizes, with_context
    from tetrad.spec.pipeline_split import explicit_split

    par, t = cfg.parallelism, cfg.training
    if par.pipeline_split:
        return explicit_split(par.pipeline_split, mc.n_layers, par.pipe * par.virtual_stages)
    if not par.machine and t.device != "cuda":
        return None
    try:
        machine = machine_for(cfg)
    except ConfigError:
        return None
    ctx = StepQuestion(
        mc,
        machine,
        t.seq_len,
        t.global_batch,
        compute_bytes=DTYPE_BYTES[cfg.policy.compute],
        sequence_parallel=par.sequence_parallel,  # the norms' compute on the sequence shard
    )
    roles = role_sizes(with_context(par.grid), par.orientation)
    costs = split_costs(ctx.compute(roles, t.micro_batch), par.activation_checkpointing)
    return planner_split(mc.n_layers, costs, par.pipe, par.virtual_stages)


def _estimate(cfg: TrainConfig, mc: ModelSpec, overlaps, fine_chunks: int | None):
    """The step model's estimate of ``cfg``'s grid as the runtime runs it: formats, sequence
    parallelism (and its re-gather) and the sharded optimizer as configured."""
    from tetrad.plan.question import StepQuestion, sharded
    from tetrad.plan.search.memory_fits import sequence_parallel_memory
    from tetrad.plan.step_time import estimate

    t, par = cfg.training, cfg.parallelism
    ctx = StepQuestion(
        mc,
        machine_for(cfg),
        t.seq_len,
        t.global_batch,
        overlaps=overlaps,
        compute_bytes=DTYPE_BYTES[cfg.policy.compute],
        residual_bytes=DTYPE_BYTES[cfg.policy.residual],
        param_bytes=DTYPE_BYTES[cfg.policy.params],
        domino_min_rows=par.domino_min_rows,
        fine_chunks=fine_chunks,
        fp8=cfg.policy.fp8,
        sequence_parallel=sequence_parallel_memory(
            par.sequence_parallel, par.sequence_parallel_regather
        ),
    )
    if par.shard_optimizer:
        ctx = sharded(ctx)
    return estimate(
        ctx,
        par.grid,
        t.micro_batch,
        par.activation_checkpointing,
        orientation=par.orientation,
    )


def with_orientation(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``--orientation auto`` resolved (:data:`tetrad.spec.grid.ORIENTATIONS`): the
    orientation whose X and Y collectives send fewer bytes, or with ``--machine`` the one with
    the shorter predicted step (:func:`tetrad.plan.step_time.best_orientation`); ``xy``
    when ``G_x = G_y = 1``; with ``--sequence-parallel`` and one tensor axis, the one that gives
    it the Y role. Every rank computes the same answer.

    Raises:
        ConfigError: an unknown ``--machine``.
    """
    from tetrad.plan.machine.description import get_machine
    from tetrad.plan.question import StepQuestion
    from tetrad.plan.step_time import best_orientation

    par, t = cfg.parallelism, cfg.training
    if par.orientation != "auto" or par.grid == "auto":
        return cfg
    chosen = "xy"
    if par.sequence_parallel and (par.grid[3] == 1 or par.grid[4] == 1):
        chosen = "yx" if par.grid[4] > 1 else "xy"  # a lone tensor axis plays Y
    elif par.grid[3] > 1 or par.grid[4] > 1:
        machine = machine_for(cfg) if par.machine else get_machine("dgx-h100")  # bytes only
        # the tokenizer's vocabulary is not known before preflight; no X or Y collective
        # depends on it, so the BPE size stands in (every rank alike)
        ctx = StepQuestion(
            cfg.model_config(cfg.data.vocab_size),
            machine,
            t.seq_len,
            t.global_batch,
            overlaps=par.overlaps,
            compute_bytes=DTYPE_BYTES[cfg.policy.compute],
            residual_bytes=DTYPE_BYTES[cfg.policy.residual],
            domino_min_rows=par.domino_min_rows,
        )
        by = "time" if par.machine else "bytes"
        ckpt = par.activation_checkpointing
        chosen = best_orientation(ctx, par.grid, t.micro_batch, ckpt, by)
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(par, orientation=chosen))


def domino_pays(cfg: TrainConfig, mc: ModelSpec) -> bool:
    """Whether the planner predicts a shorter step with the Domino split than without, for
    this run's grid, batch and ``--machine`` (True when no machine is given: the runtime's
    row threshold alone then decides)."""
    par = cfg.parallelism
    if not par.machine:
        return True
    rest = par.overlaps - {"fine"}
    return (
        _estimate(cfg, mc, rest, None).step_s < _estimate(cfg, mc, rest - {"domino"}, None).step_s
    )


def fine_chunks(cfg: TrainConfig, mc: ModelSpec) -> int:
    """Pieces per ring step of the ``fine`` overlap for this run, 0 for off.

    Named in ``--overlap``: on, with ``--fine-chunks`` or the planner's best count on
    ``--machine`` (:data:`tetrad.spec.overlap.FINE_CHUNKS` without one). In ``all``: only where the
    planner predicts less exposed communication on ``--machine`` than without it
    (:attr:`tetrad.plan.step_time.Estimate.fine_chunks`), with its chunk count (or
    ``--fine-chunks``); off without a machine, and under ``--fp8`` (an FP8 GEMM runs whole:
    tetrad/parallel/fp8.py)."""
    par = cfg.parallelism
    if "fine" not in par.overlaps or cfg.policy.fp8 != "off":
        return 0
    named = "fine" in par.named_overlaps
    if not par.machine:
        return (par.fine_chunks or FINE_CHUNKS) if named else 0
    # a set naming fine forces it; "all" lets the planner leave it off (chunk count 0)
    overlaps = par.overlaps if named else "all"
    return _estimate(cfg, mc, overlaps, par.fine_chunks or None).fine_chunks


def context_pieces(cfg: TrainConfig, mc: ModelSpec) -> int:
    """The ``context_pieces`` option of the ``context`` overlap for this run (1: off, no
    context parallelism, or the blocking all-gather): ``--context-pieces`` if given, else the
    planner's best on ``--machine``
    (:attr:`tetrad.plan.step_time.Estimate.context_pieces`), else 1, as ``fine`` is off
    without a machine (on 2 CPU cores with gloo, 8 pieces made a context = 2 step slower:
    the transfers and the attention share the cores)."""
    from tetrad.spec.grid import with_context

    par = cfg.parallelism
    if "context" not in par.overlaps or with_context(par.grid)[1] == 1:
        return 1
    if par.context_pieces or not par.machine:
        return par.context_pieces or 1
    return _estimate(cfg, mc, par.overlaps, None).context_pieces


def is_rank0() -> bool:
    """True on rank 0 of a job, or outside one."""
    return os.environ.get("RANK", "0") == "0"
