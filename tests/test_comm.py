"""The collective record: bytes, calls per axis, checked by hand and by an independent count.

One Linear pair (16 -> 32, then transposed 32 -> 16) on grid (1, 2, 2, 2), fp32, 8 samples of 3
tokens: each (data, z) cell has m = 8/2 * 3 = 12 token rows. Per rank, by hand:

    layer 1 (in X, out Y), block 32/2 x 16/2 = 128 elements = 512 B
      fwd: all-gather Z 512 B; all-reduce X  m*32/2 = 192 el = 768 B
      bwd: all-gather Z 512 B; all-reduce Y  m*16/2 =  96 el = 384 B; reduce-scatter Z 512 B
    layer 2 (in Y, out X), block 16/2 x 32/2 = 128 elements = 512 B
      fwd: all-gather Z 512 B; all-reduce Y  m*16/2 =  96 el = 384 B
      bwd: all-gather Z 512 B; all-reduce X  m*32/2 = 192 el = 768 B; reduce-scatter Z 512 B

Payload: Z 6 calls 3072 B, X 2 calls 1536 B, Y 2 calls 768 B. Ring bytes sent (G = 2): all-gather
and reduce-scatter send half their payload, all-reduce all of it: Z 1536, X 1536, Y 768.

With ``fine`` each X/Y all-reduce is a fused reduce-scatter plus an all-gather of the same
payload: twice the calls and payload bytes, the same ring bytes. The independent count sees the
fused ring's point-to-point pieces (sends and receives: ``2 (G-1)/G`` of the payload, which is the
payload itself for G = 2) and the all-gather's output.
"""

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.parallel import Linear, RMSNorm
from tetrad.parallel.overlap import Overlap
from tetrad.spec.grid import Axis
from tetrad.spec.overlap import OVERLAPS

EXPECTED = {"z": (6, 3072, 1536.0), "x": (2, 1536, 1536.0), "y": (2, 768, 768.0)}


class CountCollectives(TorchDispatchMode):
    """Independent count: the largest tensor of every c10d op (its payload), by group name."""

    def __init__(self):
        super().__init__()
        self.by_group = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [
                t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)
            ]
            boxed = next(a for a in args if type(a).__name__ == "ScriptObject")
            name = dist.ProcessGroup.unbox(boxed).group_name
            nbytes = max(t.numel() * t.element_size() for t in tensors)
            self.by_group[name] = self.by_group.get(name, 0) + nbytes
        return func(*args, **(kwargs or {}))


def pair_step(overlaps):
    torch.manual_seed(0)
    grid = Grid.build((1, 2, 2, 2))
    ov = Overlap(grid, overlaps, domino_min_rows=2)
    l1 = Linear(16, 32, grid, overlap=ov)
    l2 = Linear(32, 16, grid, transpose=True, overlap=ov)
    for p in (l1.weight, l2.weight):
        torch.nn.init.normal_(p)
    x = torch.randn(4, 3, 8, requires_grad=True)
    grid.comm.reset()
    counter = CountCollectives()
    with counter:
        ov.begin_micro_batch(last=True)
        l2(l1(x)).sum().backward()
        ov.end_micro_batch()
    record = grid.comm.reset()
    for axis, (calls, payload, ring) in EXPECTED.items():
        got = record[axis]
        if "fine" in overlaps and axis in "xy":
            calls, payload = 2 * calls, 2 * payload  # reduce-scatter (fused) + all-gather
        elif "domino" in overlaps and axis in "xy":
            calls += 1  # the forward all-reduce is issued in two halves
        assert (got.calls, got.payload_bytes, got.bytes) == (calls, payload, ring), (axis, got)
        assert counter.by_group[grid.group(axis).group_name] == payload, axis
        assert got.time_s >= got.exposed_s >= 0
    assert set(record) == set(EXPECTED)
    if "fine" in overlaps:
        assert ov.counts["fine_fused"] == 4 and ov.counts["domino_splits"] == 0
    elif "domino" in overlaps:
        assert ov.counts["domino_splits"] == 2


