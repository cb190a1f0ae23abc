"""Initialisation: models built on meta, each rank drawing its own shards where they live.

- the generator (:func:`tetrad.parallel.placement.normal_slice`) against its definition in
  Python integers, block by block and chunk by chunk (bit-equal), and its statistics;
- the same weights on every grid: nine grids, dense ones with data, context, Y, X, Z and a
  pipeline, MoE ones with and without expert parallelism, every shard equal to the reference
  model's slice;
- memory: construction makes only meta tensors and then exactly this rank's shards, and the
  initialisation's temporaries are at most half a shard.
"""

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.models.llama import Transformer
from tetrad.models.reference import Llama, PlainLayers
from tetrad.parallel import init_parameters
from tetrad.parallel import placement as pl
from tetrad.parallel.model import ParallelLlama
from tetrad.spec.presets import PRESETS

SEED = 11
MASK = (1 << 32) - 1
MOE = dataclasses.replace(PRESETS["moe-tiny"], router_score="sigmoid", bias_update_rate=0.01)


def lowbias32(x: int) -> int:
    """C. Wellons's lowbias32 on a Python integer (the definition the int32 code must meet)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK
    return x ^ (x >> 16)


def expected(seed: int, name: str, shape: tuple[int, ...], index: tuple[int, ...], std: float):
    """One element of the global tensor, from the definition in ``normal_slice``'s docstring."""
    r = sum(i * math.prod(shape[d + 1 : -1]) for d, i in enumerate(index[:-1]))
    k0, k1, k2, k3 = (k & MASK for k in pl._keys(seed, name))
    h = lowbias32(lowbias32(lowbias32(r ^ k0) ^ k1) ^ lowbias32(lowbias32(index[-1] ^ k2) ^ k3))
    signed = h - (1 << 32) if h >> 31 else h
    v = torch.tensor(float(signed), dtype=torch.float32) * pl._TO_UNIT
    return torch.erfinv(v) * (std * math.sqrt(2.0))


def test_mixer_is_lowbias32_on_every_int32():
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x12345678, 0xDEADBEEF]
    values += torch.randint(0, 1 << 32, (997,), generator=torch.Generator().manual_seed(0)).tolist()
    signed = [v - (1 << 32) if v >> 31 else v for v in values]
    got = pl._mix(torch.tensor(signed, dtype=torch.int32)).tolist()
    assert [g & MASK for g in got] == [lowbias32(v) for v in values]


def test_elements_follow_the_definition():
    shape = (3, 5, 70)
    full = pl.normal_slice(SEED, "layers.0.experts.w1", shape, (), 0.02)
    assert full.shape == shape and full.dtype == torch.float32
    for index in [(0, 0, 0), (2, 4, 69), (1, 3, 17), (0, 4, 1), (2, 0, 33)]:
        assert torch.equal(full[index], expected(SEED, "layers.0.experts.w1", shape, index, 0.02))


@pytest.mark.parametrize("chunk", [7, 64, 1 << 16])
def test_blocks_and_chunks_equal_the_whole(monkeypatch, chunk):
    """Any block, drawn in any chunking (rows at a time, or pieces of a row), is the whole
    tensor's block, bit for bit; so is a float64 or bf16 destination, rounded."""
    shape, name = (6, 10, 48), "w"
    whole = pl.normal_slice(3, name, shape, (), 0.1)
    monkeypatch.setitem(pl.CHUNK_ELEMENTS, "cpu", chunk)
    for block in [
        (slice(0, 6), slice(0, 10), slice(0, 48)),
        (slice(2, 5),),
        (slice(1, 2), slice(3, 9), slice(13, 40)),
        (slice(5, 6), slice(9, 10), slice(47, 48)),
    ]:
        assert torch.equal(pl.normal_slice(3, name, shape, block, 0.1), whole[block])
    out = torch.empty(6, 10, 48, dtype=torch.float64)
    assert torch.equal(pl.normal_slice(3, name, shape, (), 0.1, out=out), whole.double())
    out = torch.empty(6, 10, 48, dtype=torch.bfloat16)
    assert torch.equal(pl.normal_slice(3, name, shape, (), 0.1, out=out), whole.bfloat16())
    assert torch.equal(
        pl.normal_slice(3, name, (48,), (slice(8, 20),), 1.0),
        pl.normal_slice(3, name, (48,), (), 1.0)[8:20],
    )


