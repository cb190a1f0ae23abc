"""The planner's expert-parallel all-to-all traffic (:mod:`tetrad.plan.comm.experts`) equals
what the runtime records (calls, payload bytes, bytes sent) for the same routing counts, on 2
and 4 gloo ranks, skewed routing and a rank that receives nothing included, and for a whole MoE
block on grids whose expert axis spans Z, Y or X ranks (the expert group the consecutive ranks
the step model times)."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.parallel import init_parameters
from tetrad.parallel.experts import ExpertParallelExperts
from tetrad.plan.comm.experts import all_to_all_traffic, uniform_all_to_all_traffic
from tetrad.spec.grid import Axis
from tetrad.spec.overlap import expert_pieces, piece_sizes

E, H, F, K, T = 8, 16, 8, 2, 24


def piece_counts(ids, pieces, n_experts, group=None):
    """Every rank's routing counts per piece of its tokens, as the runtime cuts them:
    ``[n][P][E]`` lists (the expert group's ranks in group order)."""
    n = expert_pieces(ids.shape[0], pieces)
    out = []
    for part in ids.split(piece_sizes(ids.shape[0], n)):
        mine = torch.bincount(part.flatten(), minlength=n_experts)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        out.append([c.tolist() for c in every])
    return out


def traffic_matches(world, skew, pieces):
    grid = Grid.build((world, 1, 1, 1, 1), expert=world)
    experts = ExpertParallelExperts(E, H, F, 0.02, grid, pieces)
    init_parameters(experts, 3, grid)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(T, H, generator=g, requires_grad=True)
    scores = torch.rand(T, E, generator=g)
    if skew:  # every token prefers the first experts: the last rank receives nothing
        scores[:, : E // world] += 10
    weights, ids = torch.topk(scores.softmax(-1), K)
    every = piece_counts(ids, pieces, E)
    for backward in (False, True):
        grid.comm.reset()
        y = experts(x, ids, weights)
        if backward:
            y.backward(torch.randn_like(y))
        got = grid.comm.stats(Axis.EXPERT)
        want = all_to_all_traffic(every, dist.get_rank(), H, 4, backward=backward)
        assert (got.calls, got.payload_bytes, got.bytes) == (
            want.calls,
            want.payload_bytes,
            want.sent_bytes,
        )
        assert want.calls == 1 + len(every) * (4 if backward else 2)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("pieces", [1, 3])
def test_planner_all_to_all_equals_runtime(world, skew, pieces):
    """With and without the ``expert`` overlap (3 pieces of the 24 tokens)."""
    run_distributed(traffic_matches, world, world, skew, pieces)


def test_uniform_estimate():
    p, tokens, h, b = 4, 4096, 4096, 2
    balanced = [[tokens * 2 // 8] * 8 for _ in range(p)]  # top-2 of 8, every expert alike
    exact = all_to_all_traffic([balanced], 0, h, b)
    est = uniform_all_to_all_traffic(tokens, 2, 8, p, h, b)
    assert exact == est and est.calls == 5
    halves = [[[tokens // 8] * 8 for _ in range(p)]] * 2  # two pieces of tokens / 2
    two = uniform_all_to_all_traffic(tokens, 2, 8, p, h, b, pieces=2)
    assert all_to_all_traffic(halves, 0, h, b) == two and two.calls == 9
    assert two.sent_bytes == est.sent_bytes + (8 - 2) * 8  # the rows' bytes, twice the counts
    v = tokens * 2 * h * b * (p - 1) / p  # the fact sheet's V per row all-to-all
    assert est.sent_bytes == 4 * v + (8 - 2) * 8
    skewed = uniform_all_to_all_traffic(tokens, 2, 8, p, h, b, imbalance=1.5)
    assert skewed.sent_bytes > est.sent_bytes and skewed.payload_bytes > est.payload_bytes
    with pytest.raises(ValueError):
        uniform_all_to_all_traffic(tokens, 2, 8, p, h, b, imbalance=0.5)


def tensor_traffic_matches(sizes, ep):
    from tests.test_moe_parallel import CONFIGS
    from tetrad.parallel.model import ParallelLlama
    from tetrad.plan.comm.experts import tensor_token_traffic

    cfg = CONFIGS["sigmoid-bias"]  # no shared expert: the block's X/Y traffic is the MoE's own
    grid = Grid.build(sizes, expert=ep)
    model = ParallelLlama(cfg, grid)
    init_parameters(model, 3, grid)
    block = model.layers["1"].feed_forward
    b, s = 2, 8
    g = torch.Generator().manual_seed(0)  # the same tokens on every rank of the tensor group
    x = torch.randn(b, s, cfg.dim // grid.x, generator=g).requires_grad_()
    for backward in (False, True):
        grid.comm.reset()
        y = block(x)
        if backward:
            y.backward(torch.randn(y.shape, generator=g))
        want = tensor_token_traffic(
            b * s, cfg.dim, 4, grid.y, grid.x, stats=(b * cfg.n_experts * 4, 4), backward=backward
        )
        for axis in ("x", "y"):
            got = grid.comm.stats(axis)
            assert (got.calls, got.payload_bytes, got.bytes) == (
                want[axis].calls,
                want[axis].payload_bytes,
                want[axis].sent_bytes,
            ), (axis, backward)


@pytest.mark.parametrize(
    "world, sizes, ep",
    [
        (2, (1, 1, 1, 2, 1), 1),
        (2, (1, 1, 1, 1, 2), 1),
        (4, (2, 1, 1, 2, 1), 2),
        (4, (1, 1, 1, 2, 2), 1),
    ],
)
def test_planner_tensor_exchanges_equal_runtime(world, sizes, ep):
    """The MoE block's X and Y collectives on tensor grids (split, join, load-balancing
    statistics) equal :func:`tetrad.plan.comm.experts.tensor_token_traffic`."""
    run_distributed(tensor_traffic_matches, world, sizes, ep)


def block_all_to_alls_match(sizes, ep):
    """One MoE block on a grid whose expert axis spans Z, Y or X ranks: each rank routes its
    own tokens (on Y and X its slice of the positions), and the all-to-alls of its expert group
    (``ep`` consecutive ranks) are what :func:`all_to_all_traffic` gives for the group's
    routing counts, the rows of ``T = b s / (G_y G_x)`` tokens as the step model takes them."""
    from tests.test_moe_parallel import CONFIGS
    from tetrad.parallel.model import ParallelLlama

    cfg = CONFIGS["sigmoid-bias"]
    grid = Grid.build(sizes, expert=ep)
    model = ParallelLlama(cfg, grid)
    init_parameters(model, 3, grid)
    block = model.layers["1"].feed_forward
    experts, counts = block.experts, []

    def recording(x, ids, weights):
        counts.append(ids)
        return type(experts).forward(experts, x, ids, weights)

    experts.forward = recording
    group = dist.get_process_group_ranks(grid.group(Axis.EXPERT))
    first = dist.get_rank() // ep * ep
    assert group == list(range(first, first + ep))  # stride 1, as all_to_all_seconds takes it
    b, s = 2, 8
    cell = (grid.coord["data"] * grid.context + grid.coord["context"]) * grid.z + grid.coord["z"]
    g = torch.Generator().manual_seed(cell)  # the same tokens on the ranks of a tensor group
    hx = cfg.dim // grid.x
    whole = torch.randn(b, s, cfg.dim, generator=g)
    x = whole[..., grid.coord["x"] * hx : (grid.coord["x"] + 1) * hx].clone().requires_grad_()
    for backward in (False, True):
        grid.comm.reset()
        counts.clear()
        y = block(x)
        if backward:
            y.backward(torch.randn(y.shape, generator=g))
        (ids,) = counts
        assert ids.numel() == b * s // (grid.y * grid.x) * cfg.top_k
        assert experts.pieces == 2  # the default overlaps' expert pieces
        every = piece_counts(ids, experts.pieces, cfg.n_experts, grid.group(Axis.EXPERT))
        want = all_to_all_traffic(every, grid.coord["expert"], cfg.dim, 4, backward=backward)
        got = grid.comm.stats(Axis.EXPERT)
        assert (got.calls, got.payload_bytes, got.bytes) == (
            want.calls,
            want.payload_bytes,
            want.sent_bytes,
        ), (sizes, ep, backward)


@pytest.mark.parametrize(
    "world, sizes, ep",
    [
        (2, (1, 1, 2, 1, 1), 2),  # z=2,expert=2
        (2, (1, 1, 1, 2, 1), 2),  # y=2,expert=2
        (4, (1, 1, 1, 2, 2), 4),  # y=2,x=2,expert=4
        (4, (2, 1, 2, 1, 1), 4),  # data=2,z=2,expert=4
        (4, (2, 1, 2, 1, 1), 2),  # data=2,z=2,expert=2: groups over Z, expert-data over data
    ],
)
def test_planner_all_to_alls_equal_runtime_with_experts_over_tensor_ranks(world, sizes, ep):
    """Issue 46: the planner's all-to-all calls and bytes equal the runtime's on grids whose
    expert axis spans Z, Y or X ranks (MoE Parallel Folding)."""
    run_distributed(block_all_to_alls_match, world, sizes, ep)
