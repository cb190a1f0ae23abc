"""The planner inside tetrad train: --grid auto, the Domino and fine decisions (no processes)."""

import dataclasses
import re
from importlib import resources

import pytest

from tetrad.plan.comm.fine import CHUNK_CANDIDATES
from tetrad.plan.machine.description import get_machine
from tetrad.plan.pipe.pipeline_step import split_ranks
from tetrad.plan.pipe.stages import ranks_of_split, split_costs
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.plan import plan
from tetrad.plan.step_time import estimate
from tetrad.spec.grid import role_sizes
from tetrad.spec.overlap import CONTEXT_PIECES, FINE_CHUNKS, OVERLAPS
from tetrad.spec.precision import DTYPE_BYTES, compute_dtype
from tetrad.train.auto import choose_grid, context_pieces, domino_pays, fine_chunks, pipeline_split
from tetrad.train.config import ConfigError, load_config


def cfg(**over):
    base = {"model": "tiny", "grid": "auto", "global_batch": 8, "micro_batch": 2, "seq_len": 32}
    return load_config(None, base | over)


def test_grid_auto_picks_a_valid_grid_of_the_world_size(capsys):
    chosen = choose_grid(cfg(machine="dgx-h100"), 4, vocab_size=256)
    d, c, z, y, x = chosen.parallelism.grid
    assert chosen.parallelism.pipe * d * c * z * y * x == 4
    chosen.check()  # the batch splits and the grid is concrete now
    assert "D,C,Z,Y,X=" in capsys.readouterr().out


def test_grid_auto_can_pick_a_pipeline():
    """The planner's pipeline axis is in --grid auto's space: where its best row has a
    pipeline, the config carries G_pipe, the schedule and the virtual stages, and checks."""
    big = {"model": "llama-2-70b", "global_batch": 128, "micro_batch": 1, "seq_len": 4096}
    chosen = choose_grid(cfg(**big, machine="dgx-h100"), 128, 32000, verbose=False)
    par = chosen.parallelism
    best = plan(
        chosen.model_config(32000),
        get_machine("dgx-h100"),
        128,
        128,
        4096,
        top=3,
        micro_batches=(1,),
        checkpointing=(par.activation_checkpointing,),
        overlaps=par.overlap,
        classic=False,
        dtype=compute_dtype(chosen.training.device),
    ).rows[0]
    assert best.pipe > 1  # the question is one where a pipeline wins
    assert (par.pipe, par.grid) == (best.pipe, tuple(best.grid))
    assert (par.pipeline_schedule, par.virtual_stages) == (best.schedule, best.virtual_stages)
    chosen.check()
    # the runtime runs the stage split the planner timed (the planner's ranks of it)
    mc = chosen.model_config(32000)
    split = pipeline_split(chosen, mc)
    ctx = StepQuestion(
        mc,
        get_machine("dgx-h100"),
        4096,
        128,
        compute_bytes=DTYPE_BYTES[compute_dtype(chosen.training.device)],
    )
    comp = ctx.compute(role_sizes(tuple(best.grid), best.orientation), 1)
    costs = split_costs(comp, par.activation_checkpointing)
    want = split_ranks(mc.n_layers, costs, par.pipe, par.virtual_stages)
    assert ranks_of_split(split, par.pipe, par.virtual_stages) == want
    assert pipeline_split(cfg(**big, grid="2,1,1,1,2", pipe=2), mc) is None  # no machine on CPU


def test_pipeline_split_counts_sequence_parallelism():
    """With ``--sequence-parallel`` the planner's compute runs the norms on the sequence shard
    (:func:`tetrad.plan.compute.block.block_compute`), and the runtime's stage split is the
    planner's of that compute (Llama-3.1-8B, pipe 4 x Y 8, 2,048 tokens: 8/9/9/6 blocks where
    without it 7/9/9/7)."""
    opts = {"model": "llama-3.1-8b", "grid": "1,1,1,8,1", "orientation": "xy", "pipe": 4}
    opts |= {"machine": "dgx-h100", "seq_len": 2048, "micro_batch": 1, "global_batch": 8}
    got = {}
    for sp in (False, True):
        c = cfg(**opts, sequence_parallel=sp)
        got[sp] = pipeline_split(c, c.model_config(128256))
    assert got[False] == ((0, 7), (7, 16), (16, 25), (25, 32))
    assert got[True] == ((0, 8), (8, 17), (17, 26), (26, 32))


def test_grid_auto_needs_a_machine_on_cpu():
    with pytest.raises(ConfigError, match="--machine"):
        choose_grid(cfg(), 4, vocab_size=256)


