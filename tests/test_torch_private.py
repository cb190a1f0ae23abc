"""tetrad/torch_private.py: each private torch API it wraps does what tetrad relies on.

``make test-torch-min`` runs this file (with the pipeline tests that drive a
:class:`~tetrad.torch_private.LeanRecvStage`) on the minimum torch of ``pyproject.toml``;
``make test`` runs it on the installed one.
"""

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.distributed import run_distributed
from tetrad.spec.toml import tomllib
from tetrad.torch_private import (
    SHAPES_INFERRED_BY_A_REAL_STEP,
    LeanRecvStage,
    dynamo_counts,
    flatten_mesh,
    foreach_copy_,
    foreach_mul_,
    foreach_norm,
    layout_mesh,
    lower_right_causal,
)


def test_foreach_kernels_equal_per_tensor_ops():
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    for n, t in zip(foreach_norm(ts), ts, strict=True):
        torch.testing.assert_close(n, t.norm())
    scaled = [t.clone() for t in ts]
    foreach_mul_(scaled, torch.tensor(0.5))
    for s, t in zip(scaled, ts, strict=True):
        torch.testing.assert_close(s, t * 0.5)
    targets = [torch.zeros_like(t, dtype=torch.bfloat16) for t in ts]
    foreach_copy_(targets, ts)
    for s, t in zip(targets, ts, strict=True):
        assert s.dtype == torch.bfloat16 and torch.equal(s, t.to(torch.bfloat16))


def test_dynamo_counts_count_graphs_and_breaks():
    before = dynamo_counts()

    @torch.compile(backend="eager")
    def f(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    f(torch.ones(3))
    after = dynamo_counts()
    assert after["graphs"] >= before["graphs"] + 2  # one graph each side of the break
    assert after["graph_breaks"] >= before["graph_breaks"] + 1


def _flatten() -> None:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "context"))
    flat = flatten_mesh(mesh, ("data", "context"), "data_context")
    group = flat.get_group()
    assert dist.get_process_group_ranks(group) == [0, 1, 2, 3]
    assert flat.get_local_rank() == rank  # row-major: data major, context minor
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    assert t.item() == 6.0


def test_flatten_mesh_is_one_group_over_both_dimensions():
    run_distributed(_flatten, 4)


def _layout() -> None:
    rank = dist.get_rank()
    groups = len(dist.distributed_c10d._world.pg_names)
    # ranks 0-3 as (z, x) = 2 x 2, x fastest; laid out x-major
    mesh = layout_mesh("cpu", torch.arange(4).view(2, 2).t().contiguous(), ("x", "z"))
    assert len(dist.distributed_c10d._world.pg_names) == groups  # no process group made
    assert list(mesh.get_coordinate()) == [rank % 2, rank // 2]
    local = torch.full((2, 3), float(rank))
    t = DTensor.from_local(local, mesh, [Shard(0), Replicate()], run_check=False)
    assert t.shape == (4, 3) and torch.equal(t.to_local(), local)


def test_layout_mesh_makes_no_group_and_places_pieces():
    run_distributed(_layout, 4)


MICRO_BATCHES = 4


def _stage_module(index: int) -> nn.Module:
    torch.manual_seed(100 + index)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh())


def _run(
    stage_cls, x: torch.Tensor, y: torch.Tensor, schedule_cls=Schedule1F1B, steps: int = 1, evals=0
):
    """``steps`` steps of the two-stage pipeline (1F1B by default), then ``evals`` forward-only
    passes (the schedule's ``eval``); returns (stage, losses, gradients)."""
    rank = dist.get_rank()
    module = _stage_module(rank)
    stage = stage_cls(module, rank, 2, torch.device("cpu"))
    schedule = schedule_cls(stage, MICRO_BATCHES, loss_fn=lambda out, t: ((out - t) ** 2).sum())
    losses = []
    for i in range(steps + evals):
        run = schedule.step if i < steps else schedule.eval
        with torch.set_grad_enabled(i < steps):
            if rank == 0:
                run(x)
            else:
                run(target=y, losses=losses)
    return stage, losses, [p.grad.clone() for p in module.parameters()]


