"""tetrad's space contains the classic one (issue 45): every classic Megatron-style
configuration maps to a tetrad layout with the same parallel sizes
(:mod:`tetrad.plan.search.classic_map`), and tetrad's model times that layout within 2% of the
classic model and fits it in memory, except the known gaps listed below with their reason.

Which configurations: for each case of ``docs/planner.md`` section 6.1's "Best plan of each
space" table, the 6 fastest fitting classic configurations (``search_classic(top=6)``, ties in
enumeration order): deterministic, and the ones a comparison of the best plans turns on. All
2,126 fitting ones take about 9 s of CPU (``docs/planner.md``, the table under section 6.1,
gives their counts).

Known gaps (strict ``xfail``: a fix that closes one fails here until its entry is removed):

- ``NO_SP_TIME``: tensor parallelism without Megatron's sequence parallelism in tetrad's model:
  the norms' and residuals' element-wise work is replicated over the Y ranks, and a pipeline
  stage sends the whole ``[b, S, h]`` boundary from every Y rank where Megatron sends
  ``h / TP`` (stage boundaries ``[b, S/G_context, h/G_x]``, ``G_x = 1``);
- ``CONTEXT_TIME``: tetrad's context attention computes ``(2G+1)/(2G)`` of the causal ideal
  (the masked chunk) and its first K/V piece is exposed, where the classic model charges the
  ideal share and hides the whole ring behind attention;
- ``INTERLEAVED_BUBBLE``: the interleaved schedule's bubble, tetrad's critical path of the
  stages' times (the last stage with the LM head) against the classic model's
  ``(p-1)/v`` micro-batch slots;
- ``ACTIVATION_MEMORY``: the peak is in backward, with the activations of tetrad's model:
  with TP, residuals and norms replicated over Y (no sequence parallelism on these layouts;
  the residual stream in bf16 since ``--residual-dtype auto`` closed ten of the thirteen
  entries it had with an fp32 stream).

(Two reasons are gone: the sharded optimizer's all-gathers after the update, six entries, held
the whole model again until they ran one unit at a time; and a block Linear's weight gradient
with ``G_z = 1`` held an fp32 copy beside the bf16 one until it was added to the fp32 gradient as
it is, two entries.)
"""

from __future__ import annotations

import functools
import json

import pytest

from tetrad import cli
from tetrad.plan.machine.description import get_machine
from tetrad.plan.pipe.pipeline_step import PipeConfig
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.classic import search_classic
from tetrad.plan.search.classic_map import ClassicConfig, layout_estimate, to_tetrad
from tetrad.plan.search.plan import plan
from tetrad.spec.presets import get_model

CASES = (
    ("gpt-20b", "perlmutter", 256, 512, 2048),
    ("llama-3.1-8b", "dgx-h100", 64, 256, 8192),
    ("llama-3-70b", "dgx-h100", 512, 4096, 2048),
    ("llama-3.1-405b", "dgx-h100", 2048, 2048, 8192),
    ("gpt-80b", "perlmutter", 1024, 2048, 2048),
)
"""The five cases of ``docs/planner.md`` section 6.1: model, machine, GPUs, batch, sequence."""
TOP = 6
"""The fastest classic configurations compared per case (module doc)."""
TIME_BOUND = 1.02
"""tetrad's step of the mapped layout over the classic step, at most."""

NO_SP_TIME = "no sequence parallelism: element-wise work and stage boundaries replicated over Y"
CONTEXT_TIME = "context: (2G+1)/(2G) masked attention and the first K/V piece exposed"
INTERLEAVED_BUBBLE = "interleaved bubble: critical path with the LM head's stage vs (p-1)/v"
ACTIVATION_MEMORY = "activations: residuals and norms replicated over Y (no sequence parallel)"