def test_grid_auto_says_when_nothing_fits():
    with pytest.raises(ConfigError, match="no grid of 4 ranks.*global_batch=6"):
        choose_grid(cfg(machine="dgx-h100", global_batch=6, micro_batch=4), 4, vocab_size=256)


def test_auto_checkpointing_is_chosen_with_the_grid():
    """Llama-3.1-8B at 8,192 tokens on 8 H100s: no grid fits without recomputation, so a named
    ``none`` is refused, and ``auto`` takes the planner's best mode (and says so)."""
    big = {"model": "llama-3.1-8b", "global_batch": 64, "micro_batch": 4, "seq_len": 8192}
    big |= {"machine": "dgx-h100"}
    with pytest.raises(ConfigError, match="activation-checkpointing selective"):
        choose_grid(cfg(**big, activation_checkpointing="none"), 8, 128256, verbose=False)
    chosen = choose_grid(cfg(**big, activation_checkpointing="auto"), 8, 128256, verbose=False)
    mc = chosen.model_config(128256)
    best = plan(
        mc,
        get_machine("dgx-h100"),
        8,
        64,
        8192,
        top=1,
        micro_batches=(4,),
        overlaps=chosen.parallelism.overlap,
        classic=False,
        dtype=compute_dtype(chosen.training.device),
    )
    assert chosen.parallelism.activation_checkpointing == best.rows[0].activation_checkpointing
    assert chosen.parallelism.grid == tuple(best.rows[0].grid)
    chosen.check()  # a concrete grid and mode now


def test_auto_checkpointing_needs_grid_auto():
    with pytest.raises(ConfigError, match="--grid auto"):
        cfg(grid="1,1,1,4", activation_checkpointing="auto").check()


def test_unresolved_auto_grid_is_refused():
    with pytest.raises(ConfigError, match="auto"):
        cfg().check()


def test_domino_decision_follows_the_planner():
    c = cfg(grid="1,1,1,4", machine="dgx-h100")
    assert domino_pays(c, c.model_config()) in (True, False)
    assert domino_pays(cfg(grid="1,1,1,4"), c.model_config())  # no machine: the row rule alone


def described_machine(tmp_path, name: str, **network) -> str:
    """The dgx-h100 preset with some network keys changed, written as ``name.toml``."""
    text = resources.files("tetrad.plan.machine").joinpath("presets/dgx-h100.toml").read_text()
    text = text.replace('name = "dgx-h100"', f'name = "{name}"')
    for key, value in network.items():
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return str(path)


def fine_run(machine: str, overlap: str = "all"):
    return cfg(model="llama-1b", grid="1,1,2,2", seq_len=1024, machine=machine, overlap=overlap)


def predicted_step(c, overlaps) -> float:
    t, par = c.training, c.parallelism
    ctx = StepQuestion(
        c.model_config(),
        get_machine(par.machine),
        t.seq_len,
        t.global_batch,
        overlaps=overlaps,
        compute_bytes=2,
    )
    return estimate(ctx, par.grid, t.micro_batch, False).step_s


def test_fine_is_used_exactly_where_the_planner_predicts_a_gain(tmp_path):
    """Two described machines: a 20 GB/s link with 1 us per call (the GEMMs of llama-1b on
    grid 1,1,2,2 take about as long as their reduce-scatters: fusion pays) and the same node
    with 2 ms per call (every ring piece pays it: fusion loses)."""
    pays = described_machine(tmp_path, "slow-link", intra_node_gbps=20.0, latency_base_us=1.0)
    loses = described_machine(tmp_path, "high-latency", latency_base_us=2000.0)
    without = tuple(o for o in OVERLAPS if o != "fine")
    for machine, gain in ((pays, True), (loses, False)):
        c = fine_run(machine)
        chunks = fine_chunks(c, c.model_config())
        forced = predicted_step(c, OVERLAPS)  # fine named: on, best chunk count
        assert (forced < predicted_step(c, without)) == gain, machine
        assert (chunks in CHUNK_CANDIDATES) if gain else chunks == 0, (machine, chunks)
    # named explicitly it is on whatever the prediction; "all" without a machine leaves it off
    c = fine_run(loses, "prefetch,fine")
    assert fine_chunks(c, c.model_config()) in CHUNK_CANDIDATES
    c = fine_run("")
    assert fine_chunks(c, c.model_config()) == 0
    c = fine_run("", "fine")
    assert fine_chunks(c, c.model_config()) == FINE_CHUNKS


def test_negative_fine_chunks_is_refused():
    with pytest.raises(ConfigError, match="fine_chunks=-1 must be 0"):
        cfg(grid="1,1,1,4", fine_chunks=-1).check()


