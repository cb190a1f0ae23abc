"""The planner's search: enumeration, the 80% memory rule, pruning, ranking, errors."""

import itertools

import pytest

from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import get_machine
from tetrad.plan.memory.runtime import runtime_memory
from tetrad.plan.question import StepQuestion, sharded
from tetrad.plan.search.classic import search_classic
from tetrad.plan.search.four_d import search_4d
from tetrad.plan.search.memory_fits import memory_line as _memory_line
from tetrad.plan.search.plan import plan
from tetrad.plan.search.space import divisors, factorizations
from tetrad.plan.step_time import estimate
from tetrad.spec.presets import get_model
from tetrad.spec.sharding import grid_problems

H100 = get_machine("dgx-h100")
PERL = get_machine("perlmutter")


def test_stacked_w13_needs_each_matrix_split():
    """w13 stacks gate and up (``[2, f, h]``): each ``f`` rows split over ``G_y G_z``, not only
    the ``2 f`` (the runtime's Linear refuses otherwise). llama-2-7b: f = 11008 = 2^8 x 43."""
    model = get_model("llama-2-7b")
    bad = grid_problems(model, (1, 64, 8, 1))  # G_z G_y = 512 divides 2f, not f
    assert any("w13 out=11008 (per stacked matrix)" in b for b in bad), bad
    assert not any("w13" in b for b in grid_problems(model, (1, 32, 8, 1)))


def test_factorizations_and_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert len(factorizations(1024, 4)) == 286  # C(10 + 3, 3)
    assert len(factorizations(16384, 4)) == 680
    assert all(a * b * c * d == 96 for a, b, c, d in factorizations(96, 4))
    assert len(set(factorizations(96, 4))) == len(factorizations(96, 4))


def test_rows_fit_divide_and_are_sorted():
    model = get_model("llama-1b")
    rows, stats = search_4d(model, H100, 64, 64, 2048, top=8)
    assert 0 < len(rows) <= 8
    assert [r.step_s for r in rows] == sorted(r.step_s for r in rows)
    for r in rows:
        d, c, z, y, x = r.grid
        assert r.pipe * d * c * z * y * x == 64 and 2048 % (2 * c) == 0
        assert 64 % (d * z * r.micro_batch) == 0
        assert r.grad_accum == 64 // (d * z * r.micro_batch)
        assert r.memory.fits and r.memory.fraction <= 0.8
        assert not grid_problems(model, r.grid)
        assert r.step_s >= r.compute_s
        full = r.activation_checkpointing == "full"  # selective recomputes no FLOPs
        assert 0 < r.mfu < r.hfu if full else r.mfu == r.hfu
    assert stats["fitting"] >= stats["evaluated"] > 0


