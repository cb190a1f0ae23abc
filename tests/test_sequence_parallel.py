"""Sequence parallelism (``sequence_parallel=True``, :mod:`tetrad.parallel.sequence`) against the
single-process reference: the same losses, gradient norms and updated weights as
``tests/test_model.py`` and ``tests/test_pipeline.py`` ask of every grid, on layouts with one
tensor axis (Y; X under orientation ``yx``) with data (and the sharded optimizer), Z, context
and pipeline ranks, and on Y x X, in each activation-checkpointing mode once."""

import pytest

from tests.distributed import run_distributed
from tests.test_model import CFG, batches, reference_run, run_one
from tests.test_pipeline import CFG as PIPE_CFG
from tests.test_pipeline import batches as pipe_batches
from tests.test_pipeline import pipeline_runs
from tetrad.grid import Grid
from tetrad.plan.machine.description import get_machine
from tetrad.plan.memory.runtime import runtime_memory
from tetrad.plan.question import StepQuestion, sharded
from tetrad.plan.search.plan import plan
from tetrad.plan.step_time import estimate
from tetrad.spec.grid import role_sizes
from tetrad.spec.overlap import OVERLAPS
from tetrad.spec.presets import PRESETS, get_model
from tetrad.spec.sharding import sequence_parallel_problem
from tetrad.train.config import load_config
from tetrad.train.sections import ConfigError

ALL = tuple(OVERLAPS)
CASES = [  # (sizes, orientation, checkpointing, overlaps, sharded optimizer)
    ((2, 1, 2, 1), "xy", "none", ALL, True),  # data x Y
    ((1, 2, 1, 2), "yx", "selective", ALL, False),  # Z x X, X in the Y role
    ((1, 2, 1, 2, 1), "xy", "full", (), False),  # context x Y, no overlap
    ((1, 1, 2, 2), "xy", "none", ALL, False),  # Y x X: the stream split over both
]


def _model_runs(world_size, ref_curves, ref_weights):
    for sizes, orientation, mode, overlaps, shard in CASES:
        grid = Grid.build(sizes, orientation=orientation)
        opts = {"sequence_parallel": True, "shard_optimizer": shard}
        run_one(grid, sizes, ref_curves, ref_weights, mode, overlaps, False, **opts)


def test_sequence_parallel_matches_reference():
    run_distributed(_model_runs, 4, 4, *reference_run(CFG, batches()))


REGATHER_CASES = [  # (sizes, orientation, checkpointing, overlaps): inputs gathered again
    ((2, 1, 2, 1), "xy", "none", ALL),  # data x Y
    ((1, 1, 2, 2), "xy", "selective", ALL),  # Y x X: the recipe-kept shard regathered
    ((1, 1, 2, 2), "xy", "full", ()),  # Y x X, recomputed blocks, blocking collectives
]


def _regather_runs(world_size, ref_curves, ref_weights):
    for sizes, orientation, mode, overlaps in REGATHER_CASES:
        grid = Grid.build(sizes, orientation=orientation)
        opts = {"sequence_parallel": True, "sequence_parallel_regather": True}
        run_one(grid, sizes, ref_curves, ref_weights, mode, overlaps, False, **opts)


def test_sequence_parallel_regather_matches_reference():
    """``sequence_parallel_regather``: the first Linear of each pair keeps its sequence shard
    and all-gathers it again in backward; the same losses, gradient norms and weights."""
    run_distributed(_regather_runs, 4, 4, *reference_run(CFG, batches()))


def test_sequence_parallel_pipeline_matches_reference():
    """Two pipeline stages of Y = 2 ranks: the stages exchange the sequence-split stream."""
    cases = [(2, (1, 1, 1, 2, 1), "1f1b", 1, "selective", ALL)]
    ref = reference_run(PIPE_CFG, pipe_batches())
    run_distributed(pipeline_runs, 4, 4, *ref, cases, False, {"sequence_parallel": True})


