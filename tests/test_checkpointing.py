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
    # (the q, k and v pieces [b, s, kv_heads, g, d] of the wqkv output count as the output)
    unique = {
        t.untyped_storage().data_ptr(): tuple((t._base if t.dim() == 5 else t).shape) for t in kept
    }
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
