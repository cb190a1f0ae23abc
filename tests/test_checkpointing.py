"""Selective activation checkpointing (tetrad/models/recompute.py): the same numbers as the
reference, nothing recomputed but the cheap element-wise parts, and the tagged tensors not kept.

Saved bytes against the planner's model: tests/test_memory_validation.py.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_model import CFG, parallel_runs, reference_run
from tetrad.models import recompute
from tetrad.models.reference import Llama
from tetrad.parallel import init_parameters
from tetrad.spec.overlap import OVERLAPS


@pytest.fixture(scope="module")
def reference():
    return reference_run()


def test_selective_matches_reference(reference):
    """Three 4-rank grids (X, Y, Z and data), every overlap and none: the tolerances of
    tests/test_model.py."""
    grids = [(1, 1, 2, 2), (2, 1, 1, 2), (1, 2, 2, 1)]
    run_distributed(parallel_runs, 4, 4, *reference, "selective", (OVERLAPS, ()), grids)


# with context parallelism: tests/test_model.py::test_context_parallel_matches_reference


def _grads(mode: str, autocast: bool) -> tuple[torch.Tensor, dict, list]:
    torch.manual_seed(0)
    model = Llama(CFG, mode)
    init_parameters(model, 1)
    tokens = torch.randint(0, CFG.vocab_size, (2, 17))
    kept: list[torch.Tensor] = []
    recompute.observer = kept.append
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model.loss_sum(tokens[:, :-1], tokens[:, 1:])
    finally:
        recompute.observer = None
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kept


@pytest.mark.parametrize("autocast", [False, True])
def test_selective_gives_the_same_gradients_in_one_process(autocast):
    """The reference model (torch.nn layers): RoPE, SwiGLU and the head merge go through
    ``cheap``; the loss and every gradient equal the ``none`` mode's bit for bit."""
    loss, grads, kept_none = _grads("none", autocast)
    loss_s, grads_s, kept = _grads("selective", autocast)
    assert not kept_none  # the observer only sees selective mode's pack hook
    assert torch.equal(loss, loss_s)
    for name, g in grads.items():
        assert torch.equal(g, grads_s[name]), name
    # kept per block (unique storages): one wqkv output [b, s, (a + 2k) d] (RoPE's and the value
    # copy's input), one w13 output [b, s, 2f] (SwiGLU's input), SDPA's output; not kept: rotated
    # q [b, a, s, d] (only SDPA's output has that shape), rotated k or the value copy
    # [b, k, s, d], the SwiGLU product [b, s, f] (the shape of the wqkv output for this model)
    unique = {t.untyped_storage().data_ptr(): tuple(t.shape) for t in kept}
    shapes = list(unique.values())
    b, s, hd, n = 2, 16, CFG.head_dim, CFG.n_layers
    assert (CFG.n_heads + 2 * CFG.n_kv_heads) * hd == CFG.ffn_dim
    assert shapes.count((b, s, CFG.ffn_dim)) == n and shapes.count((b, s, 2 * CFG.ffn_dim)) == n
    assert shapes.count((b, CFG.n_heads, s, hd)) == n
    assert shapes.count((b, CFG.n_kv_heads, s, hd)) == 0


def test_cheap_outside_selective_is_a_plain_call():
    x = torch.randn(3, requires_grad=True)
    y = recompute.cheap(torch.sin, x)
    assert not hasattr(y, "_tetrad_recipe") and y.grad_fn.name() == "SinBackward0"


def test_selective_runs_each_cheap_function_twice():
    """Once in forward, once in backward: the rebuild for the consumer (here a matmul saving its
    input) records the graph that the cheap function's own backward then differentiates."""
    calls = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t.sin()

    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 2, requires_grad=True)
    with recompute.selective():
        y = recompute.cheap(fn, x) @ w
    y.sum().backward()
    assert len(calls) == 2
    torch.testing.assert_close(x.grad, torch.ones(4, 2) @ w.detach().T * x.detach().cos())


def _compiled_modes_worker() -> None:
    """One rank: the forward of a ``selective`` model, then of a ``none`` model built alike, with
    the blocks compiled, in this one process; no cheap function, nor the helper that runs it,
    compiled as a frame of its own."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from tetrad.grid import Grid
    from tetrad.models.llama import Attention, swiglu
    from tetrad.parallel.batch import inputs_targets, local_samples
    from tetrad.parallel.model import ParallelLlama, compile_blocks
    from tetrad.parallel.norm import normalise

    torch.set_num_threads(1)
    grid = Grid.build((1, 1, 1, 1))
    batch = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    tokens, targets = inputs_targets(local_samples(batch, grid), grid)
    losses = []
    for mode in ("selective", "none"):
        model = ParallelLlama(CFG, grid, mode)
        init_parameters(model, 1, grid)
        compile_blocks(model)
        losses.append(model.loss_sum(tokens, targets).detach())
    torch.testing.assert_close(losses[0], losses[1])
    own_frames = [recompute.cheap, recompute._plain, swiglu, normalise, Attention._merge_heads]
    own_frames += [Attention._rotated_queries, Attention._rotated_keys, Attention._values]
    compiled = {f.__name__: len(_debug_get_cache_entry_list(f.__code__)) for f in own_frames}
    assert not any(compiled.values()), f"compiled as frames of their own: {compiled}"


def test_compiled_blocks_compile_no_frame_per_cheap_function():
    """Dynamo inlines the cheap functions into the blocks' graphs (``none``) or breaks the graph
    at the eager recomputation (``selective``), in the calling frame, guarded on the mode: no
    frame of its own compiled once per function (torch 2.13 went past its recompile limit; torch
    2.11 gave the keys the queries' graph), neither in selective mode nor in a ``none`` model
    after it (which reused the selective blocks' entries)."""
    run_distributed(_compiled_modes_worker, 1)