# (model, TP, CP, PP, DP, virtual stages, micro-batch, recompute) -> (reasons, ratio at 6b4b481)
TIME_GAPS = {
    ("gpt-20b", 4, 1, 2, 32, 8, 4, "none"): ((NO_SP_TIME, INTERLEAVED_BUBBLE), 1.118),
    ("gpt-20b", 4, 1, 4, 16, 8, 4, "none"): ((NO_SP_TIME, INTERLEAVED_BUBBLE), 1.213),
    ("gpt-20b", 4, 1, 4, 16, 4, 4, "none"): ((NO_SP_TIME, INTERLEAVED_BUBBLE), 1.115),
    ("gpt-20b", 4, 1, 4, 16, 4, 2, "none"): ((NO_SP_TIME, INTERLEAVED_BUBBLE), 1.091),
    ("gpt-20b", 1, 4, 8, 8, 2, 1, "none"): ((CONTEXT_TIME, INTERLEAVED_BUBBLE), 1.021),
    ("llama-3.1-8b", 1, 4, 1, 16, 1, 1, "none"): ((CONTEXT_TIME,), 1.075),
    ("llama-3.1-8b", 1, 8, 1, 8, 1, 2, "none"): ((CONTEXT_TIME,), 1.067),
    ("llama-3.1-8b", 1, 8, 1, 8, 1, 1, "none"): ((CONTEXT_TIME,), 1.099),
    ("llama-3.1-8b", 2, 1, 1, 32, 1, 1, "none"): ((NO_SP_TIME,), 1.025),
    ("llama-3.1-8b", 2, 2, 1, 16, 1, 2, "none"): ((NO_SP_TIME, CONTEXT_TIME), 1.08),
    ("llama-3.1-8b", 2, 4, 1, 8, 1, 4, "none"): ((NO_SP_TIME, CONTEXT_TIME), 1.055),
    ("llama-3-70b", 1, 8, 8, 8, 1, 1, "none"): ((CONTEXT_TIME,), 1.0205),
    ("llama-3-70b", 2, 4, 4, 16, 2, 1, "none"): (
        (NO_SP_TIME, CONTEXT_TIME, INTERLEAVED_BUBBLE),
        1.052,
    ),
    ("llama-3-70b", 2, 4, 4, 16, 4, 1, "none"): (
        (NO_SP_TIME, CONTEXT_TIME, INTERLEAVED_BUBBLE),
        1.129,
    ),
    ("llama-3-70b", 2, 4, 4, 16, 5, 1, "none"): (
        (NO_SP_TIME, CONTEXT_TIME, INTERLEAVED_BUBBLE),
        1.063,
    ),
    ("llama-3-70b", 1, 8, 8, 8, 5, 1, "none"): ((CONTEXT_TIME, INTERLEAVED_BUBBLE), 1.059),
    ("llama-3.1-405b", 2, 4, 64, 4, 1, 1, "full"): ((NO_SP_TIME, CONTEXT_TIME), 1.025),
    ("llama-3.1-405b", 4, 2, 16, 16, 1, 1, "full"): ((NO_SP_TIME, CONTEXT_TIME), 1.031),
    ("llama-3.1-405b", 4, 2, 32, 8, 1, 1, "full"): ((NO_SP_TIME, CONTEXT_TIME), 1.041),
    ("llama-3.1-405b", 4, 2, 64, 4, 1, 1, "full"): ((NO_SP_TIME, CONTEXT_TIME), 1.062),
}
"""Mapped layouts above :data:`TIME_BOUND`, with the terms modelled differently (module doc)
and tetrad's step over the classic one when listed."""

# (model, TP, CP, PP, DP, v, b, recompute) -> (reason, tetrad's memory over Fujii et al.'s)
# The bf16 residual stream (--residual-dtype auto; the norms keep no normalised tensor) made
# these fit, tetrad's memory over Fujii et al.'s from the fp32 stream's: gpt-20b 4,1,4,16,4,2
# and 2,1,4,32,4,1, the five llama-3.1-8b entries (1.11-1.44 before), llama-3.1-405b
# 4,2,16,16 full (1.59), gpt-80b 4,1,8,32 b1 none (1.6 -> 1.15) and b4 full (1.75); the
# ratios below are with the bf16 stream (before it: 2.2, 2.66, 2.52).
MEMORY_GAPS = {
    ("gpt-20b", 4, 1, 2, 32, 8, 4, "none"): (ACTIVATION_MEMORY, 1.44),
    ("gpt-20b", 4, 1, 4, 16, 8, 4, "none"): (ACTIVATION_MEMORY, 1.62),
    ("gpt-20b", 4, 1, 4, 16, 4, 4, "none"): (ACTIVATION_MEMORY, 1.52),
    ("llama-3-70b", 2, 4, 4, 16, 4, 1, "none"): (ACTIVATION_MEMORY, 1.12),
    ("gpt-80b", 4, 1, 4, 64, 1, 2, "full"): (ACTIVATION_MEMORY, 1.053),
}
"""Mapped layouts that do not fit tetrad's memory model (80%), with the phase whose excess
decides (module doc) and tetrad's total over Fujii et al.'s."""