TINY = PRESETS["tiny"]


def test_cpu_threads_draw_the_same_values(monkeypatch):
    """With several torch threads (chunks of ``CHUNK_ELEMENTS`` per thread, each operation
    shared by the threads): the same values."""
    shape = (64, 3000)
    whole = pl.normal_slice(5, "w", shape, (), 0.02)
    monkeypatch.setitem(pl.CHUNK_ELEMENTS, "cpu", 1000)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = pl.normal_slice(5, "w", shape, (slice(3, 60), slice(100, 2900)), 0.02)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, whole[3:60, 100:2900])
    one, three = Llama(TINY), Llama(TINY)
    init_parameters(one, SEED)
    torch.set_num_threads(3)
    try:
        init_parameters(three, SEED)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one.parameters(), three.parameters(), strict=True):
        assert torch.equal(a, b)


def test_statistics():
    """One ``[512, 4096]`` draw (2M values): mean, std, tails, kurtosis, the CDF (Kolmogorov-
    Smirnov) and the correlations of rows, columns and neighbours, each to about 4 standard
    errors; other names and seeds draw other values; a second draw is equal."""
    std, rows, cols = 0.02, 512, 4096
    w = pl.normal_slice(SEED, "layers.3.feed_forward.w13.weight", (rows, cols), (), std)
    n = w.numel()
    z = (w / std).double().flatten()
    assert abs(z.mean().item()) < 4 / math.sqrt(n)
    assert abs(z.std().item() - 1) < 4 / math.sqrt(2 * n)
    assert abs((z**4).mean().item() - 3) < 4 * math.sqrt(96 / n)
    for k, p in ((1, 0.3173), (2, 0.0455), (3, 0.0027)):
        frac = (z.abs() > k).double().mean().item()
        assert abs(frac - p) < 4 * math.sqrt(p / n) + 1e-4, (k, frac)
    assert z.abs().max().item() < 5.5
    ks = (torch.special.ndtr(z.sort().values) - (torch.arange(n) + 0.5) / n).abs().max().item()
    assert ks < 1.95 / math.sqrt(n)  # 0.1% level
    zz = (w / std).double()
    row_corr = torch.corrcoef(zz)[~torch.eye(rows, dtype=torch.bool)]
    col_corr = torch.corrcoef(zz[:, :512].T)[~torch.eye(512, dtype=torch.bool)]
    assert row_corr.abs().max().item() < 6 / math.sqrt(cols)
    assert col_corr.abs().max().item() < 6.5 / math.sqrt(rows)
    assert abs(row_corr.std().item() * math.sqrt(cols) - 1) < 0.05
    for a, b in ((zz[:, 1:], zz[:, :-1]), (zz[1:], zz[:-1])):
        assert abs((a * b).mean().item()) < 4 / math.sqrt(a.numel())
    other = [
        pl.normal_slice(SEED, "layers.3.feed_forward.w2.weight", (rows, cols), (), std),
        pl.normal_slice(SEED + 1, "layers.3.feed_forward.w13.weight", (rows, cols), (), std),
    ]
    for o in other:
        assert abs(torch.corrcoef(torch.stack([w.flatten(), o.flatten()]))[0, 1]) < 4 / math.sqrt(n)
    again = pl.normal_slice(SEED, "layers.3.feed_forward.w13.weight", (rows, cols), (), std)
    assert torch.equal(w, again)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_the_cpu_values():
    """On a GPU: the integer bits equal the CPU's and the values agree to float32 ``erfinv``'s
    accuracy (H200, torch 2.11: 68% bit-equal, at most 4 ulps and 7.5e-7 std apart)."""
    shape, block = (4096, 3000), (slice(100, 3000), slice(17, 2999))
    cpu = pl.normal_slice(SEED, "w", shape, block, 0.02)
    gpu = pl.normal_slice(SEED, "w", shape, block, 0.02, device="cuda")
    x = torch.randint(-(1 << 31), 1 << 31, (100_000,), dtype=torch.int32)
    assert torch.equal(pl._mix(x.clone()), pl._mix(x.cuda()).cpu())
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=2e-6 * 0.02)