class _Counting(LeanRecvStage):
    inferred = 0

    def after_shape_inference(self) -> None:
        _Counting.inferred += 1


def _lean_equals_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    plain, losses, grads = _run(PipelineStage, x, y)
    lean, lean_losses, lean_grads = _run(_Counting, x, y)
    for a, b in zip(losses, lean_losses, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(grads, lean_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert _Counting.inferred == int(SHAPES_INFERRED_BY_A_REAL_STEP)
    # torch keeps one buffer per micro-batch received; the lean stage released every one
    assert all(b.numel() for b in LeanRecvStage.recv_buffers(plain))
    assert lean.recv_buffers() and all(b.numel() == 0 for b in lean.recv_buffers())


def test_lean_recv_stage_equals_torch_stage_and_releases_its_buffers():
    run_distributed(_lean_equals_torch, 2)


class _PostsAhead(LeanRecvStage):
    post_ahead = True
    posted_at_first: list[tuple[str, int]] = []

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if fwd_chunk_id == 0:
            _PostsAhead.posted_at_first.append(("fwd", len(self._posted["fwd"])))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        if bwd_chunk_id == 0:
            _PostsAhead.posted_at_first.append(("bwd", len(self._posted["bwd"])))
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


def _posted_ahead_equals_torch(schedule: str) -> None:
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    _, losses, grads = _run(PipelineStage, x, y, cls, steps=2, evals=1)
    ahead, ahead_losses, ahead_grads = _run(_PostsAhead, x, y, cls, steps=2, evals=1)
    for a, b in zip(losses, ahead_losses, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(grads, ahead_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # every micro-batch's receive was posted before the first pass of its direction (stage 1
    # receives activations, stage 0 gradients), none is left over, every buffer released
    receives = "fwd" if dist.get_rank() == 1 else "bwd"
    first = [n for d, n in _PostsAhead.posted_at_first if d == receives]
    # evaluation (the third pass) posts activations' receives ahead, never gradients'
    want = [MICRO_BATCHES] * 3 if receives == "fwd" else [MICRO_BATCHES, MICRO_BATCHES, 0]
    assert first == want, _PostsAhead.posted_at_first
    assert not ahead._posted["fwd"] and not ahead._posted["bwd"]
    assert all(b.numel() == 0 for b in ahead.recv_buffers())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_receives_posted_ahead_equal_torch_stage_over_two_steps(schedule):
    """:attr:`LeanRecvStage.post_ahead` (what tetrad's GPipe and 1F1B set on gloo): same
    losses and gradients as torch's own stage, then the same forward-only losses (evaluation
    posts the activations' receives ahead, never the gradients')."""
    run_distributed(_posted_ahead_equals_torch, 2, schedule)


def test_make_test_torch_min_installs_the_declared_minimum():
    root = Path(__file__).resolve().parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    minimum = next(re.match(r"torch>=([\d.]+)", d) for d in deps if d.startswith("torch"))
    make = (root / "Makefile").read_text()
    pinned = re.search(r"^TORCH_MIN := ([\d.]+)$", make, re.M)
    assert pinned and pinned.group(1).startswith(minimum.group(1)), (minimum, pinned)
    assert "tests/test_torch_private.py" in make.split("MIN_TESTS :=")[1].split("\n\n")[0]


def test_lower_right_causal_has_no_storage_and_masks_as_torchs():
    """torch's ``causal_lower_right`` carries an unused fp32 host tensor ``[2, q, kv]``; ours
    holds no elements, and attention with it equals attention with torch's (math kernel, GQA,
    backward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    assert torch.Tensor.numel(causal_lower_right(3, 4)) == 24
    assert torch.Tensor.numel(lower_right_causal(3, 4)) == 0
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 7, 8, generator=g, requires_grad=True) for _ in range(2))
    outs = []
    with sdpa_kernel([SDPBackend.MATH]):
        for bias in (causal_lower_right(3, 7), lower_right_causal(3, 7)):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, enable_gqa=True
            )
            outs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
