"""The planner's communication model against every collective the runtime really issues.

Every collective of the runtime goes through :mod:`tetrad.comm.collectives`, which counts it per
mesh axis in ``grid.comm`` (calls, payload bytes, ring bytes sent per rank). On gloo ranks (CPU,
fp32) each rank trains a small Llama for two optimizer steps on several grids (every axis > 1 in
at least one grid, several axes > 1 at once) and, over each world size's grids, every
combination of

- 1 or 2 micro-batches per step (gradient accumulation),
- activation checkpointing off and on (``none``, ``full``), and ``selective`` with 1 micro-batch
  and all overlaps, 2 and none,
- overlaps ``all`` and ``none`` (small data-parallel buckets and a low Domino threshold, so that
  several buckets and both Domino halves really run on these tiny shapes).

Each grid runs one of two halves of these combinations (:func:`grid_configs`), the halves
alternating along the grids: one without checkpointing (and full checkpointing with every
overlap but ``fine``), one with full and selective checkpointing, each half with and without
overlaps. Every combination still runs on every world size, in half the steps.

Two grids also run turned (orientation ``yx``: the X dimension plays the Y role of the layer
pairs), where both sides name the ``--grid``'s axes.

The first step records the prefetch order of the overlap schedule (on its first micro-batch,
whatever the step's micro-batch count) and lays out the data-parallel buckets; the configs that
differ only in micro-batches share one model and that warm-up step, and the record is reset
before each config's counted step and read after it. For every rank, per axis, the counted
calls, payload bytes and ring bytes must equal :func:`tetrad.plan.comm.listing.axis_totals` of
:func:`tetrad.plan.step_time.collectives` exactly (fp32 compute dtype, the runtime's overlap
options), and the set of axes must be the same on both sides: the planner predicts no collective
on an axis the runtime left silent, and the runtime uses no axis the planner missed.
"""

import json

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.plan.comm.listing import axis_totals
from tetrad.plan.machine.description import get_machine
from tetrad.plan.step_time import collectives
from tetrad.spec.grid import parse_grid
from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import OVERLAPS
from tetrad.spec.precision import DTYPE_BYTES
from tetrad.spec.presets import get_model
from tetrad.train.step import build_optimizer, train_step

