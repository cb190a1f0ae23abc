"""The Z stream's order: the runtime issues its Z all-gathers and reduce-scatters in exactly the
order the planner replays (tetrad/plan/comm/zqueue.py), prefetching two weights ahead and into
the step's next micro-batch, reduce-scatters after the next prefetch.

On 2 gloo ranks (``G_z = 2``, the tiny Llama, 3 micro-batches per step, every overlap, with and
without full activation checkpointing) rank 0 logs the Z collectives that
:class:`tetrad.parallel.overlap.Overlap` issues during the second step; the planner's replay of
the same step logs its own. Both are lists of ``(kind, layer)``.
"""

import json

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.test_plan_validation import CFG, SPEC
from tetrad.grid import Grid
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.plan.comm.zwindows import z_stream
from tetrad.plan.machine.description import get_machine
from tetrad.plan.question import StepQuestion
from tetrad.plan.step_time import make_step
from tetrad.spec.overlap import OVERLAPS
from tetrad.spec.presets import get_model
from tetrad.train.step import build_optimizer, train_step

ACC, SEQ, SEED = 3, 16, 5


def _layer(name: str) -> str:
    """The planner's layer name of a parameter's name."""
    parts = name.split(".")
    for part in ("wqkv", "wo", "w13", "w2"):
        if part in parts:
            return part
    return "output" if "output" in parts else "embedding"


def _worker(world_size: int, out_dir: str) -> None:
    grid = Grid.build((1, 2, 1, 1), "cpu")
    got = {}
    for ckpt in (False, True):
        model = ParallelLlama(CFG, grid, ckpt, OVERLAPS)
        init_parameters(model, SEED, grid)
        names = {id(p): _layer(n) for n, p in model.named_parameters()}
        opt = build_optimizer(model, 1e-3, weight_decay=0.1)
        torch.manual_seed(SEED)
        batch = torch.randint(0, CFG.vocab_size, (2 * ACC, SEQ + 1))
        ov = model.overlap
        train_step(model, opt, grid, batch, 1, 1.0)  # records the order
        hits, ov.trace = ov.counts["prefetch_hits"], []
        train_step(model, opt, grid, batch, 1, 1.0)
        got[str(ckpt)] = {
            "seq": [[kind, names[id(p)]] for kind, p in ov.trace],
            "hits": ov.counts["prefetch_hits"] - hits,
            "misses": ov.counts.get("prefetch_misses", 0),
        }
    if dist.get_rank() == 0:
        with open(f"{out_dir}/0.json", "w") as fh:
            json.dump(got, fh)


def _planned(ckpt: bool) -> list[list[str]]:
    """The planner's issue order of the same step, ``[kind, layer]``."""
    ctx = StepQuestion(get_model(SPEC), get_machine("perlmutter"), SEQ, 2 * ACC, compute_bytes=4)
    st = make_step(ctx, (1, 2, 1, 1), 1, "full" if ckpt else "none", wrap=True)
    assert st.prefetch and st.async_scatter and st.wrap  # the runtime's overlaps
    _, _, sched = z_stream(st)
    sched.queue.trace = []
    sched.run()
    return [["all_gather" if g else "reduce_scatter", key[0]] for key, g in sched.queue.trace]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    out = tmp_path_factory.mktemp("z_order")
    run_distributed(_worker, 2, 2, str(out))
    return json.loads((out / "0.json").read_text())


@pytest.mark.parametrize("ckpt", [False, True])
def test_runtime_issues_the_planned_z_order(ckpt, runtime):
    got, want = runtime[str(ckpt)], _planned(ckpt)
    assert got["misses"] == 0
    uses = sum(1 for kind, _ in want if kind == "all_gather")
    assert got["hits"] == uses - 1  # all but the step's first weight came prefetched
    assert got["seq"] == want