def both():
    pair_step(())
    pair_step(OVERLAPS)
    pair_step(tuple(o for o in OVERLAPS if o != "fine"))


def test_recorded_bytes_match_hand_count_and_c10d():
    run_distributed(both, 8)


def buckets_during_backward():
    grid = Grid.build((2, 1, 1, 1))
    ov = Overlap(grid, ("dp_all_reduce", "reduce_scatter"), bucket_bytes=1)
    l1, l2 = Linear(16, 32, grid, overlap=ov), Linear(32, 16, grid, transpose=True, overlap=ov)
    for p in (l1.weight, l2.weight):
        torch.nn.init.normal_(p)
    x = torch.randn(4, 3, 16, requires_grad=True)
    ov.begin_micro_batch(last=True)
    y = l2(l1(x)).sum()
    launched_in_backward = []
    # x's gradient is the last thing backward computes, before end_micro_batch
    x.register_hook(lambda g: launched_in_backward.append(ov.counts["dp_buckets"]))
    y.backward()
    ov.end_micro_batch()
    assert ov.counts["dp_buckets"] == 2
    assert launched_in_backward == [2]  # no step size known: every full bucket goes at once
    # told the step's two gradients, the last one's bucket waits for end_micro_batch
    ov.buckets.expected, launched_in_backward = 2, []
    ov.counts.clear()
    ov.begin_micro_batch(last=True)
    l2(l1(x)).sum().backward()
    assert launched_in_backward == [1]
    ov.end_micro_batch()
    assert ov.counts["dp_buckets"] == 2


def test_data_parallel_buckets_start_during_backward():
    """With G_z = 1 (no reduce-scatter to wait for) a weight gradient's data-parallel bucket is
    launched as soon as the gradient exists, not at the end of backward."""
    run_distributed(buckets_during_backward, 2)


def norm_weights_in_last_bucket():
    grid = Grid.build((2, 1, 1, 1))
    ov = Overlap(grid, ("dp_all_reduce", "reduce_scatter"), bucket_bytes=1)
    lin, norm = Linear(16, 16, grid, overlap=ov), RMSNorm(16, grid, Axis.X)
    ov.late, ov.buckets.expected = [norm.weight], 1
    torch.manual_seed(7)  # the same weights on both ranks
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(norm.weight)
    torch.manual_seed(dist.get_rank())  # each data rank sees other tokens
    x = torch.randn(4, 3, 16)
    ov.begin_micro_batch(last=True)
    lin(norm(x)).square().sum().backward()
    local = norm.weight.grad.clone(), lin.weight.grad.clone()
    ov.end_micro_batch()
    assert ov.counts["dp_buckets"] == 1  # the last weight's bucket waited for the norm's
    assert ov.buckets.reduced == {id(lin.weight), id(norm.weight)}
    for p, mine in zip((norm.weight, lin.weight), local, strict=True):
        want = mine.clone()
        dist.all_reduce(want)
        torch.testing.assert_close(p.grad, want)


def test_norm_weights_join_the_last_data_parallel_bucket():
    """With G_z = 1 the norm weights' gradients (left to autograd) are summed over data in the
    last bucket, not by a separate all-reduce after backward."""
    run_distributed(norm_weights_in_last_bucket, 2)


