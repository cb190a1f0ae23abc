"""The planner's pipeline step (tetrad/plan/pipe/critical_path.py): the schedules' orders are
torch's, the critical path reduces to the classic (m + (p - 1) / v)(t_F + t_B) on equal stages,
GPipe's closed form and the extrapolation beyond EXACT_ROUNDS p micro-batches equal the full
simulation, and the search's floors are never above it."""

import random
from types import SimpleNamespace

import pytest

from tetrad.plan.pipe import critical_path
from tetrad.plan.pipe.critical_path import (
    EXACT_ROUNDS,
    rank_actions,
    rank_seconds,
    schedule_step,
    simulate_step,
)
from tetrad.spec.pipeline_split import balanced_split

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3))


@pytest.mark.parametrize("pipe", [2, 3, 4, 8])
@pytest.mark.parametrize("virtual", [2, 3, 5])
def test_interleaved_order_is_torchs(pipe, virtual):
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    for m in (pipe, 2 * pipe, 8 * pipe):
        rounds = max(1, m // pipe)
        fake = SimpleNamespace(
            n_local_stages=virtual,
            pp_group_size=pipe,
            _n_microbatches=m,
            microbatches_per_round=m // rounds,
        )
        for r in range(pipe):
            ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, r)
            got = [
                (
                    int(a.computation_type != _ComputationType.FORWARD),
                    a.stage_index,
                    a.microbatch_index,
                )
                for a in ops
                if a is not None
            ]
            assert got == rank_actions("interleaved-1f1b", pipe, virtual, m, r)


def test_1f1b_order():
    # torch's Schedule1F1B: p - r warm-up forwards, then a backward and a forward in turn
    assert rank_actions("1f1b", 3, 1, 4, 1) == [
        (0, 1, 0), (0, 1, 1), (1, 1, 0), (0, 1, 2), (1, 1, 1), (0, 1, 3), (1, 1, 2), (1, 1, 3)
    ]  # fmt: skip
    assert rank_actions("gpipe", 2, 1, 2, 0) == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]


@pytest.mark.parametrize("schedule,virtual", SCHEDULES)
@pytest.mark.parametrize("pipe", [2, 4, 8])
def test_equal_stages_give_the_classic_bubble(schedule, virtual, pipe):
    """(m + (p - 1) / v)(t_F + t_B): Narayanan et al. 2021, section 2.2."""
    n = pipe * virtual
    fwd, bwd = [1.0 / virtual] * n, [2.0 / virtual] * n
    for m in (pipe, 2 * pipe, 4 * pipe, 16 * pipe):
        want = (m + (pipe - 1) / virtual) * 3.0
        assert simulate_step(schedule, pipe, virtual, m, fwd, bwd) == pytest.approx(want)
        assert schedule_step(schedule, pipe, virtual, m, fwd, bwd) == pytest.approx(want)


def _runtime_split(n_layers, emb, head, stages):
    split = balanced_split([1.0] * n_layers, emb, head, stages)
    last = stages - 1
    out = [float(b - a) for a, b in split]
    out[0] += emb
    out[last] += head
    return out


def test_planner_step_is_the_simulation_on_runtime_splits():
    """GPipe's closed form and the extrapolation equal the full simulation where the stages
    are the runtime's balanced split (a few kinds of stage), every m; never below the floors
    the search uses (m T_max; m T_r plus the path into and out of rank r)."""
    rng = random.Random(0)
    seen = 0
    for _ in range(120):
        schedule, virtual = rng.choice(SCHEDULES)
        pipe, layers = rng.choice((2, 3, 4, 8)), rng.choice((8, 16, 32, 48, 80))
        if pipe * virtual > layers:
            continue
        cost = _runtime_split(
            layers, rng.choice((0, 0.25, 1)), rng.choice((0.5, 1, 2, 3)), pipe * virtual
        )
        fwd = [c / 3 + 0.01 for c in cost]
        bwd = [2 * c / 3 + 0.01 for c in cost]
        m = rng.choice((1, 2, 5, 8)) * pipe
        step = schedule_step(schedule, pipe, virtual, m, fwd, bwd)
        assert step == pytest.approx(simulate_step(schedule, pipe, virtual, m, fwd, bwd), rel=1e-9)
        t = rank_seconds(pipe, fwd, bwd)
        assert step >= m * max(t) * (1 - 1e-12)
        for r in range(pipe):
            lead = sum(fwd[:r]) + sum(bwd[:r])
            assert step >= (m * t[r] + lead) * (1 - 1e-12)
        seen += m > EXACT_ROUNDS * pipe
    assert seen > 10


