"""The ``context`` overlap's schedule (tetrad/parallel/context.py): the K/V all-gather in pieces,
each piece's attention between the arrivals of the next ones, and in backward every piece's
gradient reduce-scatter issued before the first one is waited for, each but the last followed by
another piece's attention backward. Equivalence with the reference is in
tests/test_model.py::test_context_parallel_matches_reference (every overlap, and none)."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.spec.overlap import context_pieces


@pytest.mark.parametrize(
    "b, kvh, most, want",
    [(1, 8, 8, (1, 8)), (1, 1, 8, (1, 1)), (4, 1, 8, (4, 1)), (2, 2, 8, (2, 2)), (3, 8, 4, (1, 4))],
)
def test_piece_rule(b, kvh, most, want):
    assert context_pieces(b, kvh, most) == want


class _Tag(torch.autograd.Function):
    """Identity that logs ``name`` when its gradient passes (after the consumer's backward)."""

    @staticmethod
    def forward(ctx, t, log, name):
        ctx.log, ctx.name = log, name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append(ctx.name)
        return g, None, None


def _schedule_worker(out_dir: str) -> None:
    import tetrad.parallel.context as context
    from tetrad.comm.collectives import Handle

    log: list[str] = []
    real_ag, real_rs, real_wait = context.all_gather, context.reduce_scatter, Handle.wait
    real_sdpa = F.scaled_dot_product_attention

    def ag(*a, **k):
        log.append("gather")
        return real_ag(*a, **k)

    def rs(*a, **k):
        log.append("scatter")
        return real_rs(*a, **k)

    def wait(self):
        log.append("wait")
        return real_wait(self)

    class _F:
        @staticmethod
        def scaled_dot_product_attention(q, k, v, **kw):
            log.append("attention")
            return real_sdpa(_Tag.apply(q, log, "attention_bwd"), k, v, **kw)

    context.all_gather, context.reduce_scatter, context.F = ag, rs, _F
    Handle.wait = wait
    grid = Grid.build((1, 2, 1, 1, 1), "cpu")
    attn = context.ContextAttention(grid, pieces=4)
    g = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(2, 4, 8, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 8, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 8, 16, generator=g, requires_grad=True)
    attend = attn.attend_to(k, v)  # as the model calls it: keys and values before the queries
    log.append("queries")
    out = attend(_Tag.apply(q * 2.0, log, "queries_bwd"))  # the queries' RoPE, say
    log.append("backward")
    out.sum().backward()
    with open(f"{out_dir}/{dist.get_rank()}.json", "w") as fh:
        json.dump(log, fh)


def test_pieces_overlap_attention(tmp_path):
    """b = 2 samples and 2 KV heads: 4 pieces; forward issues the 4 gathers before the queries
    are formed and runs each piece's two chunk attentions right after its arrival; backward
    issues the 4 scatters, each right after a piece's attention backward, and waits for them
    only after the last and after the queries' backward."""
    run_distributed(_schedule_worker, 2, str(tmp_path))
    for r in range(2):
        log = json.loads((tmp_path / f"{r}.json").read_text())
        fwd, bwd = log[: log.index("backward")], log[log.index("backward") + 1 :]
        assert fwd == ["gather"] * 4 + ["queries"] + ["wait", "attention", "attention"] * 4, fwd
        piece = ["attention_bwd", "attention_bwd", "scatter"]
        assert bwd == piece * 4 + ["queries_bwd"] + ["wait"] * 4, bwd


def test_model_gives_keys_and_values_before_rotating_the_queries(monkeypatch):
    """The Llama block calls its layers' ``attend_to(k, v)`` before the queries' RoPE, and
    autograd runs the queries' RoPE backward before the backward of ``attend_to``'s launch
    (its collectives' waits under context parallelism)."""
    from tetrad.models import llama
    from tetrad.models.reference import Llama
    from tetrad.parallel import init_parameters
    from tetrad.spec.presets import get_model

    log: list[str] = []
    real_rotate, real_attend = llama.Attention._rotated_queries, llama.attend_causally_to

    def rotate(self, *a):
        log.append("queries")
        return _Tag.apply(real_rotate(self, *a), log, "queries_bwd")

    def attend_to(self, k, v):
        log.append("attend_to")
        attend = real_attend(_Tag.apply(k, log, "keys_bwd"), v)
        return lambda q: attend(q)

    monkeypatch.setattr(llama.Attention, "_rotated_queries", rotate)
    model = Llama(get_model("tiny"), device="cpu")
    init_parameters(model, seed=0)
    for block in model.layers.values():
        block.attention.attend_to = attend_to.__get__(block.attention)
    tokens = torch.randint(0, 64, (1, 9))
    loss = model.loss_sum(tokens[:, :-1], tokens[:, 1:])
    assert log[:2] == ["attend_to", "queries"], log
    log.clear()
    loss.backward()
    assert log[:2] == ["queries_bwd", "keys_bwd"], log


def _equivalence_worker(out_dir: str, sizes: tuple, dtype: str, bias: bool = False) -> None:
    """Context attention on ``sizes`` with 1 and 4 pieces against causal SDPA over the whole
    sequence on one rank: outputs and q/k/v gradients of this rank's tokens. ``bias``: with
    the masks CUDA uses (lower-right ``CausalBias``, which torch materialises on the CPU)."""
    from tetrad.parallel import context
    from tetrad.parallel.context import ContextAttention, split_sequence

    if bias:
        context.lower_right_bias = lambda device: True

    grid = Grid.build(sizes, "cpu")
    g = torch.Generator().manual_seed(11)
    b, heads, kvh, S, d = 2, 4 // grid.y, 2 // grid.y, 16, 8
    full = [torch.randn(b, h, S, d, generator=g) for h in (heads, kvh, kvh)]
    dout = torch.randn(b, heads, S, d, generator=g)
    ref = [t.clone().requires_grad_() for t in full]
    want = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    (want * dout).sum().backward()
    want = want.detach()

    def local(t):  # [b, h, S, d] -> this rank's tokens [b, h, s, d]
        return split_sequence(t.transpose(1, 2), grid).transpose(1, 2)

    worst = {}
    for pieces in (1, 4):
        mine = [local(t).detach().requires_grad_() for t in full]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            out = ContextAttention(grid, pieces)(*mine)
        (out.float() * local(dout)).sum().backward()
        pairs = [(out, local(want))]
        pairs += [(t.grad, local(r.grad)) for t, r in zip(mine, ref, strict=True)]
        worst[pieces] = max((a.float() - w).abs().max().item() for a, w in pairs)
    with open(f"{out_dir}/{dist.get_rank()}.json", "w") as fh:
        json.dump(worst, fh)


@pytest.mark.parametrize(
    "sizes, dtype",
    [
        ((1, 2, 1, 1, 1), "fp32"),
        ((1, 4, 1, 1, 1), "fp32"),
        ((1, 2, 1, 2, 1), "fp32"),
        ((1, 2, 1, 1, 1), "bf16"),
        ((1, 4, 1, 1, 1), "bias"),
        ((1, 2, 1, 2, 1), "bias"),
    ],
)
def test_pieces_equal_whole_sequence_attention(tmp_path, sizes, dtype):
    """Output and q/k/v gradients of this rank's tokens equal causal SDPA over the whole
    sequence (fp32: to 1e-5; CPU bf16 autocast: to 0.05, bf16 rounding of values ~1), with the
    blocking all-gather and with pieces; ``bias``: fp32 with CUDA's lower-right
    ``CausalBias`` masks (grouped-query heads on both grids)."""
    world = sizes[1] * sizes[3]
    bias = dtype == "bias"
    dtype = "fp32" if bias else dtype
    run_distributed(_equivalence_worker, world, str(tmp_path), sizes, dtype, bias)
    tol = 1e-5 if dtype == "fp32" else 5e-2
    for r in range(world):
        worst = json.loads((tmp_path / f"{r}.json").read_text())
        assert all(w < tol for w in worst.values()), (r, worst)