def test_context_pieces_are_the_planners_where_a_machine_is_given(tmp_path):
    """``--context-pieces 0`` on ``--machine``: the planner's best (one blocking all-gather on
    a link with 2 ms per call, several pieces on a 1 us one); without a machine 1;
    named, as named; 1 without the overlap or without context parallelism."""
    slow = described_machine(tmp_path, "high-latency", latency_base_us=2000.0)
    fast = described_machine(tmp_path, "low-latency", latency_base_us=1.0)

    def run(machine="", overlap="all", grid="1,2,1,1,1", **over):
        c = cfg(model="llama-1b", grid=grid, seq_len=4096, machine=machine, overlap=overlap)
        return context_pieces(
            dataclasses.replace(c, parallelism=dataclasses.replace(c.parallelism, **over)),
            c.model_config(),
        )

    assert run(slow) == 1
    assert run(fast) > 1
    assert run() == 1
    assert run(context_pieces=CONTEXT_PIECES) == CONTEXT_PIECES
    assert run(slow, context_pieces=4) == 4
    assert run(fast, overlap="prefetch") == 1
    assert run(fast, grid="2,1,1,1,1") == 1
    with pytest.raises(ConfigError, match="context_pieces=-1 must be 0"):
        cfg(grid="1,2,1,1,1", context_pieces=-1).check()


def test_grid_auto_plans_a_mixture_of_experts_model():
    """An MoE model gets a grid and an expert axis from the planner (issue 46)."""
    moe = {"model": "moe-small", "global_batch": 8, "micro_batch": 1, "seq_len": 64}
    chosen = choose_grid(cfg(**moe, machine="dgx-h100"), 4, 4096, verbose=False)
    par = chosen.parallelism
    d, c, z, y, x = par.grid
    assert par.pipe * d * c * z * y * x == 4
    assert par.expert_parallel >= 1 and (d * c) % par.expert_parallel == 0
    chosen.check()


def test_grid_auto_plans_with_sequence_parallel_regather(monkeypatch):
    """``--grid auto --sequence-parallel --sequence-parallel-regather`` asks the planner with
    regather (its ``sp`` rows priced with the regather memory and step models), and keeps it
    exactly where the chosen grid runs sequence parallelism."""
    import tetrad.plan.search.plan as planner

    asked = []

    def recording(*args, **kwargs):
        asked.append(kwargs.get("regather", False))
        return plan(*args, **kwargs)

    monkeypatch.setattr(planner, "plan", recording)
    base = {"machine": "dgx-h100", "sequence_parallel": True}
    for regather in (True, False):
        over = base | {"sequence_parallel_regather": regather}
        par = choose_grid(cfg(**over), 4, vocab_size=256, verbose=False).parallelism
        assert asked.pop() == regather
        assert par.sequence_parallel_regather == (regather and par.sequence_parallel)


def test_decisions_estimate_the_step_as_configured():
    """The Domino, ``fine`` and context-piece decisions time the grid as it will run: with
    ``--sequence-parallel`` (and its re-gather), bf16 weights and the sharded optimizer the
    estimate is the planner's for those options, not the plain grid's."""
    from tetrad.plan.question import sharded
    from tetrad.train.auto import _estimate

    over = {"model": "llama-1b", "grid": "data=2,y=4", "seq_len": 1024, "machine": "dgx-h100"}
    plain = cfg(**over)
    mc, ov = plain.model_config(), plain.parallelism.overlaps

    def question(c, **kw):
        p = c.policy
        return StepQuestion(
            mc,
            get_machine("dgx-h100"),
            1024,
            8,
            overlaps=ov,
            compute_bytes=DTYPE_BYTES[p.compute],
            residual_bytes=DTYPE_BYTES[p.residual],
            domino_min_rows=c.parallelism.domino_min_rows,
            **kw,
        )

    steps = []
    for extra, kw, shard in (
        ({}, {}, False),
        ({"sequence_parallel": True}, {"sequence_parallel": True}, False),
        (
            {"sequence_parallel": True, "sequence_parallel_regather": True},
            {"sequence_parallel": "regather"},
            False,
        ),
        ({"shard_optimizer": True, "param_dtype": "bf16"}, {"param_bytes": 2}, True),
    ):
        c = cfg(**over, **extra)
        want = question(c, **kw)
        want = sharded(want) if shard else want
        got = _estimate(c, mc, ov, None).step_s
        assert got == estimate(want, c.parallelism.grid, 2, "none").step_s, extra
        steps.append(got)
    assert len(set(steps)) == len(steps)  # each option moves the estimate
