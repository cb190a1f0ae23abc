"""SwiGLU's gate on the stacked projection's ``[gate, up]`` blocks (:mod:`tetrad.models.swiglu`):
autograd's numbers bit for bit, without the zero-filled tensors indexing gives backward, and
traced whole by torch.compile."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tetrad.models.swiglu import swiglu


def plain(gate_up: torch.Tensor, pieces: int = 1) -> torch.Tensor:
    pairs = gate_up.unflatten(-1, (pieces, 2, -1))
    return (F.silu(pairs[..., 0, :]) * pairs[..., 1, :]).flatten(-2)


FILLING = ("zeros", "zero_", "fill_", "new_zeros", "select_backward", "slice_backward")


class Fills(TorchDispatchMode):
    """Counts the aten ops that fill a tensor with zeros (``zeros``, ``zero_``, ``fill_``, and
    the backward of indexing, which fills a tensor of the input's size inside)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._overloadpacket.__name__ in FILLING
        return func(*args, **(kwargs or {}))


def _run(f, x: torch.Tensor, g: torch.Tensor, autocast: bool):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = f(x @ torch.eye(x.shape[-1], dtype=x.dtype))  # a GEMM upstream, as w13
    with Fills() as fills:
        y.backward(g.to(y.dtype))
    return y, x.grad, fills.count


@pytest.mark.parametrize("pieces", [1, 4])
@pytest.mark.parametrize(
    "dtype, autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]
)
def test_swiglu_is_autograds_without_zero_fills(dtype, autocast, pieces):
    torch.manual_seed(0)
    x, g = torch.randn(3, 17, 64, dtype=dtype), torch.randn(3, 17, 32)
    y_ref, dx_ref, fills_ref = _run(lambda t: plain(t, pieces), x, g, autocast)
    y, dx, fills = _run(lambda t: swiglu(t, pieces), x, g, autocast)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert fills_ref > 0 and fills == 0  # indexing's backward fills; ours writes each once


def test_swiglu_reads_gate_then_up():
    """One piece: ``[gate, up]``; two: ``[gate_0, up_0, gate_1, up_1]``, a Z piece each."""
    gate, up = torch.randn(5, 8), torch.randn(5, 8)
    want = F.silu(gate) * up
    torch.testing.assert_close(swiglu(torch.cat([gate, up], -1)), want)
    halves = [t.chunk(2, -1) for t in (gate, up)]
    two = torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], -1)
    torch.testing.assert_close(swiglu(two, 2), want)


def test_swiglu_keeps_only_its_input():
    """Backward rebuilds ``silu(gate)``: the only tensor saved is the ``[..., 2f]`` input."""
    x = torch.randn(2, 8, 32, requires_grad=True)
    gate_up = x * 1.0  # a non-leaf, as the w13 output
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gate_up)
    assert [tuple(t.shape) for t in saved] == [(2, 8, 32)]


def test_swiglu_compiles_whole():
    """Under torch.compile the plain expression is traced (Inductor fuses it): no graph
    break, the same numbers as eager."""
    torch.manual_seed(0)
    x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 16)
    y_ref, dx_ref, _ = _run(swiglu, x, g, False)
    y, dx, _ = _run(torch.compile(swiglu, fullgraph=True, backend="aot_eager"), x, g, False)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)