def gradients_in_bucket_buffers():
    grid = Grid.build((2, 1, 1, 1))
    ov = Overlap(grid, ("dp_all_reduce", "reduce_scatter"), bucket_bytes=1)
    l1, l2 = Linear(16, 32, grid, overlap=ov), Linear(32, 16, grid, transpose=True, overlap=ov)
    norm = RMSNorm(16, grid, Axis.X)
    ov.late, ov.buckets.expected = [norm.weight], 2
    ov.buckets.plan([l1.weight, l2.weight], [norm.weight])  # wrong: backward meets l2 first
    torch.manual_seed(7)  # the same weights on both ranks
    for p in (l1.weight, l2.weight, norm.weight):
        torch.nn.init.normal_(p)
    torch.manual_seed(dist.get_rank())  # each data rank sees other tokens
    x = torch.randn(4, 3, 16)
    params = (l2.weight, l1.weight, norm.weight)
    # The reference: the same layers without overlap, their local gradients summed over data.
    # (The overlapped gradients cannot be cloned after backward: a bucket launched during
    # backward is being all-reduced in place while the test would read it.)
    r1, r2 = Linear(16, 32, grid), Linear(32, 16, grid, transpose=True)
    rnorm = RMSNorm(16, grid, Axis.X)
    for r, p in zip((r2.weight, r1.weight, rnorm.weight), params, strict=True):
        r.data.copy_(p.data)
    r2(r1(rnorm(x))).square().sum().backward()
    wants = [r.grad for r in (r2.weight, r1.weight, rnorm.weight)]
    for want in wants:
        dist.all_reduce(want)

    def step() -> tuple[list[bool], list[int]]:
        ov.begin_micro_batch(last=True)
        l2(l1(norm(x))).square().sum().backward()
        before = [p.grad.untyped_storage().data_ptr() for p in params]
        ov.end_micro_batch()
        for p, want in zip(params, wants, strict=True):
            torch.testing.assert_close(p.grad, want)
        after = [p.grad.untyped_storage().data_ptr() for p in params]
        for p in params:
            p.grad = None
        return [a == b for a, b in zip(before, after, strict=True)], after

    kept, _ = step()  # the order differs from the plan: flattened as before, plan remade
    assert kept == [False, False, False]
    kept, storage = step()  # the GEMMs wrote into the buckets; the norm's gradient copied in
    assert kept == [True, True, False]
    assert storage[0] != storage[1] == storage[2]  # buckets [l2] and [l1, norm]


def test_weight_gradients_are_written_into_their_buckets():
    """With G_z = 1 the weight-gradient GEMMs write into the planned data-parallel buckets (no
    flattening copy); a plan that does not match backward's order falls back to the copy and
    is remade from the order seen."""
    run_distributed(gradients_in_bucket_buffers, 2)


def test_init_process_group_binds_the_gpu(monkeypatch):
    """On CUDA the default group is created with ``device_id`` (NCCL's communicator on this
    rank's GPU at once); on CPU (gloo) without."""
    import tetrad.grid as grid_module

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(grid_module, "local_device", lambda t: torch.device(t, 0))
    assert grid_module.init_process_group("cuda")
    assert calls[-1] == (("nccl",), {"device_id": torch.device("cuda", 0)})
    monkeypatch.setattr(grid_module, "local_device", lambda t: torch.device(t))
    assert grid_module.init_process_group("cpu")
    assert calls[-1] == (("gloo",), {})


class TickClock:
    """A deferred clock like NCCL's device events (read only when the log is reset): each mark
    is the next integer, so a call's seconds are the marks between its two ends."""

    deferred = True

    def __init__(self):
        self.marks = self.reads = 0

    def mark(self) -> int:
        self.marks += 1
        return self.marks

    def seconds(self, start: int, end: int) -> float:
        self.reads += 1
        return float(end - start)


def deferred_times():
    from tetrad.comm import all_gather, all_reduce
    from tetrad.comm.fused import ring_all_gather_matmul

    grid = Grid.build((2, 1, 1, 1))
    clock = grid.comm.clock = TickClock()
    x = torch.ones(4, 3)
    h = all_reduce(x.clone(), grid, Axis.DATA, async_op=True)  # marks: issue 1
    all_gather(x, grid, Axis.DATA)  # issue 2, before wait 3, after 4
    h.wait()  # before 5, after 6
    ring_all_gather_matmul(x, torch.ones(5, 3), grid, Axis.DATA)  # start 7, wait 8-9, close 10
    stats = grid.comm.stats(Axis.DATA)
    assert (stats.exposed_s, stats.time_s, clock.reads) == (0.0, 0.0, 0)  # nothing read yet
    totals = grid.comm.reset()[Axis.DATA]
    assert totals.calls == 3
    assert totals.exposed_s == (4 - 3) + (6 - 5) + (9 - 8)
    assert totals.time_s == (4 - 2) + (6 - 1) + (10 - 7)
    assert clock.reads == 6 and not grid.comm.unread  # two per collective, two for the ring


