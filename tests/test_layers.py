"""Each 3D-parallel layer against torch.nn: forward output, input gradient, parameter gradients.

Every rank holds its slice of a single-process reference computation; fp32, tolerance
rtol=1e-5, atol=1e-5 (reduction order differs, nothing else may).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.parallel import (
    Embedding,
    Linear,
    RMSNorm,
    sync_gradients,
    vocab_parallel_cross_entropy,
)
from tetrad.parallel.model import ParallelLlama
from tetrad.spec.grid import GridError
from tetrad.spec.model import ModelSpec

GRIDS = {
    1: [(1, 1, 1, 1)],
    2: [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)],
    4: [(1, 1, 2, 2), (1, 2, 2, 1), (2, 1, 1, 2), (2, 2, 1, 1)],
    8: [(1, 2, 2, 2), (2, 2, 2, 1), (2, 1, 2, 2)],
}
B, S = 8, 3  # batch splits over up to G_data*G_z = 4


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def rows(grid):
    """This rank's samples of the global batch."""
    n = B // grid.batch_shards
    return slice(grid.batch_rank * n, (grid.batch_rank + 1) * n)


def cols(grid, axis, size):
    n = size // grid.size(axis)
    return slice(grid.coord[axis] * n, (grid.coord[axis] + 1) * n)


def check_linear(grid, transpose, bias):
    k, n = 16, 32
    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=bias)
    if bias:
        nn.init.normal_(ref.bias)
    x = torch.randn(B, S, k, requires_grad=True)
    r = torch.randn(B, S, n)
    (ref(x) * r).sum().backward()

    layer = Linear(k, n, grid, transpose=transpose, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.placement.shard_of(ref.weight, grid))
        if bias:
            layer.bias.copy_(layer.bias.placement.shard_of(ref.bias, grid))
    i, o = (cols(grid, layer.in_axis, k), cols(grid, layer.out_axis, n))
    xl = x.detach()[rows(grid)][..., i].requires_grad_()
    y = layer(xl)
    close(y, ref(x).detach()[rows(grid)][..., o], f"Linear(transpose={transpose}) output")
    (y * r[rows(grid)][..., o]).sum().backward()
    sync_gradients(layer, grid)
    close(xl.grad, x.grad[rows(grid)][..., i], "Linear input grad")
    close(
        layer.weight.grad,
        layer.weight.placement.shard_of(ref.weight.grad, grid),
        "Linear weight grad",
    )
    if bias:
        close(
            layer.bias.grad,
            layer.bias.placement.shard_of(ref.bias.grad, grid),
            "Linear bias grad",
        )


def check_embedding(grid):
    v, h = 32, 16
    torch.manual_seed(1)
    ref = nn.Embedding(v, h)
    ids = torch.randint(0, v, (B, S))
    r = torch.randn(B, S, h)
    (ref(ids) * r).sum().backward()
    layer = Embedding(v, h, grid)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.placement.shard_of(ref.weight, grid))
    c = cols(grid, "x", h)
    out = layer(ids[rows(grid)])
    close(out, ref(ids).detach()[rows(grid)][..., c], "Embedding output")
    (out * r[rows(grid)][..., c]).sum().backward()
    sync_gradients(layer, grid)
    close(
        layer.weight.grad,
        layer.weight.placement.shard_of(ref.weight.grad, grid),
        "Embedding weight grad",
    )


def check_cross_entropy(grid):
    v = 32
    torch.manual_seed(2)
    logits = torch.randn(B, S, v, requires_grad=True)
    targets = torch.randint(0, v, (B, S))
    w = torch.rand(B, S)
    ref = F.cross_entropy(logits.view(-1, v), targets.view(-1), reduction="none").view(B, S)
    (ref * w).sum().backward()
    c = cols(grid, "y", v)
    ll = logits.detach()[rows(grid)][..., c].requires_grad_()
    loss = vocab_parallel_cross_entropy(ll, targets[rows(grid)], grid, "y")
    close(loss, ref.detach()[rows(grid)], "cross-entropy loss")
    (loss * w[rows(grid)]).sum().backward()
    close(ll.grad, logits.grad[rows(grid)][..., c], "cross-entropy logits grad")


def check_rmsnorm(grid):
    h = 16
    torch.manual_seed(3)
    ref = nn.RMSNorm(h, eps=1e-5)
    nn.init.normal_(ref.weight)
    x = torch.randn(B, S, h, requires_grad=True)
    r = torch.randn(B, S, h)
    (ref(x) * r).sum().backward()
    layer = RMSNorm(h, grid, "x", eps=1e-5)
    c = cols(grid, "x", h)
    with torch.no_grad():
        layer.weight.copy_(ref.weight[c])
    xl = x.detach()[rows(grid)][..., c].requires_grad_()
    y = layer(xl)
    close(y, ref(x).detach()[rows(grid)][..., c], "RMSNorm output")
    (y * r[rows(grid)][..., c]).sum().backward()
    sync_gradients(layer, grid)
    close(xl.grad, x.grad[rows(grid)][..., c], "RMSNorm input grad")
    close(layer.weight.grad, ref.weight.grad[c], "RMSNorm weight grad")


def check_model_sizes(grid):
    """A model whose KV heads do not split over G_y is refused with what to change (not a
    reshape error from deep inside attention)."""
    cfg = ModelSpec(dim=32, n_layers=1, n_heads=4, n_kv_heads=1, ffn_dim=64, vocab_size=64)
    with pytest.raises(GridError, match=f"n_kv_heads=1 divisible by G_y={grid.y}"):
        ParallelLlama(cfg, grid)


def all_layers(world_size):
    for sizes in GRIDS[world_size]:
        grid = Grid.build(sizes)
        if grid.y > 1:
            check_model_sizes(grid)
        for transpose in (False, True):
            for bias in (False, True):
                check_linear(grid, transpose, bias)
        check_embedding(grid)
        check_cross_entropy(grid)
        check_rmsnorm(grid)


@pytest.mark.parametrize("world_size", sorted(GRIDS))
def test_layers_match_torch_nn(world_size):
    run_distributed(all_layers, world_size, world_size)


def test_fp32_accumulating_gemm_probe():
    """The bf16 GEMM that adds into an fp32 gradient is used only where torch runs it: never on
    the CPU (no kernel); on a GPU, when the probe says yes, it equals the fp32 sum on a full-size
    block (the other way, the separate add, is what the model tests check)."""
    from tetrad.parallel.linear import adds_into_fp32

    assert adds_into_fp32(torch.device("cpu"), torch.bfloat16) is False
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    if not adds_into_fp32(dev, torch.bfloat16):
        pytest.skip("this torch has no fp32-output addmm for bf16 on CUDA")
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(512, 1024, device=dev, generator=g).bfloat16()
    b = torch.randn(1024, 256, device=dev, generator=g).bfloat16()
    have = torch.randn(512, 256, device=dev, generator=g)
    want = have + a.float() @ b.float()
    torch.addmm(have, a, b, out_dtype=torch.float32, out=have)
    torch.testing.assert_close(have, want, rtol=1e-3, atol=1e-2)