def test_pruned_search_equals_exhaustive():
    """The 4D search's top rows are the fastest of every fitting configuration, the optimizer
    unsharded and sharded (``shard_optimizer="auto"``: both, where both fit)."""
    model = get_model("llama-1b")
    gpus, batch, seq = 32, 32, 1024
    rows, _ = search_4d(model, H100, gpus, batch, seq, top=5, pipeline=False)
    ctx = StepQuestion(model, H100, seq, batch)
    every = []
    for grid in factorizations(gpus, 5):  # (G_data, G_context, G_z, G_y, G_x)
        if grid_problems(model, grid) or batch % (grid[0] * grid[2]) or seq % (2 * grid[1]):
            continue
        modes = ("none", "selective", "full")
        zeros = (False, True) if grid[0] * grid[1] > 1 else (False,)
        for ckpt, b, zero in itertools.product(
            modes, divisors(batch // (grid[0] * grid[2])), zeros
        ):
            mem = runtime_memory(
                model,
                grid,
                b,
                seq,
                H100.memory_bytes,
                activation_checkpointing=ckpt,
                shard_optimizer=zero,
            )
            if mem.fits:
                q = sharded(ctx) if zero else ctx
                every.append((estimate(q, grid, b, ckpt).step_s, grid, b, ckpt, zero))
    every.sort()
    got = [(r.grid, r.micro_batch, r.activation_checkpointing, r.shard_optimizer) for r in rows]
    assert got == [e[1:] for e in every[:5]]
    assert [r.step_s for r in rows] == pytest.approx([e[0] for e in every[:5]])


@pytest.mark.parametrize("ckpt", ["none", "selective", "full"])
def test_memory_line_is_exact(ckpt):
    model = get_model("gpt-20b")
    grid, seq, mem = (4, 4, 2, 8), 2048, PERL.memory_bytes
    line = _memory_line(model, grid, seq, mem, ckpt, "bf16", True, [1, 2, 4, 8, 16])
    for b in (1, 3, 4, 16):
        exact = runtime_memory(model, grid, b, seq, mem, activation_checkpointing=ckpt)
        assert line(b) == pytest.approx(exact.total, rel=1e-12)


def test_config_above_80_percent_is_flagged_and_dropped():
    model = get_model("gpt-80b")
    big = runtime_memory(model, (64, 16, 1, 1), 1, 2048, PERL.memory_bytes)
    assert big.fraction > 0.8 and not big.fits
    small = runtime_memory(
        model, (1, 64, 4, 4), 1, 2048, PERL.memory_bytes, activation_checkpointing=True
    )
    assert small.fits
    rows, _ = search_4d(model, PERL, 1024, 2048, 2048, top=50)
    assert all(r.memory.fits for r in rows)
    assert (64, 16, 1, 1) not in [r.grid for r in rows]


def test_axonn_mode_ranks_by_compute_plus_its_comm():
    model = get_model("gpt-20b")
    rows, _ = search_4d(model, PERL, 256, 512, 2048, top=3, comm_model="axonn")
    assert rows and all(r.comm_model == "axonn" for r in rows)
    r = rows[0]
    assert r.step_s == pytest.approx(r.compute_s + sum(r.exposed_s.values()), rel=1e-9)


def test_classic_space_rows():
    model = get_model("llama-3.1-8b")
    rows, stats = search_classic(model, H100, 64, 256, 8192, top=5)
    assert rows and stats["fitting"] > 0
    for r in rows:
        tp, cp, pp, dp = r.grid
        assert tp * cp * pp * dp == 64 and tp * cp <= 8 and model.n_layers % pp == 0
        assert r.memory.fits
    assert [r.step_s for r in rows] == sorted(r.step_s for r in rows)


def test_plan_reports_both_spaces():
    res = plan(get_model("llama-3.1-8b"), H100, 64, 256, 8192, top=3)
    assert res.rows and res.classic
    d = res.to_dict()
    assert d["four_d"][0]["memory"]["fits"] and d["inputs"]["gpus"] == 64
    assert set(d["four_d"][0]["exposed_comm_s"]) == {"x", "y", "z", "context", "data", "world"}


def test_errors_say_what_to_change():
    model = get_model("gpt-80b")
    with pytest.raises(PlanError, match="multiple of 125.*--gpus 1024"):
        search_4d(model, PERL, 1000, 2048, 2048)
    with pytest.raises(PlanError, match="fits under 80%.*more --gpus"):
        search_4d(model, PERL, 16, 64, 2048)
    with pytest.raises(PlanError, match="--seq-len"):
        search_4d(model, PERL, 1024, 2048, 4096)
    with pytest.raises(PlanError, match="must be a positive integer"):
        search_4d(model, PERL, 0, 2048, 2048)
    with pytest.raises(PlanError, match="unknown overlap"):
        search_4d(model, PERL, 1024, 2048, 2048, overlaps="prefetch,nope")


def test_tied_embeddings_fit_where_the_memory_model_says():
    """With tied embeddings the LM head is the embedding table: the search's memory floors count
    the states the memory model counts (not the head twice), so a configuration that fits by a
    hair is found."""
    import dataclasses

    model = dataclasses.replace(get_model("llama-1b"), tied_embeddings=True)
    peak = runtime_memory(model, (1, 1, 1, 1), 1, 256, 1e15, activation_checkpointing="full").total
    mem = peak / 0.8 * 1.001  # "full" at b = 1 fits, just
    rows, _ = search_4d(model, H100, 1, 1, 256, top=3, gpu_memory_bytes=mem, pipeline=False)
    assert rows and all(r.memory.total <= 0.8 * mem for r in rows)


def test_sequence_parallel_regather_rows_are_timed_with_it():
    """``search_4d(sequence_parallel="on", regather=True)``: a sequence-parallel 5D row's step
    and all-communication seconds are :func:`estimate`'s with
    ``StepQuestion(sequence_parallel="regather")`` (llama-3-70b on 64 H100s), whose Y
    communication exceeds plain sequence parallelism's (the backward all-gathers again)."""
    from tetrad.plan.question import sharded

    model = get_model("llama-3-70b")
    rows, _ = search_4d(
        model, H100, 64, 128, 4096, top=1, pipeline=False, sequence_parallel="on", regather=True
    )
    row = rows[0]
    assert row.sequence_parallel
    got = {}
    for sp in ("regather", True):
        ctx = StepQuestion(model, H100, 4096, 128, sequence_parallel=sp)
        ctx = sharded(ctx) if row.shard_optimizer else ctx
        args = (tuple(row.grid), row.micro_batch, row.activation_checkpointing)
        got[sp] = estimate(ctx, *args, orientation=row.orientation)
    assert row.step_s == got["regather"].step_s
    assert row.comm_s == got["regather"].comm_s
    assert got["regather"].comm_s["y"] > got[True].comm_s["y"]


def test_sharded_optimizer_updates_its_piece():
    """With the sharded optimizer the step's optimizer term is AdamW over this rank's
    ``1/(G_data G_context)`` piece plus the copies sharding adds over every local element
    (tetrad/parallel/zero.py: the gradients packed, the gathered weights copied back), not
    AdamW over every local element: on ``data=4, y=2`` the compute differs from the unsharded
    step's by exactly that."""
    from tetrad.plan.compute.elementwise import ELEMENTWISE, optimizer_seconds

    model, machine = get_model("llama-3.1-8b"), get_machine("dgx-h100")
    ctx = StepQuestion(model, machine, 2048, 64, param_bytes=2)
    grid, hbm = (4, 1, 2, 1), machine.hbm_bytes_per_s
    plain, zero = (estimate(q, grid, 1, "none") for q in (ctx, sharded(ctx)))
    _, block, head, emb = ctx.weight_shards(1, 2, 1)
    local = model.n_layers * block + head + emb + ctx.vector_elements(1, 2)
    want = optimizer_seconds(local, hbm, 4, 2) - optimizer_seconds(local, hbm)
    assert zero.compute_s - plain.compute_s == pytest.approx(want, rel=1e-9)
    assert want < 0  # a quarter of AdamW's 36 bytes plus 12 bytes of copies per element
    per_element = (ELEMENTWISE["optimizer_per_param"] / 4 + 8 + 4) / hbm
    assert optimizer_seconds(local, hbm, 4, 2) == pytest.approx(per_element * local, rel=1e-12)