def test_device_clock_times_are_read_at_reset_not_during_the_step():
    """With NCCL the collectives are timed by events on the computation's stream, read only
    when the log is reset (logging time): a deferred clock's marks are kept, then summed per
    axis as the host clock's are (exposed: around each wait; time: issue to end of wait)."""
    run_distributed(deferred_times, 2)


def test_clock_follows_the_backend():
    from tetrad.comm.collectives import DeviceClock, HostClock, clock_for

    assert isinstance(clock_for(torch.device("cuda", 0), "nccl"), DeviceClock)
    assert isinstance(clock_for(torch.device("cuda", 0), "gloo"), HostClock)  # blocks the host
    assert isinstance(clock_for(torch.device("cpu"), "gloo"), HostClock)


def issue_orders(out: str) -> None:
    """Two training steps of the tiny model on data=2 x Z=2 under three timings of the Z
    reduce-scatters: as they come, never seen complete (NCCL's host runs ahead of the GPU), and
    that on rank 0 alone; each rank's axes of its collectives in issue order, per timing."""
    import json
    from pathlib import Path

    import tetrad.comm.collectives as collectives
    from tests.test_model import CFG, OVERLAP_OPTIONS, batches
    from tetrad.parallel import init_parameters
    from tetrad.parallel.model import ParallelLlama
    from tetrad.train.step import build_optimizer, train_step

    torch.set_num_threads(1)
    grid = Grid.build((2, 2, 1, 1))
    rank, real_done, issue = dist.get_rank(), collectives.Handle.done, collectives._issue
    log: list[str] = []

    def logged(grid, axis, *args, **kwargs):
        log.append(str(getattr(axis, "value", axis)))
        return issue(grid, axis, *args, **kwargs)

    collectives._issue = logged
    end = Overlap.end_micro_batch

    def ended(self):
        log.append("end")  # before its own collectives: what waited for the end of backward
        return end(self)

    Overlap.end_micro_batch = ended
    orders = {}
    for timing in ("as they come", "never complete", "rank 0 never"):
        late = timing == "never complete" or (timing == "rank 0 never" and rank == 0)
        collectives.Handle.done = (lambda h: h.work is None) if late else real_done
        model = ParallelLlama(CFG, grid, False, OVERLAPS, **OVERLAP_OPTIONS)
        init_parameters(model, 0, grid)
        opt = build_optimizer(model, 1e-3, 0.1)
        for batch in batches()[:2]:
            log.clear()
            train_step(model, opt, grid, batch, 2, 1.0)
        orders[timing] = list(log)  # the second step: the prefetch order recorded
    Path(out, f"rank{rank}.json").write_text(json.dumps(orders))


def test_every_rank_issues_its_collectives_in_one_order_whatever_the_timing(tmp_path):
    """NCCL's rule for communicators used side by side (Z and data here): every rank issues
    their collectives in one order. The Z reduce-scatters hand the gradients to the
    data-parallel buckets after a fixed count (``REDUCE_SCATTERS_IN_FLIGHT``), not when they look
    complete (which differs between ranks, and on NCCL is almost never during backward), so
    the order is the same on every rank and under every timing, and the buckets start during
    backward (before the last micro-batch's end)."""
    import json

    run_distributed(issue_orders, 4, str(tmp_path))
    runs = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    orders = [order for run in runs for order in run.values()]
    assert all(order == orders[0] for order in orders), "issue orders differ"
    order = orders[0]
    last_end = len(order) - 1 - order[::-1].index("end")  # the last micro-batch's
    assert order.index("data") < last_end, order