CFG = ModelSpec(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
SPEC = (
    f"dim={CFG.dim},n_layers={CFG.n_layers},n_heads={CFG.n_heads},"
    f"n_kv_heads={CFG.n_kv_heads},ffn_dim={CFG.ffn_dim},vocab_size={CFG.vocab_size}"
)
SEQ, SAMPLES, SEED, LR, CLIP = 16, 2, 5, 1e-3, 1.0  # SAMPLES per (data, z) cell per step
OPTIONS = {"bucket_bytes": 1 << 14, "domino_min_rows": 8, "context_pieces": 4}
# ((G_data, G_z, G_y, G_x) or (G_data, G_context, G_z, G_y, G_x), orientation); one spawn per
# world size. Under yx the X dimension plays the Y role: both sides name the --grid's axes.
GRIDS = {
    4: [((2, 1, 1, 2), "xy"), ((1, 2, 1, 1, 2), "xy"), ((2, 1, 1, 2), "yx")],
    8: [
        ((1, 2, 2, 2), "xy"),
        ((2, 2, 2, 1), "xy"),
        ((1, 2, 2, 2, 1), "xy"),
        ((2, 4, 1, 1, 1), "xy"),
        ((1, 2, 2, 2), "yx"),
    ],
}
# (micro-batches per step, activation checkpointing, overlaps), in two halves (grid_configs)
HALVES = (
    [(n, False, ov) for n in (1, 2) for ov in ("all", "none")]
    + [(1, True, "all but fine"), (2, False, "all but fine")],
    [(n, True, ov) for n in (1, 2) for ov in ("all", "none")]
    + [(1, "selective", "all"), (2, "selective", "none")],
)
CONFIGS = HALVES[0] + HALVES[1]


def grid_configs(world_size: int) -> list[list[tuple]]:
    """The configs each grid of ``GRIDS[world_size]`` runs: the halves of :data:`HALVES` in
    turn, the 4-rank grids starting with the second (so each turned grid, the last of its
    world size, runs a different half)."""
    return [HALVES[(j + (world_size == 4)) % 2] for j in range(len(GRIDS[world_size]))]


OVERLAP_SETS = {
    "all": OVERLAPS,  # a list naming fine: always on, in the runtime and the planner
    "all but fine": tuple(o for o in OVERLAPS if o != "fine"),
    "none": (),
}
FIELDS = ("calls", "payload_bytes", "bytes")


def _key(sizes, orientation, n_micro, ckpt, overlaps) -> str:
    return (
        f"grid={sizes} {orientation} micro_batches={n_micro} checkpointing={ckpt} "
        f"overlaps={overlaps}"
    )


def _worker(world_size: int, out_dir: str, grids=None, configs=None, shard=False, sp=False) -> None:
    """Per grid, one model per (checkpointing, overlaps): a warm-up step, then one counted
    step per micro-batch count of the configs; this rank's counts to JSON (``shard``: with the
    sharded optimizer; ``sp``: with sequence parallelism, ``"regather"``: with
    ``sequence_parallel_regather``)."""
    rank = dist.get_rank()
    got = {}
    grids = grids or GRIDS[world_size]
    per_grid = grid_configs(world_size) if configs is None else [configs] * len(grids)
    for (sizes, orientation), grid_cfgs in zip(grids, per_grid, strict=True):
        grid = Grid.build(sizes, "cpu", orientation)
        g = torch.Generator().manual_seed(SEED)
        batch = torch.randint(
            0, CFG.vocab_size, (SAMPLES * grid.batch_shards, SEQ + 1), generator=g
        )
        # One model per (checkpointing, overlaps), warmed up by one step; each of its configs'
        # micro-batch counts then counts one step of its own.
        models: dict[tuple, list[int]] = {}
        for n_micro, ckpt, ov in grid_cfgs:
            models.setdefault((ckpt, ov), []).append(n_micro)
        for (ckpt, ov), n_micros in models.items():
            model = ParallelLlama(
                CFG,
                grid,
                ckpt,
                OVERLAP_SETS[ov],
                sequence_parallel=bool(sp),
                sequence_parallel_regather=sp == "regather",
                **OPTIONS,
            )
            init_parameters(model, SEED, grid)
            opt = build_optimizer(model, LR, weight_decay=0.1, shard=grid if shard else None)
            train_step(model, opt, grid, batch, SAMPLES // n_micros[0], CLIP)
            for n_micro in n_micros:
                grid.comm.reset()
                train_step(model, opt, grid, batch, SAMPLES // n_micro, CLIP)
                stats = grid.comm.reset()
                got[_key(sizes, orientation, n_micro, ckpt, ov)] = {
                    axis: [s.calls, s.payload_bytes, s.bytes] for axis, s in stats.items()
                }
    with open(f"{out_dir}/{rank}.json", "w") as fh:
        json.dump(got, fh)


def predicted(
    sizes,
    orientation: str,
    n_micro: int,
    ckpt: bool,
    overlaps: str,
    shard: bool = False,
    sp: bool | str = False,
    fp8: str = "off",
) -> dict:
    """The planner's per-axis calls, payload bytes and ring bytes of one optimizer step (with
    FP8 on a machine that has it; the counts do not depend on the machine)."""
    cells = sizes[0] * sizes[-3]  # G_data G_z
    cols = collectives(
        get_model(SPEC),
        get_machine("perlmutter" if fp8 == "off" else "dgx-h100"),
        sizes,
        SAMPLES // n_micro,
        SEQ,
        SAMPLES * cells,
        activation_checkpointing=ckpt,
        overlaps=OVERLAP_SETS[overlaps],
        compute_bytes=DTYPE_BYTES["fp32"],
        orientation=orientation,
        shard_optimizer=shard,
        sequence_parallel=sp,
        fp8=fp8,
        **OPTIONS,
    )
    return {axis: [t[f] for f in FIELDS] for axis, t in axis_totals(cols).items()}


@pytest.mark.parametrize("world_size", sorted(GRIDS))
def test_comm_model_predicts_runtime_collectives(world_size, tmp_path):
    run_distributed(_worker, world_size, world_size, str(tmp_path))
    _compare(world_size, tmp_path, GRIDS[world_size], None, False)


SHARDED_GRIDS = {
    4: [((4, 1, 1, 1), "xy"), ((2, 1, 1, 2), "xy"), ((1, 2, 1, 1, 2), "xy")],
    8: [((2, 2, 2, 1), "xy"), ((2, 4, 1, 1, 1), "xy"), ((2, 1, 2, 2), "yx")],
}
SHARDED_CONFIGS = [(1, False, "all"), (2, False, "all"), (2, True, "none")]


@pytest.mark.parametrize("world_size", sorted(SHARDED_GRIDS))
def test_comm_model_predicts_sharded_optimizer_collectives(world_size, tmp_path):
    """With the sharded optimizer (ZeRO-1): the data reduce-scatters and all-gathers, the
    norm over the world, on data, data x context, context, data x Z, data x X and turned
    grids, with and without the bucketed overlap."""
    grids, configs = SHARDED_GRIDS[world_size], SHARDED_CONFIGS
    run_distributed(_worker, world_size, world_size, str(tmp_path), grids, configs, True)
    _compare(world_size, tmp_path, grids, configs, True)


SEQUENCE_PARALLEL_GRIDS = [
    ((2, 1, 2, 1), "xy"),
    ((1, 2, 1, 2), "yx"),
    ((1, 2, 1, 2, 1), "xy"),
    ((1, 1, 2, 2), "yx"),
]
SEQUENCE_PARALLEL_CONFIGS = [(2, False, "all"), (1, True, "none"), (1, "selective", "all")]
# the first Linears' inputs gathered again in backward: once more per recomputed block under full
REGATHER_GRIDS, REGATHER_CONFIGS = [((2, 1, 2, 1), "xy")], SEQUENCE_PARALLEL_CONFIGS[:2]


def _sequence_parallel_worker(world_size: int, out_dir: str) -> None:
    for shard in (False, True):
        grids = SEQUENCE_PARALLEL_GRIDS if not shard else SEQUENCE_PARALLEL_GRIDS[:1]
        configs = SEQUENCE_PARALLEL_CONFIGS if not shard else SHARDED_CONFIGS[:2]
        _worker(world_size, f"{out_dir}/{shard}", grids, configs, shard, True)
    _worker(world_size, f"{out_dir}/regather", REGATHER_GRIDS, REGATHER_CONFIGS, False, "regather")


def test_comm_model_predicts_sequence_parallel_collectives(tmp_path):
    """With sequence parallelism (data x Y, Z x X turned, context x Y, and Y x X turned: the
    stream split over both), under full and selective recompute, each overlap set, and with the
    sharded optimizer on data x Y: the all-gathers and reduce-scatters along the sequence over
    Y and the norm weights' gradient sum over Y, call for call and byte for byte."""
    for name in ("False", "True", "regather"):
        (tmp_path / name).mkdir()
    run_distributed(_sequence_parallel_worker, 4, 4, str(tmp_path))
    for shard in (False, True):
        grids = SEQUENCE_PARALLEL_GRIDS if not shard else SEQUENCE_PARALLEL_GRIDS[:1]
        configs = SEQUENCE_PARALLEL_CONFIGS if not shard else SHARDED_CONFIGS[:2]
        _compare(4, tmp_path / str(shard), grids, configs, shard, True)
    _compare(4, tmp_path / "regather", REGATHER_GRIDS, REGATHER_CONFIGS, False, "regather")


def _compare(
    world_size: int, tmp_path, grids, configs, shard: bool, sp: bool | str = False
) -> None:
    """Each rank's counts against the planner's; ``configs``: those of every grid, or None
    for :func:`grid_configs`."""
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world_size)]
    per_grid = grid_configs(world_size) if configs is None else [configs] * len(grids)
    for (sizes, orientation), grid_cfgs in zip(grids, per_grid, strict=True):
        for n_micro, ckpt, ov in grid_cfgs:
            key = _key(sizes, orientation, n_micro, ckpt, ov)
            want = predicted(sizes, orientation, n_micro, ckpt, ov, shard, sp)
            for rank, got in enumerate(ranks):
                got = got[key]
                if rank == 0:
                    print(key, {a: got[a] for a in sorted(got)})
                assert set(got) == set(want), (
                    f"{key} rank {rank}: runtime axes {sorted(got)}, planner axes {sorted(want)}"
                )
                for axis in sorted(got):
                    for field, g, w in zip(FIELDS, got[axis], want[axis], strict=True):
                        assert g == w, (
                            f"{key} rank {rank} axis {axis} {field}: runtime {g}, "
                            f"planner {w} (runtime {got[axis]}, planner {want[axis]})"
                        )


def test_every_config_runs_on_each_world_size_and_every_grid_with_and_without_overlaps():
    for size in GRIDS:
        per_grid = grid_configs(size)
        assert {c for cfgs in per_grid for c in cfgs} == set(CONFIGS), size
        assert all({ov for _, _, ov in cfgs} >= {"all", "none"} for cfgs in per_grid), size


def test_grids_cover_every_axis():
    axes = {
        a
        for grids in GRIDS.values()
        for sizes, _ in grids
        for a, size in zip(("data", "context", "z", "y", "x"), parse_grid(sizes), strict=True)
        if size > 1
    }
    assert axes == {"data", "context", "z", "y", "x"}


def _bf16_worker(out_dir: str) -> None:
    """Two steps on ``G_z = 2`` under CPU bf16 autocast; this rank's counts of the second."""
    grid = Grid.build((1, 2, 1, 1), "cpu")
    batch = torch.randint(0, CFG.vocab_size, (SAMPLES * grid.batch_shards, SEQ + 1))
    model = ParallelLlama(CFG, grid, False, OVERLAPS, **OPTIONS)
    init_parameters(model, SEED, grid)
    opt = build_optimizer(model, LR, weight_decay=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train_step(model, opt, grid, batch, SAMPLES // 2, CLIP)
        grid.comm.reset()
        train_step(model, opt, grid, batch, SAMPLES // 2, CLIP)
    stats = grid.comm.reset()
    counts = {axis: [s.calls, s.payload_bytes, s.bytes] for axis, s in stats.items()}
    with open(f"{out_dir}/{dist.get_rank()}.json", "w") as fh:
        json.dump(counts, fh)


def test_comm_model_predicts_bf16_z_collectives(tmp_path):
    """Under bf16 autocast every Z all-gather (the Linears' weights and the embedding table)
    carries bf16 and every gradient reduce-scatter fp32, as the planner's ``bf16`` model says."""
    run_distributed(_bf16_worker, 2, str(tmp_path))
    sizes = (1, 2, 1, 1)
    cols = collectives(
        get_model(SPEC),
        get_machine("perlmutter"),
        sizes,
        SAMPLES // 2,
        SEQ,
        SAMPLES * 2,
        activation_checkpointing=False,
        overlaps=OVERLAPS,
        compute_bytes=DTYPE_BYTES["bf16"],
        **OPTIONS,
    )
    want = {axis: [t[f] for f in FIELDS] for axis, t in axis_totals(cols).items()}
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got == want, f"rank {rank}: runtime {got}, planner {want}"


def _bf16_weights_worker(out_dir: str) -> None:
    """Two steps on ``G_data = 2`` with bf16 weights, fp32 masters and the sharded optimizer
    (``--param-dtype bf16 --shard-optimizer``), with and without the overlaps; this rank's
    counts of each second step."""
    from tetrad.spec.precision import precision

    grid = Grid.build((2, 1, 1, 1), "cpu")
    batch = torch.randint(0, CFG.vocab_size, (SAMPLES * grid.batch_shards, SEQ + 1))
    counts = {}
    for ov in ("all", "none"):
        model = ParallelLlama(CFG, grid, False, OVERLAP_SETS[ov], **OPTIONS)
        init_parameters(model, SEED, grid)
        policy = precision("cpu", "bf16")
        opt = build_optimizer(model, LR, weight_decay=0.1, shard=grid, policy=policy)
        train_step(model, opt, grid, batch, SAMPLES // 2, CLIP)
        grid.comm.reset()
        train_step(model, opt, grid, batch, SAMPLES // 2, CLIP)
        stats = grid.comm.reset()
        counts[ov] = {axis: [s.calls, s.payload_bytes, s.bytes] for axis, s in stats.items()}
    with open(f"{out_dir}/{dist.get_rank()}.json", "w") as fh:
        json.dump(counts, fh)


def test_comm_model_predicts_bf16_weights_collectives(tmp_path):
    """With bf16 weights (``--param-dtype bf16``) and the sharded optimizer the gradients are
    still reduce-scattered in fp32 and the parameters all-gathered after the update in bf16,
    half the bytes, as the planner's ``param_bytes=2`` says."""
    run_distributed(_bf16_weights_worker, 2, str(tmp_path))
    for ov in ("all", "none"):
        cols = collectives(
            get_model(SPEC),
            get_machine("perlmutter"),
            (2, 1, 1, 1),
            SAMPLES // 2,
            SEQ,
            SAMPLES * 2,
            activation_checkpointing=False,
            overlaps=OVERLAP_SETS[ov],
            compute_bytes=DTYPE_BYTES["bf16"],
            shard_optimizer=True,
            param_bytes=DTYPE_BYTES["bf16"],
            **OPTIONS,
        )
        want = {axis: [t[f] for f in FIELDS] for axis, t in axis_totals(cols).items()}
        for rank in range(2):
            got = json.loads((tmp_path / f"{rank}.json").read_text())[ov]
            assert got == want, f"{ov} rank {rank}: runtime {got}, planner {want}"


def _bf16_stream_worker(out_dir: str) -> None:
    """Two steps on ``G_y = 2`` with bf16 weights and the bf16 residual stream of their policy
    (``--param-dtype bf16``, ``--residual-dtype auto``), without and with sequence parallelism;
    this rank's counts of each second step."""
    from tetrad.spec.precision import precision

    grid = Grid.build((1, 1, 2, 1), "cpu")
    batch = torch.randint(0, CFG.vocab_size, (SAMPLES * grid.batch_shards, SEQ + 1))
    counts = {}
    for sp in (False, True):
        model = ParallelLlama(CFG, grid, False, OVERLAPS, sequence_parallel=sp, **OPTIONS)
        init_parameters(model, SEED, grid)
        opt = build_optimizer(model, LR, weight_decay=0.1, policy=precision("cpu", "bf16"))
        train_step(model, opt, grid, batch, SAMPLES // 2, CLIP)
        grid.comm.reset()
        train_step(model, opt, grid, batch, SAMPLES // 2, CLIP)
        stats = grid.comm.reset()
        counts[str(sp)] = {axis: [s.calls, s.payload_bytes, s.bytes] for axis, s in stats.items()}
    with open(f"{out_dir}/{dist.get_rank()}.json", "w") as fh:
        json.dump(counts, fh)


def test_comm_model_predicts_bf16_stream_collectives(tmp_path):
    """With the residual stream in bf16 the embedding's sum over Y (an all-reduce, or under
    sequence parallelism a reduce-scatter and its gradient's all-gather) carries bf16 rows, as
    the planner's ``compute_bytes=2`` says, and every other collective is as modelled."""
    run_distributed(_bf16_stream_worker, 2, str(tmp_path))
    for sp in (False, True):
        cols = collectives(
            get_model(SPEC),
            get_machine("perlmutter"),
            (1, 1, 2, 1),
            SAMPLES // 2,
            SEQ,
            SAMPLES,
            activation_checkpointing=False,
            overlaps=OVERLAPS,
            compute_bytes=DTYPE_BYTES["bf16"],
            param_bytes=DTYPE_BYTES["bf16"],
            sequence_parallel=sp,
            **OPTIONS,
        )
        want = {axis: [t[f] for f in FIELDS] for axis, t in axis_totals(cols).items()}
        for rank in range(2):
            got = json.loads((tmp_path / f"{rank}.json").read_text())[str(sp)]
            assert got == want, f"sp {sp} rank {rank}: runtime {got}, planner {want}"


FP8_GRIDS = [((1, 2, 2, 1), "xy"), ((1, 1, 2, 2), "yx"), ((2, 2, 1, 1, 1), "xy")]
"""FP8 grids: Z x Y, Y x X turned, data x context x Z."""


def _fp8_worker(out_dir: str, recipe: str) -> None:
    """Per FP8 grid and (micro-batches, checkpointing, overlaps) of :data:`FP8_CONFIGS`, this
    rank's counts of the second step under ``--fp8 recipe``."""
    from tetrad.spec.precision import precision

    got = {}
    for sizes, orientation in FP8_GRIDS:
        grid = Grid.build(sizes, "cpu", orientation)
        batch = torch.randint(0, CFG.vocab_size, (SAMPLES * grid.batch_shards, SEQ + 1))
        for n_micro, ckpt, ov in FP8_CONFIGS:
            model = ParallelLlama(CFG, grid, ckpt, OVERLAP_SETS[ov], **OPTIONS)
            init_parameters(model, SEED, grid)
            policy = precision("cpu", fp8=recipe)
            opt = build_optimizer(model, LR, weight_decay=0.1, policy=policy)
            train_step(model, opt, grid, batch, SAMPLES // n_micro, CLIP)
            grid.comm.reset()
            train_step(model, opt, grid, batch, SAMPLES // n_micro, CLIP)
            stats = grid.comm.reset()
            key = _key(sizes, orientation, n_micro, ckpt, ov)
            got[key] = {axis: [s.calls, s.payload_bytes, s.bytes] for axis, s in stats.items()}
    with open(f"{out_dir}/{dist.get_rank()}.json", "w") as fh:
        json.dump(got, fh)


FP8_CONFIGS = [(2, False, "all but fine"), (1, True, "all but fine"), (2, False, "none")]
"""(micro-batches, full checkpointing, overlaps): ``fine`` fuses nothing under FP8."""


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_comm_model_predicts_fp8_collectives(tmp_path, recipe):
    """``--fp8``: the amax all-reduces of ``tensorwise`` (weights over Z and the tensor axes at
    every gather, activations over their feature axis and context), its Z all-gathers of FP8
    bytes (1 per element, a quarter of fp32's), and every FP8 Linear's GEMM whole before its
    all-reduce (no Domino halves): the runtime's calls and bytes per axis equal the planner's
    (``rowwise``: the tiny model's Linears are below its size filter, so the counts are the
    compute dtype's, as the planner's)."""
    pytest.importorskip("torchao.float8")
    run_distributed(_fp8_worker, 4, str(tmp_path), recipe)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for sizes, orientation in FP8_GRIDS:
        for n_micro, ckpt, ov in FP8_CONFIGS:
            key = _key(sizes, orientation, n_micro, ckpt, ov)
            want = predicted(sizes, orientation, n_micro, ckpt, ov, fp8=recipe)
            for rank, got in enumerate(ranks):
                assert got[key] == want, f"{key} rank {rank}: runtime {got[key]}, planner {want}"