@functools.cache
def _compared(case: tuple) -> list[tuple]:
    """``(key, classic row, tetrad's LayoutEstimate)`` of the case's :data:`TOP` fastest
    classic configurations."""
    name, machine_name, gpus, batch, seq = case
    model, machine = get_model(name), get_machine(machine_name)
    rows, _ = search_classic(model, machine, gpus, batch, seq, top=TOP)
    ctx = StepQuestion(model, machine, seq, batch, param_bytes=2)
    out = []
    for row in rows:
        cfg = ClassicConfig.from_row(row)
        key = (name, cfg.tp, cfg.cp, cfg.pp, cfg.dp, cfg.virtual_stages, cfg.micro_batch)
        key += (cfg.checkpointing,)
        out.append((key, row, layout_estimate(ctx, to_tetrad(cfg, batch), machine.memory_bytes)))
    return out


def _params(gaps: dict) -> list:
    """One parameter per compared configuration, strict xfail where ``gaps`` lists it."""
    out = []
    for case in CASES:
        for i in range(TOP):
            out.append(pytest.param(case, i, id=f"{case[0]}-{i}"))
    marked = []
    for p in out:
        case, i = p.values
        got = _compared(case)
        if i >= len(got):
            continue
        key = got[i][0]
        if key in gaps:
            reasons = gaps[key][0]
            reason = "; ".join(reasons) if isinstance(reasons, tuple) else reasons
            p = pytest.param(case, i, id=p.id, marks=pytest.mark.xfail(strict=True, reason=reason))
        marked.append(p)
    return marked


def test_mapping_keeps_the_sizes():
    """TP on Y (xy: Megatron's column- then row-parallel pair), CP on context, PP on the
    pipe axis with the schedule, DP on data with the sharded optimizer and bf16 weights."""
    lay = to_tetrad(ClassicConfig(2, 4, 8, 8, 1, "none", 5), 1024)
    assert lay.grid == (8, 4, 1, 2, 1) and lay.orientation == "xy"
    assert lay.pipe == PipeConfig(8, 5, "interleaved-1f1b")
    assert lay.shard_optimizer and lay.params == "bf16" and lay.checkpointing == "none"
    assert lay.memory_args(1024)[:2] == ["--grid", "pipe=8,data=8,context=4,y=2"]
    plain = to_tetrad(ClassicConfig(4, 1, 8, 32, 1, "selective", 1, (3, 6, 6, 6, 6, 6, 6, 3)), 2048)
    assert plain.pipe == PipeConfig(8, 1, "1f1b") and plain.checkpointing == "none"
    few = to_tetrad(ClassicConfig(1, 1, 8, 1, 1, "full"), 4)  # 4 micro-batches < PP
    assert few.pipe == PipeConfig(8, 1, "gpipe") and not few.shard_optimizer
    assert to_tetrad(ClassicConfig(8, 1, 1, 1, 2, "full"), 4).pipe is None


@pytest.mark.parametrize(("case", "i"), _params(TIME_GAPS))
def test_mapped_classic_time(case, i):
    """tetrad's step of the mapped layout at most :data:`TIME_BOUND` x the classic step."""
    key, row, est = _compared(case)[i]
    assert est.step_s <= TIME_BOUND * row.step_s, (key, est.step_s / row.step_s)


@pytest.mark.parametrize(("case", "i"), _params(MEMORY_GAPS))
def test_mapped_classic_fits(case, i):
    """The mapped layout fits tetrad's memory model (80% of the GPU)."""
    key, row, est = _compared(case)[i]
    assert est.fits, (key, est.memory.total / row.memory.total)


def test_search_reaches_the_mapped_layouts():
    """``tetrad plan --param-dtype bf16``'s best is at most every fitting mapped layout of the
    compared ones (Llama-3.1-8B on 64 H100s: the search reaches them or something faster)."""
    case = CASES[1]
    name, machine_name, gpus, batch, seq = case
    fitting = [est.step_s for _, _, est in _compared(case) if est.fits]
    assert fitting
    model, machine = get_model(name), get_machine(machine_name)
    best = plan(model, machine, gpus, batch, seq, top=1, params="bf16", classic=False).rows[0]
    assert best.step_s <= min(fitting)


def test_memory_args_give_the_layout(capsys):
    """``tetrad memory`` with :meth:`TetradLayout.memory_args` gives the memory
    :func:`layout_estimate` ranks by (the llama-3-70b classic winner, CP 8 x PP 8 x DP 8)."""
    case = CASES[2]
    key, row, est = _compared(case)[0]
    assert key == ("llama-3-70b", 1, 8, 8, 8, 1, 1, "none")
    lay = to_tetrad(ClassicConfig.from_row(row), case[3])
    argv = ["memory", "--model", case[0], "--seq-len", str(case[4]), "--machine", case[1]]
    assert cli.main([*argv, "--json", *lay.memory_args(case[3])]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["total_bytes"] == pytest.approx(est.memory.total)
    assert got["fits"] == est.fits