def test_uneven_ranks_leave_less_bubble_on_1f1b():
    """The CPU benchmark's 4 ranks (ms per micro-batch, forward a third): the slowest is the
    last, so the bubble is the other ranks' work, sum_{r<3} T_r, not 3 T_max."""
    t = [24.0, 46.0, 67.0, 68.0]
    fwd, bwd = [x / 3 for x in t], [2 * x / 3 for x in t]
    assert simulate_step("1f1b", 4, 1, 8, fwd, bwd) == pytest.approx(8 * 68 + 24 + 46 + 67)


# gpt-80b's 42 blocks on p = 16, v = 2 as `tetrad plan --model gpt-80b --machine perlmutter
# --gpus 1024 --global-batch 16384` splits them (ms per micro-batch): 21 one-block stages, then
# 10 two-block ones, then the head's
GPT_80B_FWD = [9.1] + [10.09] * 14 + [10.11, 10.3] + [10.09] * 4 + [18.91] * 10 + [19.39]
GPT_80B_BWD = [20.34] + [19.38] * 14 + [19.42, 19.82] + [19.38] * 4 + [37.49] * 10 + [19.04]


def _alternates(pipe, virtual, fwd, bwd):
    """Whether interleaved 1F1B's step grows by different amounts over its 5th and 6th rounds
    of p micro-batches (a pace that does not settle to one per round)."""
    steps = [
        simulate_step("interleaved-1f1b", pipe, virtual, k * pipe, fwd, bwd) for k in (4, 5, 6)
    ]
    t_max = max(rank_seconds(pipe, fwd, bwd))
    return abs(steps[2] - 2 * steps[1] + steps[0]) > 1e-6 * pipe * t_max


def _longest_simulated(monkeypatch):
    """The longest length schedule_step simulates from now on (a list holding it)."""
    longest = [0]

    def counted(schedule, pipe, virtual, m, fwd, bwd):
        longest[0] = max(longest[0], m)
        return simulate_step(schedule, pipe, virtual, m, fwd, bwd)

    monkeypatch.setattr(critical_path, "simulate_step", counted)
    return longest


def test_planner_step_is_the_simulation_where_the_pace_alternates(monkeypatch):
    """Interleaved 1F1B on gpt-80b's planned stages: the step grows by two amounts in turn per
    round of p micro-batches (cyclicity 2), extrapolated by whole periods of 2 p from at most 8
    rounds simulated; equal to the full simulation for m an odd and an even number of rounds,
    up to 4,096."""
    assert _alternates(16, 2, GPT_80B_FWD, GPT_80B_BWD)
    longest = _longest_simulated(monkeypatch)
    for m in (16 * 9, 16 * 64, 16 * 65, 4096):
        longest[0] = 0
        step = schedule_step("interleaved-1f1b", 16, 2, m, GPT_80B_FWD, GPT_80B_BWD)
        assert longest[0] <= 16 * 8 + 16
        full = simulate_step("interleaved-1f1b", 16, 2, m, GPT_80B_FWD, GPT_80B_BWD)
        assert step == pytest.approx(full, rel=1e-9)


# runtime splits (blocks, embedding, head in blocks' worth) on which the pace alternates
ALTERNATING = ((8, 2, 62, 0.25, 2), (16, 2, 42, 0, 2), (16, 3, 102, 0, 0.5), (8, 4, 96, 1, 3))


def test_planner_step_is_the_simulation_on_perturbed_alternating_splits(monkeypatch):
    """The runtime splits whose pace alternates, each stage's time perturbed by up to 1%
    (some then settle to one pace, some still alternate, after longer start-ups): the planner's
    step equals the full simulation, m up to 4,096 (256 rounds of p = 16)."""
    rng = random.Random(1)
    longest = _longest_simulated(monkeypatch)
    alternating = extrapolated = 0
    for pipe, virtual, layers, emb, head in ALTERNATING:
        for noise in (0.0, 0.01, 0.01, 0.01):
            cost = _runtime_split(layers, emb, head, pipe * virtual)
            cost = [c * (1 + rng.uniform(-noise, noise)) for c in cost]
            fwd = [c / 3 + 0.01 for c in cost]
            bwd = [2 * c / 3 + 0.01 for c in cost]
            alternating += _alternates(pipe, virtual, fwd, bwd)
            m = pipe * rng.choice((3, 16, 33, 64, 101, 256))
            longest[0] = 0
            step = schedule_step("interleaved-1f1b", pipe, virtual, m, fwd, bwd)
            extrapolated += longest[0] < m
            full = simulate_step("interleaved-1f1b", pipe, virtual, m, fwd, bwd)
            assert step == pytest.approx(full, rel=1e-9)
    assert alternating >= 6 and extrapolated >= 12
