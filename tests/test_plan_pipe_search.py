"""The pipeline search's speed-ups stay exact: the fast stage split is the runtime's, the memory
floors never exceed the memory, the group bounds never exceed the estimate."""

import dataclasses

import pytest

from tetrad.plan.machine.description import get_machine
from tetrad.plan.memory.activations import saved_activations
from tetrad.plan.memory.pipeline import in_flight_sets
from tetrad.plan.pipe.pipeline_step import pipeline_estimate
from tetrad.plan.pipe.schedule import in_flight_chunks
from tetrad.plan.pipe.uniform_split import exact_quarters, uniform_split
from tetrad.plan.question import StepQuestion, sharded
from tetrad.plan.search.four_d import Search4D
from tetrad.plan.search.pipeline.configs import schedules
from tetrad.plan.search.pipeline.memory_floors import warm_passes
from tetrad.spec.pipeline_split import balanced_split
from tetrad.spec.presets import get_model

EXTRAS = (0.0, 0.25, 0.5, 1.0, 2.75, 4.5)


@pytest.mark.parametrize("n", range(1, 19))
def test_uniform_split_is_balanced_split(n):
    for stages in range(1, n + 1):
        for e in EXTRAS:
            for h in EXTRAS:
                got = uniform_split(n, e, h, stages)
                assert got == balanced_split([1.0] * n, e, h, stages), (n, stages, e, h)


@pytest.mark.parametrize(("n", "stages"), [(42, 4), (42, 14), (42, 16), (80, 40), (126, 32)])
def test_uniform_split_is_balanced_split_on_model_depths(n, stages):
    for e, h in ((0.0, 0.5), (0.25, 0.75), (0.0, 2.75)):
        assert uniform_split(n, e, h, stages) == balanced_split([1.0] * n, e, h, stages)


def test_uniform_split_needs_exact_quarters():
    assert exact_quarters(0.0, 1.75) and not exact_quarters(0.1)
    with pytest.raises(ValueError):
        uniform_split(8, 0.1, 0.0, 2)
    with pytest.raises(ValueError):
        uniform_split(3, 0.0, 0.0, 4)


@pytest.mark.parametrize("pipe", [2, 3, 4, 8])
@pytest.mark.parametrize("virtual", [2, 3, 5, 8])
def test_warm_passes_are_a_peak_set_of_the_interleaved_order(pipe, virtual):
    """The memory floor's interleaved passes are one of the sets the memory model picks its
    peak from, with in_flight_chunks passes."""
    for m in (pipe, 2 * pipe, 3 * pipe, 8 * pipe, 32 * pipe):
        for r in range(pipe):
            c = warm_passes(pipe, r, virtual, m)
            assert c in in_flight_sets("interleaved-1f1b", pipe, r, virtual, m)
            assert sum(c) == in_flight_chunks("interleaved-1f1b", pipe, r, virtual, m)


def _search(model, machine, gpus, batch, seq_len=2048, modes=("none", "selective", "full")):
    ctx = StepQuestion(model, machine, seq_len, batch)
    search = Search4D(ctx, gpus, machine.memory_bytes, "tetrad", "bf16", "auto", modes)
    return search.pipeline_search()


def test_saved_activations_are_affine_in_the_blocks():
    """The memory floor extrapolates a stage's saved activations from one and two blocks."""
    model = get_model("llama-3-70b")
    for mode in ("none", "selective", "full"):
        for grid in ((1, 1, 1, 2, 4), (1, 4, 1, 8, 1)):
            at = [
                saved_activations(
                    dataclasses.replace(model, n_layers=k),
                    grid,
                    2,
                    8192,
                    activation_checkpointing=mode,
                )["blocks"]
                for k in (1, 2, 7, 40)
            ]
            for k, v in zip((1, 2, 7, 40), at, strict=True):
                assert at[0] + (k - 1) * (at[1] - at[0]) == pytest.approx(v, rel=1e-12)


@pytest.mark.parametrize(("name", "tied"), [("gpt-80b", False), ("llama-1b", True)])
def test_memory_floors_never_above_the_memory(name, tied):
    """Per schedule, per grid and per group: never above the worst rank's memory (tied
    embeddings included: a rank without the last stage drops the head)."""
    model = dataclasses.replace(get_model(name), tied_embeddings=tied)
    machine = get_machine("perlmutter")
    ps = _search(model, machine, 1024, 2048)
    limit, seen = ps.memory_floors.limit, 0
    for grid in ((8, 1, 1, 2, 4), (4, 1, 2, 2, 4), (2, 2, 2, 2, 4), (1, 1, 8, 1, 8)):
        q = grid[0] * grid[2]
        for b in (1, 2):
            for mode in ("none", "selective", "full"):
                for pipe in (2, 4, 8):
                    m = 2048 // (q * b)
                    for cfg in schedules(pipe, m, model.n_layers):
                        worst, _ = ps.memory(grid, "xy", b, mode, cfg)
                        # the floors with the limit at the memory itself: never above it
                        ps.memory_floors.limit = worst.total
                        assert not ps.memory_floors.schedule_fails(grid, "xy", b, mode, cfg)
                        assert not ps.memory_floors.grid_too_big(pipe, grid, b, mode)
                        gc, gy, gx = grid[1], grid[3], grid[4]
                        ps.memory_floors.gz_memo.clear()
                        assert grid[2] in ps.memory_floors.fitting_z(pipe, q, gc, gy, gx, b, mode)
                        ps.memory_floors.limit, seen = limit, seen + 1
    assert seen > 100