# -- the same weights on every grid ---------------------------------------------------------


def same_weights(cases) -> None:
    """On each ``(cfg, pipe, sizes, G_expert)``: every shard this rank initialises equals the
    reference model's slice, bit for bit."""
    from tetrad.pipeline.schedule import Pipeline

    for cfg, pipe, sizes, ep in cases:
        ref = Llama(cfg)
        init_parameters(ref, SEED)
        want = dict(ref.named_parameters())
        grid = Grid.build(sizes, pipe=pipe, expert=ep)
        if pipe > 1:
            parts = list(Pipeline(cfg, grid, "1f1b", 1, 2).parts)
        else:
            parts = [ParallelLlama(cfg, grid)]
        seen = 0
        for part in parts:
            init_parameters(part, SEED, grid)
            for name, p in part.named_parameters():
                expected = p.placement.shard_of(want[name], grid)
                assert torch.equal(p.detach(), expected), (sizes, pipe, ep, name)
                seen += 1
        assert seen > 0


def test_same_weights_on_every_grid():
    run_distributed(same_weights, 1, [(TINY, 1, (1, 1, 1, 1), 1)])
    two = [(TINY, 1, (2, 1, 1, 1), 1), (TINY, 1, (1, 2, 1, 1, 1), 1), (MOE, 1, (2, 1, 1, 1), 2)]
    run_distributed(same_weights, 2, two)
    four = [
        (TINY, 1, (1, 2, 1, 2), 1),
        (TINY, 1, (1, 1, 2, 2), 1),
        (TINY, 2, (1, 1, 1, 2), 1),
        (MOE, 1, (2, 1, 2, 1, 1), 2),
        (MOE, 1, (1, 1, 2, 2), 1),
    ]
    run_distributed(same_weights, 4, four)


# -- memory -------------------------------------------------------------------------------


class Allocations(TorchDispatchMode):
    """Records the bytes of every new storage an operation returns (not views, not the
    parameters' own storages written in place), by device type."""

    def __init__(self, known=()):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.made: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and a.device.type != "meta"
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if t.device.type == "meta":
                self.made.append((str(func), "meta", 0))
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in inputs and ptr not in self.known:
                self.made.append((str(func), t.device.type, t.untyped_storage().nbytes()))
        return out


def bounded_memory() -> None:
    grid = Grid.build((1, 2, 1, 2))
    cfg = dataclasses.replace(TINY, dim=128, ffn_dim=512, vocab_size=512)
    with Allocations() as build:
        model = ParallelLlama(cfg, grid)
    params = list(model.parameters())
    local = [p.numel() * p.element_size() for p in params]
    real = [b for _, dev, b in build.made if dev == "cpu"]
    # construction: meta tensors, then exactly this rank's shards (no full tensor anywhere)
    assert sum(1 for _, dev, _ in build.made if dev == "meta") >= len(params)
    assert sorted(b for b in real if b) == sorted(local)
    assert sum(local) < sum(math.prod(p.placement.shape) * p.element_size() for p in params) / 3
    with Allocations(params) as init:
        init_parameters(model, SEED, grid)
    temps = [b for _, dev, b in init.made if dev == "cpu"]
    # the chunk buffers: two int32 buffers of at most half the largest shard each
    assert temps and max(temps) <= max(local) // 2


def test_construction_on_meta_and_bounded_init_buffers():
    run_distributed(bounded_memory, 4)


def test_materialize_keeps_objects_attributes_and_buffers():
    """A meta-built reference model equals one built off meta in buffers (the MoE router's
    zeros); materialising keeps each parameter object with its init rule."""
    built = Transformer(MOE, PlainLayers())  # off meta, as the model code writes it
    model = Llama(MOE)
    assert dict(built.named_buffers()).keys() == dict(model.named_buffers()).keys()
    for (name, b), (_, m) in zip(built.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(b, m) and m.device.type == "cpu", name
    meta = Llama(MOE, device="meta")
    before = {n: p for n, p in meta.named_parameters()}
    assert all(p.is_meta for p in before.values())
    init_parameters(meta, SEED)
    for n, p in meta.named_parameters():
        assert p is before[n] and not p.is_meta
    assert meta.layers["1"].feed_forward.experts.w2.init[0] == "normal"
