"""The fused GEMM + collective operators against their unfused composition.

Every rank builds every rank's tensors from seeds, so the reference (the collective, then or
after the GEMM, on full tensors) is computed locally; outputs and both gradients must match, for
groups of 1, 2, 4 and 8 ranks, uneven piece counts, and the bytes recorded on the axis must be
those of the plain collective.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tetrad.comm import all_gather, reduce_scatter
from tetrad.comm.fused import _RECV, _SEND, all_gather_matmul, matmul_reduce_scatter
from tetrad.grid import Grid

K, N = 6, 7


def _t(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check(g: int, m: int, chunks: int) -> None:
    grid = Grid.build((1, 1, 1, g))
    r = grid.coord["x"]
    xs = [_t(10 + i, m, K) for i in range(g)]
    ws = [_t(20 + i, N, K) for i in range(g)]
    ys = [_t(30 + i, g * m, K) for i in range(g)]
    up_ag = [_t(40 + i, g * m, N) for i in range(g)]  # upstream gradients of the outputs
    up_rs = [_t(50 + i, m, N) for i in range(g)]
    rows = slice(r * m, (r + 1) * m)

    # all-gather -> GEMM
    x, w = xs[r].clone().requires_grad_(), ws[r].clone().requires_grad_()
    grid.comm.reset()
    out = all_gather_matmul(x, w, grid, "x", chunks)
    fused_bytes = grid.comm.reset().get("x")
    out.backward(up_ag[r])
    full = torch.cat(xs)
    torch.testing.assert_close(out, full @ ws[r].t())
    torch.testing.assert_close(x.grad, sum(up_ag[i] @ ws[i] for i in range(g))[rows])
    torch.testing.assert_close(w.grad, up_ag[r].t() @ full)
    grid.comm.reset()  # the backward's ring
    all_gather(xs[r], grid, "x")
    plain_bytes = grid.comm.reset().get("x")
    if g > 1:
        assert fused_bytes.bytes == plain_bytes.bytes and fused_bytes.calls == 1

    # GEMM -> reduce-scatter
    y, w = ys[r].clone().requires_grad_(), ws[r].clone().requires_grad_()
    out = matmul_reduce_scatter(y, w, grid, "x", chunks)
    fused_bytes = grid.comm.reset().get("x")
    out.backward(up_rs[r])
    torch.testing.assert_close(out, sum(ys[i] @ ws[i].t() for i in range(g))[rows])
    ups = torch.cat(up_rs)
    torch.testing.assert_close(y.grad, ups @ ws[r])
    torch.testing.assert_close(w.grad, ups.t() @ ys[r])
    grid.comm.reset()
    reduce_scatter(ys[r] @ ws[r].t(), grid, "x")
    plain_bytes = grid.comm.reset().get("x")
    if g > 1:
        assert fused_bytes.bytes == plain_bytes.bytes and fused_bytes.calls == 1


def _all_cases(g: int) -> None:
    torch.set_num_threads(1)
    for m, chunks in ((3, 1), (5, 2), (5, 3), (4, 4)):
        _check(g, m, chunks)


@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_fused_operators_equal_their_composition(g):
    run_distributed(_all_cases, g, g)


def test_rows_that_do_not_split_are_refused():
    from tetrad.comm.fused import _pieces

    with pytest.raises(ValueError, match="at least 1"):
        _pieces(4, 0)


def _grouped(g: int) -> None:
    """Every point-to-point op of the rings is posted in a ``batch_isend_irecv`` group of one
    send to the next rank and one receive from the previous (NCCL matches point-to-point calls
    in order and ignores tags: loose ones can deadlock), and the results stay exact."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    batches = []
    real = dist.batch_isend_irecv

    def recording(ops):
        batches.append([(op.op.__name__, op.peer) for op in ops])
        return real(ops)

    def loose(*args, **kwargs):
        raise AssertionError("a ring op was posted outside a batch_isend_irecv group")

    dist.batch_isend_irecv, dist.isend, dist.irecv = recording, loose, loose
    try:
        _check(g, 5, 2)
    finally:
        dist.batch_isend_irecv, dist.isend, dist.irecv = real, _SEND, _RECV
    r = dist.get_rank()
    pair = [("isend", (r + 1) % g), ("irecv", (r - 1) % g)]
    # four rings (two forward, two backward) of g - 1 steps in 2 pieces each
    assert batches == [pair] * (4 * (g - 1) * 2), batches


def test_ring_point_to_point_is_grouped():
    run_distributed(_grouped, 2, 2)