def test_group_bounds_never_above_the_estimate():
    """A grid of a group is kept below any limit above its fastest schedule that fits, with a
    bound not above it; the group's context bound is not above it either."""
    model, machine = get_model("gpt-80b"), get_machine("perlmutter")
    ps = _search(model, machine, 1024, 2048)
    seen = 0
    for grid in ((8, 1, 1, 2, 4), (4, 2, 2, 2, 2), (2, 4, 2, 1, 8), (1, 1, 8, 2, 4)):
        q, gc, gy, gx = grid[0] * grid[2], grid[1], grid[3], grid[4]
        for mode in ("none", "selective", "full"):
            for pipe in (2, 4, 8):
                steps = [
                    pipeline_estimate(ps.ctx, cfg, grid, 1, mode).step_s
                    for cfg in schedules(pipe, 2048 // q, model.n_layers)
                    if ps.memory(grid, "xy", 1, mode, cfg)[0].total <= ps.memory_floors.limit
                ]
                if not steps:
                    continue
                fastest, seen = min(steps), seen + 1
                kept = ps.group_bounds.grids(pipe, q, gc, gy, gx, 1, mode, fastest * 1.000001)
                bounds = [bound for bound, g, t in kept if (g, t) == (grid, "xy")]
                assert bounds and bounds[0] <= fastest
                kv = ps.terms.kv_floor(q, gc, gy, gx, 1, mode == "full") if gc > 1 else 0.0
                assert ps.group_bounds.group_bound(pipe, q, gc, gy, gx, 1, mode, kv) <= fastest
    assert seen > 10


@pytest.mark.parametrize("batch", [32, 256])
def test_schedule_floors_never_prune_the_estimate(batch):
    """Bound 3 (its rank floor, the block floor) and the rank floor plus the ranks' tails never
    prune a schedule below its estimate, with the optimizer sharded or not (GPipe included:
    ``m < p`` at the smaller batch)."""
    model, machine = get_model("gpt-80b"), get_machine("perlmutter")
    ps = _search(model, machine, 1024, batch)
    seen = set()
    for grid in ((8, 1, 1, 2, 4), (4, 2, 2, 2, 2), (1, 1, 8, 2, 4)):
        for b in (1, 2):
            m = batch // (grid[0] * grid[2] * b)
            for mode in ("none", "full"):
                for pipe in (2, 4, 8):
                    for cfg in schedules(pipe, m, model.n_layers):
                        for ctx in (ps.ctx, sharded(ps.ctx)):
                            step = pipeline_estimate(ctx, cfg, grid, b, mode).step_s
                            assert not ps.schedule_floors.tail_pruned(
                                ctx, grid, "xy", b, mode, cfg, m, step
                            )
                            seen.add(cfg.schedule)
                        step = pipeline_estimate(ps.ctx, cfg, grid, b, mode).step_s
                        assert (
                            ps.schedule_floors.config_floor(grid, "xy", b, mode, cfg, m)
                            * (1 - 1e-9)
                            < step
                        )
                        assert (
                            ps.schedule_floors.rank_floor(grid, "xy", b, mode, cfg, m) * (1 - 1e-9)
                            < step
                        )
    assert (
        seen == {"gpipe", "1f1b", "interleaved-1f1b"}
        if batch < 64
        else {"1f1b", "interleaved-1f1b"}
    )


def test_fits_is_the_worst_rank_within_the_limit():
    """The search's rank-by-rank memory check (it stops at the first rank above the limit,
    that rank first next time) keeps what pipeline_memory's worst rank says: the same worst
    rank where it fits, nothing where it does not; both orientations alike."""
    model, machine = get_model("gpt-80b"), get_machine("perlmutter")
    ps = _search(model, machine, 1024, 256)
    fit = {True: 0, False: 0}
    for grid in ((8, 1, 1, 2, 4), (4, 2, 2, 2, 2), (1, 1, 8, 2, 4), (2, 1, 4, 4, 2)):
        for b in (1, 2):
            m = 256 // (grid[0] * grid[2] * b)
            for mode in ("none", "selective", "full"):
                for pipe in (2, 4, 8):
                    for cfg in schedules(pipe, m, model.n_layers):
                        worst, _ = ps.memory(grid, "xy", b, mode, cfg)
                        fits = worst.total <= 0.8 * ps.mem_bytes
                        for turn, g in (("xy", grid), ("yx", (*grid[:3], grid[4], grid[3]))):
                            got = ps._worst_within(g, turn, b, mode, cfg, False)
                            assert (got is not None) == fits
                            if fits:
                                assert got.total == worst.total
                                assert got.peak_phase == worst.peak_phase
                        fit[fits] += 1
    assert fit[True] > 10 and fit[False] > 10


def test_group_bound_does_not_grow_with_the_micro_batch():
    """On a machine whose GEMM efficiency never falls with the FLOPs, a group's bound 2 does not
    grow with its micro-batch: the search enters a shape's groups as a chain in descending
    micro-batch, each group's bound the floor of the rest (PipeSearch._shape)."""
    model, machine = get_model("gpt-80b"), get_machine("perlmutter")
    ps = _search(model, machine, 1024, 2048)
    bounds, seen = ps.group_bounds, 0
    assert bounds.monotone()
    for gc, gy, gx in ((1, 2, 4), (2, 1, 8), (4, 4, 2), (1, 8, 8)):
        for mode in ("none", "selective", "full"):
            for pipe in bounds.pipes:
                q, sizes = bounds.micro_batches(pipe, gc, gy, gx, 0.0, float("inf"))
                got = [bounds.group(pipe, q, gc, gy, gx, b, mode)[0] for b in sizes]
                assert all(a >= b for a, b in zip(got, got[1:], strict=False)), (pipe, gc, gy)
                seen += len(got) > 1
    assert seen > 20