def test_sequence_parallel_refuses_other_layouts():
    """No tensor axis (or none in the Y role), an MoE model, a sequence that does not split:
    one line each naming what to change; Y and X both above 1 run."""
    assert sequence_parallel_problem(CFG, (1, 1, 2, 2)) is None
    assert "G_y=1" in sequence_parallel_problem(CFG, (2, 1, 1, 1))
    assert "G_y=1" in sequence_parallel_problem(CFG, (1, 1, 1, 2))
    assert sequence_parallel_problem(CFG, (1, 2, 1, 2, 1), seq_len=16) is None
    assert "G_context*G_y=4" in sequence_parallel_problem(CFG, (1, 2, 1, 2, 1), seq_len=18)
    assert "MoE" in sequence_parallel_problem(PRESETS["moe-tiny"], (1, 1, 2, 1))
    base = {"model": "tiny", "global_batch": 8, "micro_batch": 2, "seq_len": 32}
    for options, why in (
        ({"grid": "data=2"}, "has none"),
        ({"grid": "x=2", "orientation": "xy"}, "--orientation yx"),
        ({"grid": "context=2,y=4", "seq_len": 36}, "G_context\\*4 = 8"),
    ):
        with pytest.raises(ConfigError, match=why):
            load_config(None, base | {"sequence_parallel": True} | options).check()


def test_planner_ranks_sequence_parallel_where_asked():
    """``tetrad plan --sequence-parallel``: ``on`` ranks the grids with ``G_y > 1`` with it
    (rows marked sp, their memory and step the models' with sequence parallelism), ``off``
    (the default) never, ``auto`` both variants of those grids, merged by step time."""
    model, machine = get_model("llama-3.1-8b"), get_machine("perlmutter")
    gpus, batch, seq = 8, 32, 4096
    opts = {"top": 8, "classic": False, "pipeline": False, "checkpointing": ("none",)}
    rows = {
        sp: plan(model, machine, gpus, batch, seq, sequence_parallel=sp, **opts).rows
        for sp in ("off", "on", "auto")
    }
    assert not any(r.sequence_parallel for r in rows["off"])
    on = [r for r in rows["on"] if r.sequence_parallel]
    assert on and all(role_sizes(r.grid, r.orientation)[3] > 1 for r in on)
    ctx = StepQuestion(model, machine, seq, batch, sequence_parallel=True)
    for r in on:
        roles, b = role_sizes(r.grid, r.orientation), r.micro_batch
        so = r.shard_optimizer
        mem = runtime_memory(
            model, roles, b, seq, machine.memory_bytes, sequence_parallel=True, shard_optimizer=so
        )
        assert r.memory.total == mem.total
        q = sharded(ctx) if so else ctx
        assert r.step_s == estimate(q, r.grid, b, "none", orientation=r.orientation).step_s
    steps = [r.step_s for r in rows["auto"]]
    assert steps == sorted(steps)
    assert steps[0] == min(rows["off"][0].step_s, rows["on"][0].step_s)
    labels = {r.label() for r in rows["auto"]}
    assert {rows["off"][0].label(), on[0].label()} <= labels
    assert any(f"{label} sp" in labels for label in labels)  # one grid with and without


def test_planner_counts_the_norms_on_the_sequence_shard():
    """Under sequence parallelism the norms and residual adds run on ``[b, S/G_y, h/G_x]``:
    the step model's element-wise norm work is ``1/G_y`` of the same grid's without it, the
    GEMMs, attention and LM head unchanged; GPT models too (counted as if the runtime built
    them); grids where it does not run (``G_y = 1``) keep every term."""
    machine, seq, batch = get_machine("dgx-h100"), 2048, 64
    for name in ("llama-3.1-8b", "gpt-20b"):
        model = get_model(name)
        on = StepQuestion(model, machine, seq, batch, sequence_parallel="regather")
        off = StepQuestion(model, machine, seq, batch)
        grid = (2, 1, 1, 4, 1)
        assert on.sequence_split(1, 4, 1) == 4
        a, b = on.compute(grid, 2), off.compute(grid, 2)
        assert a.gemm == b.gemm and a.attention == b.attention and a.head == b.head
        assert a.final_norm_fwd == pytest.approx(b.final_norm_fwd / 4)
        assert a.final_norm_bwd == pytest.approx(b.final_norm_bwd / 4)
        assert a.embedding_fwd == b.embedding_fwd  # the lookup runs on all m tokens
        norms = 4 * a.final_norm_fwd  # a block's two norms and two residual adds
        assert sum(b.post_fwd) - sum(a.post_fwd) == pytest.approx(norms * (4 - 1))
        assert b.selective - a.selective == pytest.approx(norms / 2 * (4 - 1))  # the norms
        plain = (4, 1, 1, 1, 2)
        assert on.compute(plain, 2) == off.compute(plain, 2)
