"""The planner's pipeline axis (issue 32): bubble formulas, in-flight micro-batches, point-to-point
bytes, the runtime's stage split, pipe = 1 equal to the 5D estimates, the search's bounds and
rows, and the classic space's interleaving and uneven splits."""

import dataclasses

import pytest

from tetrad.plan.machine.description import get_machine
from tetrad.plan.memory.pipeline import pipeline_memory
from tetrad.plan.memory.runtime import runtime_memory
from tetrad.plan.pipe.pipeline_step import PipeConfig, pipeline_estimate, split_ranks
from tetrad.plan.pipe.schedule import (
    boundaries_of_rank,
    bubble_fraction,
    bubble_seconds,
    in_flight_chunks,
    p2p_bytes,
    schedule_problems,
)
from tetrad.plan.pipe.stage_times import stage_times
from tetrad.plan.pipe.stages import PipeRank, split_costs
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.classic import pipeline_variants, uneven_split
from tetrad.plan.search.four_d import Search4D, search_4d
from tetrad.plan.step_time import estimate
from tetrad.spec.presets import get_model


def test_bubble_formulas():
    # GPipe and 1F1B: (p-1)/m of the ideal step; interleaved: (p-1)/(v m) (arXiv 2104.04473)
    assert bubble_fraction("gpipe", 4, 1, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("1f1b", 8, 1, 32) == pytest.approx(7 / 32)
    assert bubble_fraction("interleaved-1f1b", 8, 4, 32) == pytest.approx(7 / 128)
    assert bubble_seconds("1f1b", 4, 1, 2.0) == pytest.approx(6.0)
    assert bubble_seconds("interleaved-1f1b", 4, 2, 2.0) == pytest.approx(3.0)
    assert bubble_seconds("1f1b", 1, 1, 2.0) == 0.0


def test_in_flight_counts():
    assert [in_flight_chunks("1f1b", 4, r, 1, 16) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight_chunks("1f1b", 4, r, 1, 2) for r in range(4)] == [2, 2, 2, 1]
    assert in_flight_chunks("gpipe", 4, 0, 1, 16) == 16
    # Megatron's num_warmup_microbatches + 1: 2 (p - r - 1) + (v - 1) p + 1, capped at m v
    assert [in_flight_chunks("interleaved-1f1b", 4, r, 2, 8) for r in range(4)] == [11, 9, 7, 5]
    assert in_flight_chunks("interleaved-1f1b", 4, 0, 2, 4) == 8


def test_schedule_constraints():
    assert not schedule_problems("1f1b", 4, 1, 4)
    assert schedule_problems("1f1b", 4, 1, 3)
    assert not schedule_problems("gpipe", 4, 1, 1)
    assert schedule_problems("interleaved-1f1b", 4, 1, 8)
    assert schedule_problems("interleaved-1f1b", 4, 2, 6)
    assert not schedule_problems("interleaved-1f1b", 4, 2, 8)
    assert schedule_problems("zb", 4, 1, 8)


def test_p2p_bytes_per_boundary():
    # [b, S / G_context, h / G_x] in bf16
    assert p2p_bytes(2, 4096, 8192, 2, 4, 2) == 2 * 2048 * 2048 * 2
    assert boundaries_of_rank(4, 0, 1) == (0, 1)
    assert boundaries_of_rank(4, 3, 1) == (1, 0)
    assert boundaries_of_rank(4, 1, 2) == (2, 2)
    # p v - 1 boundaries in all, each with one receive each way
    fwd = sum(boundaries_of_rank(4, r, 3)[0] for r in range(4))
    bwd = sum(boundaries_of_rank(4, r, 3)[1] for r in range(4))
    assert fwd == bwd == 4 * 3 - 1


@pytest.fixture(scope="module")
def ctx():
    return StepQuestion(get_model("llama-3-70b"), get_machine("dgx-h100"), 2048, 512)


@pytest.mark.parametrize("grid", [(8, 1, 1, 2, 4), (4, 2, 2, 2, 2), (2, 1, 4, 4, 2)])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_pipe_1_equals_the_5d_estimate(ctx, grid, mode):
    est = pipeline_estimate(ctx, PipeConfig(1), grid, 1, mode)
    ref = estimate(ctx, grid, 1, mode)
    assert est.step_s == pytest.approx(ref.step_s, rel=1e-12)
    assert est.compute_s == pytest.approx(ref.compute_s, rel=1e-12)
    assert est.bubble_s == 0.0 and est.exposed_s["pipe"] == 0.0


def test_pipe_1_memory_equals_the_5d_memory(ctx):
    model, mem = ctx.model, 80 * 2**30
    one = (PipeRank(0, model.n_layers, True, True, (model.n_layers,)),)
    for mode in ("none", "full"):
        worst, _ = pipeline_memory(
            model, (8, 1, 1, 2, 4), 1, 2048, mem, one, "1f1b", 1, 8, activation_checkpointing=mode
        )
        ref = runtime_memory(model, (8, 1, 1, 2, 4), 1, 2048, mem, activation_checkpointing=mode)
        assert worst.components == ref.components and worst.total == ref.total


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_parameters_add_up_to_the_model(tied):
    """The ranks' parameters sum to the whole model's, plus, when the head is tied to the
    embedding, the last stage's copy of the table (a middle rank holds neither)."""
    model = dataclasses.replace(get_model("llama-1b"), tied_embeddings=tied)
    grid, mem, L = (1, 1, 1, 1, 1), 80 * 2**30, model.n_layers
    ranks = tuple(PipeRank(r, L // 4, r == 0, r == 3, (L // 4,)) for r in range(4))
    _, per = pipeline_memory(model, grid, 1, 256, mem, ranks, "1f1b", 1, 4)
    whole = runtime_memory(model, grid, 1, 256, mem).components["parameters"]
    head = 4 * model.vocab_size * model.dim if tied else 0
    assert sum(m.components["parameters"] for m in per) == whole + head
    assert per[1].components["parameters"] == per[2].components["parameters"]


def test_stage_split_is_the_runtimes(ctx):
    ranks = split_ranks(80, split_costs(ctx.compute((8, 1, 1, 2, 4), 1), "none"), 8, 1)
    assert sum(r.blocks for r in ranks) == 80 and ranks[0].first and ranks[-1].last
    ranks = split_ranks(80, split_costs(ctx.compute((8, 1, 1, 2, 4), 1), "none"), 4, 5)
    assert all(len(r.chunk_blocks) == 5 for r in ranks)
    assert sum(r.blocks for r in ranks) == 80


def test_pipeline_memory_in_flight(ctx):
    """1F1B: the first ranks hold more micro-batches; GPipe holds all m; the stage's
    parameters are its blocks' (and the embedding / head on the ends)."""
    model, mem, grid = ctx.model, 80 * 2**30, (8, 1, 1, 2, 4)
    ranks = tuple(PipeRank(r, 20, r == 0, r == 3, (20,)) for r in range(4))
    _, one_f = pipeline_memory(model, grid, 1, 2048, mem, ranks, "1f1b", 1, 16)
    _, gpipe = pipeline_memory(model, grid, 1, 2048, mem, ranks, "gpipe", 1, 16)
    act = [m.phases["backward: blocks"] for m in one_f[1:3]]
    assert act[0] > act[1]
    assert all(g.total >= f.total for g, f in zip(gpipe, one_f, strict=True))
    full = runtime_memory(model, grid, 1, 2048, mem)
    assert one_f[1].components["parameters"] < full.components["parameters"] / 3


def test_pipeline_bubble_and_p2p_in_the_step(ctx):
    """The bubble is the critical path of the schedule on the stage times beyond the slowest
    rank's work: on the runtime's uneven split (a lighter first rank, the LM head on the last)
    below the even-rank (p - 1) t; interleaving shortens it."""
    grid = (8, 1, 1, 2, 4)
    one = pipeline_estimate(ctx, PipeConfig(4, 1, "1f1b"), grid, 1, "none")
    inter = pipeline_estimate(ctx, PipeConfig(4, 2, "interleaved-1f1b"), grid, 1, "none")
    t = one.ranks[one.slowest].per_micro_batch
    assert 0 < one.bubble_s <= 3 * t
    assert one.step_s >= one.grad_accum * t + one.bubble_s
    assert inter.bubble_s < one.bubble_s
    assert inter.exposed_s["pipe"] > one.exposed_s["pipe"] > 0
    # the residual stream, sent in the compute dtype (bf16)
    assert one.p2p_bytes_per_boundary == 1 * 2048 * (8192 // 4) * ctx.c


def test_stage_times_add_up_to_the_ranks(ctx):
    """Each rank's stage times add up to its T_r; each stage's compute is its blocks' (and the
    embedding's on stage 0): what the search's lead floor counts."""
    grid, comp = (8, 1, 1, 2, 4), ctx.compute((8, 1, 1, 2, 4), 1)
    for cfg in (PipeConfig(4, 1, "1f1b"), PipeConfig(4, 5, "interleaved-1f1b")):
        est = pipeline_estimate(ctx, cfg, grid, 1, "full")
        ranks = split_ranks(80, split_costs(comp, "full"), cfg.pipe, cfg.virtual)
        fwd, bwd = stage_times(comp, "full", ranks, est.ranks, cfg.pipe, cfg.virtual)
        costs = split_costs(comp, "full")
        for r, t in zip(ranks, est.ranks, strict=True):
            got = sum(fwd[s] + bwd[s] for s in range(r.rank, 4 * cfg.virtual, 4))
            assert got == pytest.approx(t.per_micro_batch, rel=1e-12)
        s0 = ranks[0].chunk_blocks[0] * costs[0] + costs[1]
        assert fwd[0] + bwd[0] >= s0 * (1 - 1e-12)


def test_search_bounds_never_above_the_estimate():
    model, machine = get_model("gpt-80b"), get_machine("perlmutter")
    ctx = StepQuestion(model, machine, 2048, 2048)
    search = Search4D(ctx, 1024, machine.memory_bytes, "tetrad", "bf16", "auto", ("none",))
    ps = search.pipeline_search()
    for grid in ((8, 1, 1, 2, 4), (4, 1, 2, 2, 4), (2, 2, 2, 2, 4)):
        for mode in ("none", "full"):
            for cfg in (PipeConfig(16, 1, "1f1b"), PipeConfig(8, 3, "interleaved-1f1b")):
                m = 2048 // (grid[0] * grid[2])
                est = pipeline_estimate(ctx, cfg, grid, 1, mode)
                assert ps.schedule_floors.config_floor(grid, "xy", 1, mode, cfg, m) <= est.step_s
                # the grid's bound, where its memory floor leaves it: never above the estimate
                q, gc, gy, gx = grid[0] * grid[2], grid[1], grid[3], grid[4]
                limit = est.step_s * (1 + 1e-6)
                kept = {
                    (g, t): bound
                    for bound, g, t in ps.group_bounds.grids(
                        cfg.pipe, q, gc, gy, gx, 1, mode, limit
                    )
                }
                fits = ps.memory(grid, "xy", 1, mode, cfg)[0].total <= ps.memory_floors.limit
                assert (grid, "xy") in kept or not fits
                assert kept.get((grid, "xy"), 0.0) <= est.step_s


def test_search_with_pipelines_keeps_the_5d_rows():
    """Rows without a pipeline are the 5D search's own, value for value."""
    model, machine = get_model("gpt-20b"), get_machine("perlmutter")
    plain, _ = search_4d(model, machine, 64, 128, 2048, top=20, pipeline=False)
    mixed, stats = search_4d(model, machine, 64, 128, 2048, top=20)
    assert stats["pipe_evaluated"] > 0
    by_key = {(r.grid, r.micro_batch, r.activation_checkpointing, r.orientation): r for r in plain}
    kept = [r for r in mixed if r.pipe == 1]
    for r in kept:
        ref = by_key[(r.grid, r.micro_batch, r.activation_checkpointing, r.orientation)]
        assert r.to_dict() == ref.to_dict()
    assert [r.step_s for r in kept] == [r.step_s for r in plain[: len(kept)]]
    assert mixed[0].step_s <= plain[0].step_s


def test_search_with_pipelines_matches_exhaustive():
    """The bounds prune nothing that belongs to the top-K: the search's best pipeline row
    equals the best of every pipeline configuration, timed."""
    model = dataclasses.replace(get_model("llama-1b"), n_layers=8)
    machine = get_machine("dgx-h100")
    rows, _ = search_4d(model, machine, 16, 32, 2048, top=3, checkpointing=("none",))
    ctx = StepQuestion(model, machine, 2048, 32)
    search = Search4D(ctx, 16, machine.memory_bytes, "tetrad", "bf16", "auto", ("none",))
    ps = search.pipeline_search()
    best = []
    ps.extend(best, 10**9, 0)  # top-K so large nothing is pruned: every fitting configuration
    fastest = min(-item[0] for item in best)
    piped = [r.step_s for r in rows if r.pipe > 1]
    if fastest < rows[-1].step_s:  # it belongs to the top 3
        assert min(piped) == pytest.approx(fastest, rel=1e-12)
    else:
        assert not piped or min(piped) >= fastest


def test_classic_uneven_and_interleaved():
    assert uneven_split(42, 4) == (10, 11, 11, 10)
    assert uneven_split(42, 8) == (3, 6, 6, 6, 6, 6, 6, 3)
    assert uneven_split(42, 16) == ()
    assert sum(uneven_split(126, 16)) == 126
    assert pipeline_variants(42, 4, True, True) == [(1, (10, 11, 11, 10))]
    assert (1, ()) in pipeline_variants(80, 8, True, True)
    assert (5, ()) in pipeline_variants(80, 8, True, True)
    assert pipeline_variants(42, 4, False, False) == []
