"""The planner's communication model: bytes per collective derived by hand from tetrad's layout,
the network placement model against AxoNN's measured tables, AxoNN's published model, overlap.

Every expected number below is written out from the layout rules (docs/architecture.md and
tetrad/plan/step_time.py): a Linear ``[n, k]`` on grid ``(G_data, G_z, G_y, G_x)`` gathers
``n k / (G_x G_y)`` weight elements over Z (bf16), all-reduces ``m n / G_out`` forward over its
input axis, ``m k / G_in`` backward over its output axis, and reduce-scatters ``n k / (G_x G_y)``
fp32 gradient elements over Z.
"""

import dataclasses
import math

import pytest

from tetrad.plan.comm.axonn import axonn_comm, axonn_linear_volumes
from tetrad.plan.comm.listing import axis_totals
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import get_machine
from tetrad.plan.machine.network import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    Network,
    placement,
    ring_bytes,
)
from tetrad.plan.question import StepQuestion
from tetrad.plan.step_time import collectives, estimate
from tetrad.spec.overlap import OverlapError, parse_overlaps
from tetrad.spec.presets import get_model

# h=256, 2 layers, 8 heads of 32, 4 KV heads (kv_dim 128), SwiGLU 512, vocabulary 1024.
SMALL = "hidden=256,n_layers=2,n_heads=8,n_kv_heads=4,ffn_dim=512,vocab=1024"
PERL = get_machine("perlmutter")


def by_key(cols):
    return {(c.layer, c.phase, c.axis, c.kind): c for c in cols}


def layer_bytes(
    n: int,
    k: int,
    transposed: bool,
    grid: tuple[int, int, int, int],
    tokens: int,
    compute_bytes: int = 2,
) -> dict[tuple[str, str, str], float]:
    """Payload bytes of one call of each collective of one Linear ``[n, k]`` on ``grid`` for
    ``tokens`` tokens per rank (the runtime's layout; keys ``(phase, axis, kind)``; size-1 axes
    omitted). A hand-check helper: the layout rules above written as a table."""
    gd, gz, gy, gx = grid
    sizes = {"x": gx, "y": gy, "z": gz}
    in_ax, out_ax = ("y", "x") if transposed else ("x", "y")
    c = compute_bytes
    out = {}
    if gz > 1:
        out[("forward", "z", ALL_GATHER)] = n * k / (gx * gy) * c
        out[("backward", "z", ALL_GATHER)] = n * k / (gx * gy) * c
        out[("backward", "z", REDUCE_SCATTER)] = n * k / (gx * gy) * 4
    if sizes[in_ax] > 1:
        out[("forward", in_ax, ALL_REDUCE)] = tokens * n / sizes[out_ax] * c
    if sizes[out_ax] > 1:
        out[("backward", out_ax, ALL_REDUCE)] = tokens * k / sizes[in_ax] * c
    return out


def test_linear_bytes_all_axes_by_hand():
    # grid D,Z,Y,X = 2,2,2,2; micro-batch 2 x 16 tokens = m 32; bf16; acc = 8/(2*2*2) = 1
    model = get_model(SMALL)
    cols = by_key(collectives(model, PERL, (2, 2, 2, 2), 2, 16, 8, overlaps="none"))
    expect = {
        # wqkv [256 + 2 * 128, 256] (q, k and v fused), in X out Y: one dx all-reduce, not three
        ("wqkv", "forward", "z", "all_gather"): 512 * 256 // 4 * 2,  # 65536
        ("wqkv", "forward", "x", "all_reduce"): 32 * 512 // 2 * 2,  # 16384
        ("wqkv", "backward", "z", "all_gather"): 65536,
        ("wqkv", "backward", "y", "all_reduce"): 32 * 256 // 2 * 2,  # 8192
        ("wqkv", "backward", "z", "reduce_scatter"): 512 * 256 // 4 * 4,  # 131072
        # w13 [2 * 512, 256] (gate and up fused)
        ("w13", "forward", "x", "all_reduce"): 32 * 1024 // 2 * 2,  # 32768
        ("w13", "backward", "y", "all_reduce"): 32 * 256 // 2 * 2,  # 8192
        # w2 [256, 512] transposed: in Y, out X
        ("w2", "forward", "y", "all_reduce"): 32 * 256 // 2 * 2,  # 8192
        ("w2", "backward", "x", "all_reduce"): 32 * 512 // 2 * 2,  # 16384
        ("w2", "forward", "z", "all_gather"): 256 * 512 // 4 * 2,  # 65536
        ("w2", "backward", "z", "reduce_scatter"): 256 * 512 // 4 * 4,  # 131072
        # LM head [1024, 256]: vocabulary over Y and X (and Z), input gathered over X
        ("output", "forward", "x", "all_gather"): 32 * 256 * 2,  # 16384, never V-sized
        ("output", "backward", "x", "reduce_scatter"): 32 * 256 * 2,  # 16384
        ("output", "backward", "y", "all_reduce"): 32 * 256 // 2 * 2,  # 8192
        ("output", "forward", "z", "all_gather"): 1024 * 256 // 4 * 2,  # 131072
        ("output", "backward", "z", "reduce_scatter"): 1024 * 256 // 4 * 4,  # 262144
        # embedding [1024, 256], rows over (Y, Z), columns over X: gathered in bf16 like a
        # Linear's weight, its gradient reduce-scattered in fp32; its rows summed over Y in
        # the residual stream's format (bf16: the compute dtype's)
        ("embedding", "forward", "z", "all_gather"): 1024 * 256 // 4 * 2,  # 131072
        ("embedding", "forward", "y", "all_reduce"): 32 * 256 // 2 * 2,  # 8192
        ("embedding", "backward", "z", "reduce_scatter"): 262144,
        # RMSNorm: m fp32; loss: m fp32
        ("norm", "forward", "x", "all_reduce"): 32 * 4,
        ("norm", "backward", "x", "all_reduce"): 32 * 4,
        ("loss", "forward", "y", "all_reduce"): 32 * 4,
        ("loss", "forward", "x", "all_reduce"): 32 * 4,
        # step: every local weight shard fp32 over data: per block (256*256 + 2*128*256 +
        # 256*256 + 2*512*256 + 256*512)/8 = 73728 elements, 2 blocks, head and embedding 32768
        ("gradients", "step", "data", "all_reduce"): (2 * 73728 + 2 * 32768) * 4,
        ("norm_gradients", "step", "z", "all_reduce"): 5 * 128 * 4,  # 5 norms of h/G_x
        ("norm_gradients", "step", "data", "all_reduce"): 5 * 128 * 4,
        ("loss_scalar", "step", "z", "all_reduce"): 4,
        ("loss_scalar", "step", "data", "all_reduce"): 4,
        ("grad_norm", "step", "world", "all_reduce"): 8,
    }
    for key, payload in expect.items():
        assert cols[key].payload_bytes == payload, key
    calls = {
        ("wqkv", "forward", "x", "all_reduce"): 2,
        ("wqkv", "backward", "y", "all_reduce"): 2,
        ("output", "forward", "x", "all_gather"): 1,
        ("norm", "forward", "x", "all_reduce"): 5,
        ("loss", "forward", "y", "all_reduce"): 3,
        ("loss", "forward", "x", "all_reduce"): 3,
        ("gradients", "step", "data", "all_reduce"): 1,
    }
    for key, n in calls.items():
        assert cols[key].calls == n, key
    # the ring bytes: all-reduce 2(G-1)/G, gather/scatter (G-1)/G; the world has 16 ranks
    assert cols[("wqkv", "forward", "x", "all_reduce")].ring_bytes == 16384
    assert cols[("wqkv", "forward", "z", "all_gather")].ring_bytes == 32768
    assert cols[("grad_norm", "step", "world", "all_reduce")].ring_bytes == 2 * 15 / 16 * 8
    # nothing else is issued: embedding and LM head have no backward gather, the loss no
    # backward collective
    assert ("embedding", "backward", "z", "all_gather") not in cols
    assert ("output", "backward", "z", "all_gather") not in cols  # W kept from forward
    assert not [k for k in cols if k[0] == "loss" and k[1] != "forward"]


def test_embedding_sum_in_an_fp32_residual_stream():
    """``--residual-dtype fp32`` under bf16 compute (``residual_bytes=4``): the embedding's rows
    are summed over Y in 4 bytes (all-reduced; under sequence parallelism reduce-scattered and
    their gradient all-gathered), the runtime's cast before the sum; every other collective as
    with the default stream (the Linears and the LM head cast their input to bf16 first)."""
    model = get_model(SMALL)
    args = (model, PERL, (2, 2, 2, 2), 2, 16, 8)
    for sp in (False, True):
        plain = by_key(collectives(*args, overlaps="none", sequence_parallel=sp))
        fp32 = by_key(collectives(*args, overlaps="none", sequence_parallel=sp, residual_bytes=4))
        assert set(fp32) == set(plain)
        stream = [k for k in plain if k[0] == "embedding" and k[2] == "y"]
        assert len(stream) == (2 if sp else 1)
        for key, c in fp32.items():
            want = plain[key].payload_bytes * (2 if key in stream else 1)
            assert c.payload_bytes == want, key
        assert fp32[stream[0]].payload_bytes == 32 * 256 // 2 * 4


def test_size_one_axes_and_other_grid():
    # D,Z,Y,X = 1,4,1,2: no Y, no data collectives; Z gathers n k / G_x; m = 1 x 16
    model = get_model(SMALL)
    cols = by_key(collectives(model, PERL, (1, 4, 1, 2), 1, 16, 8, overlaps="none"))
    assert {k[2] for k in cols} == {"x", "z", "world"}
    assert cols[("w13", "forward", "z", "all_gather")].payload_bytes == 1024 * 256 // 2 * 2
    assert cols[("w13", "forward", "z", "all_gather")].ring_bytes == 3 / 4 * 1024 * 256
    assert cols[("w13", "forward", "x", "all_reduce")].payload_bytes == 16 * 1024 * 2
    assert cols[("wo", "backward", "x", "all_reduce")].payload_bytes == 16 * 256 * 2
    # acc = 8 / (1 * 4 * 1) = 2 micro-batches, 2 layers
    assert cols[("w13", "backward", "z", "reduce_scatter")].calls == 4
    assert cols[("norm_gradients", "step", "z", "all_reduce")].payload_bytes == 5 * 128 * 4


def test_layer_bytes_helper_matches_hand_values():
    got = layer_bytes(512, 256, False, (1, 2, 4, 2), tokens=64)
    assert got == {
        ("forward", "z", "all_gather"): 512 * 256 / 8 * 2,
        ("backward", "z", "all_gather"): 512 * 256 / 8 * 2,
        ("backward", "z", "reduce_scatter"): 512 * 256 / 8 * 4,
        ("forward", "x", "all_reduce"): 64 * 512 / 4 * 2,
        ("backward", "y", "all_reduce"): 64 * 256 / 2 * 2,
    }
    got = layer_bytes(256, 512, True, (1, 1, 4, 2), tokens=64, compute_bytes=4)
    assert got == {
        ("forward", "y", "all_reduce"): 64 * 256 / 2 * 4,
        ("backward", "x", "all_reduce"): 64 * 512 / 4 * 4,
    }


def test_checkpointing_repeats_block_forward_collectives():
    model = get_model(SMALL)
    plain = by_key(collectives(model, PERL, (2, 2, 2, 2), 2, 16, 8, overlaps="none"))
    ckpt = by_key(
        collectives(
            model, PERL, (2, 2, 2, 2), 2, 16, 8, overlaps="none", activation_checkpointing=True
        )
    )
    for name in ("wqkv", "wo", "w13", "w2"):
        for axis, kind in (("z", "all_gather"),) + (
            (("y", "all_reduce"),) if name in ("wo", "w2") else (("x", "all_reduce"),)
        ):
            f = ckpt[(name, "forward", axis, kind)]
            r = ckpt[(name, "recompute", axis, kind)]
            assert (r.payload_bytes, r.calls) == (f.payload_bytes, f.calls)
            assert (name, "recompute", axis, kind) not in plain
    assert ckpt[("norm", "recompute", "x", "all_reduce")].calls == 4  # 2 norms x 2 blocks
    # the head, final norm, embedding and loss are outside the checkpointed blocks
    assert not [k for k in ckpt if k[1] == "recompute" and k[0] in ("output", "embedding")]


def test_selective_checkpointing_recomputes_elementwise_work_only():
    """Selective re-runs no collective (the same list as none) and charges the norm applies,
    RoPE and SwiGLU once each, memory bound (tetrad/plan/compute/block.py)."""
    model = get_model(SMALL)
    grid, b, seq = (2, 2, 2, 2), 2, 16
    plain = collectives(model, PERL, grid, b, seq, 8, overlaps="none")
    sel = collectives(
        model, PERL, grid, b, seq, 8, overlaps="none", activation_checkpointing="selective"
    )
    assert sel == plain
    ctx = StepQuestion(model, PERL, seq, 8, overlaps="none")
    comp = ctx.compute(grid, b)
    m, hbm = b * seq, PERL.hbm_bytes_per_s
    norms = 2 * 10 * m * 256 / 2  # two norm applies, ~10 B per h/G_x feature
    rope = 12 * m * (256 + 128) / 2
    act = 8 * m * 512 / 2
    assert comp.selective == pytest.approx((norms + rope + act) / hbm, rel=1e-12)
    none, full, selective = (estimate(ctx, grid, b, c) for c in ("none", "full", "selective"))
    acc, n = none.grad_accum, model.n_layers
    assert none.recompute_s == 0 and full.recompute_s == pytest.approx(acc * n * comp.block_fwd)
    assert selective.recompute_s == pytest.approx(acc * n * comp.selective)
    assert selective.exposed_s == none.exposed_s
    assert none.step_s < selective.step_s < full.step_s


def test_domino_halves_and_buckets():
    model = get_model(SMALL)
    # m = 32 x 16 = 512 rows >= 2 * 256: split; halves of 256 rows
    cols = by_key(collectives(model, PERL, (2, 1, 2, 2), 32, 16, 64, overlaps="all"))
    half = cols[("wqkv (half 1)", "forward", "x", "all_reduce")]
    assert half.payload_bytes == 256 * 256 * 2 and half.hidden_behind
    assert ("wqkv", "forward", "x", "all_reduce") not in cols
    # all local shards, (2 * 147456 + 2 * 65536) * 4 = 1,703,936 B, and with G_z = 1 the five
    # norm weights of h/G_x = 128 fit one 25 MiB bucket; no separate norm all-reduce over data
    grads = cols[("gradients", "backward", "data", "all_reduce")]
    assert grads.calls == 1
    assert grads.payload_bytes == (2 * 147456 + 2 * 65536 + 5 * 128) * 4
    assert ("norm_gradients", "step", "data", "all_reduce") not in cols
    # tiny buckets: one per gradient as soon as each exceeds the bucket, the last (embedding)
    # one with the norms
    cols = by_key(
        collectives(model, PERL, (2, 1, 2, 2), 32, 16, 64, overlaps="all", bucket_bytes=1)
    )
    assert cols[("gradients", "backward", "data", "all_reduce")].calls == 2 * 4 + 2
    # G_z > 1: the norms are summed over Z then data after backward, as before
    cols = by_key(collectives(model, PERL, (2, 2, 2, 1), 16, 16, 64, overlaps="all"))
    assert cols[("norm_gradients", "step", "data", "all_reduce")].payload_bytes == 5 * 256 * 4


def test_data_parallel_alone_has_no_gradient_norm_all_reduce():
    # every rank has the whole gradient after the data all-reduce, so it computes the norm
    cols = by_key(collectives(get_model(SMALL), PERL, (8, 1, 1, 1), 1, 16, 8, overlaps="none"))
    assert {k[2] for k in cols} == {"data"}


def test_axis_totals_sum_calls_and_bytes():
    model = get_model(SMALL)
    cols = collectives(model, PERL, (2, 2, 2, 2), 2, 16, 8, overlaps="none")
    tot = axis_totals(cols)
    for axis in ("x", "y", "z", "data", "world"):
        mine = [c for c in cols if c.axis == axis]
        assert tot[axis]["calls"] == sum(c.calls for c in mine)
        assert tot[axis]["payload_bytes"] == sum(c.calls * c.payload_bytes for c in mine)


def test_overlap_none_exposes_everything_and_all_hides_some():
    model = get_model("gpt-20b")
    ctx_none = StepQuestion(model, PERL, 2048, 512, overlaps="none")
    ctx_all = StepQuestion(model, PERL, 2048, 512, overlaps="all")
    grid = (8, 4, 2, 4)
    e0 = estimate(ctx_none, grid, 2, True, detail=True)
    e1 = estimate(ctx_all, grid, 2, True)
    # with every overlap off only the loss's sum over data still runs behind the update
    behind = [c for c in e0.collectives if c.exposed_s < c.total_s * (1 - 1e-9)]
    assert [(c.layer, c.axis, c.exposed_s) for c in behind] == [("loss_scalar", "data", 0.0)]
    for axis in ("x", "y", "z", "data"):
        hidden = sum(c.total_s for c in behind if c.axis == axis)
        assert e0.exposed_s[axis] == pytest.approx(e0.comm_s[axis] - hidden)
        assert e1.exposed_s[axis] <= e1.comm_s[axis] + 1e-12
    assert e1.step_s < e0.step_s
    assert e0.step_s == pytest.approx(e0.compute_s + sum(e0.comm_s.values()) - behind[0].total_s)
    # the detailed list adds up to the estimate
    cols = estimate(ctx_all, grid, 2, True, detail=True).collectives
    assert sum(c.exposed_s for c in cols) == pytest.approx(sum(e1.exposed_s.values()))
    assert sum(c.total_s for c in cols) == pytest.approx(sum(e1.comm_s.values()))
    with pytest.raises(OverlapError, match="unknown overlap"):
        parse_overlaps("prefetch,bogus")


def test_placement_and_alpha_beta():
    assert placement(1, 4, 4) == (4, 1)
    assert placement(2, 4, 4) == (2, 2)
    assert placement(4, 8, 4) == (1, 8)
    assert placement(3, 4, 8) == (3, 2)  # ranks 0,3,6 | 9
    net = Network(
        gpus_per_node=4,
        intra_node_gbps=200.0,
        inter_node_gbps_per_member=25.0,
        latency_base_us=10.0,
        latency_hop_intra_us=1.0,
        latency_hop_inter_us=2.0,
    )
    link = net.link(2, 4)  # 2 per node on 2 nodes: 2 * 25 GB/s
    assert link.bandwidth == 50e9
    # all-reduce: base + min(2(G-1), 2 ceil(log2 G)) hops + 2 (G-1)/G bytes / bandwidth
    assert link.time("all_reduce", 1e9) == pytest.approx(10e-6 + 4 * 2e-6 + 1.5e9 / 50e9)
    assert link.time("all_gather", 1e9) == pytest.approx(10e-6 + 3 * 2e-6 + 0.75e9 / 50e9)
    assert ring_bytes("reduce_scatter", 100.0, 4) == 75.0
    assert net.link(1, 1).time("all_reduce", 1e9) == 0.0


def _axonn_get_bw(ip, my, machine):
    """Megatron-AxoNN examples/comm_model.py get_bw, transcribed (GB/s)."""
    if machine == "perlmutter":
        if ip == 1:
            return {2: 76, 4: 225}.get(my, 80 if my >= 8 else None)
        if ip == 2:
            return 76 if my == 2 else 40
        return 20
    if ip == 1:
        return {2: 129, 4: 52, 8: 135}.get(my, 80 / 2)
    if ip == 2:
        return {2: 50, 4: 72}.get(my, 40 / 2)
    if ip == 4:
        return 36 if my == 2 else 20 / 2
    return 10 / 2


@pytest.mark.parametrize("machine", ["perlmutter", "frontier"])
def test_network_reproduces_axonn_tables(machine):
    net = get_machine(machine).network
    for ip in (1, 2, 4, 8, 16, 256):
        for my in (2, 4, 8, 16, 64, 1024):
            assert net.bandwidth_gbps(ip, my) == _axonn_get_bw(ip, my, machine), (ip, my)


def _axonn_model_v2(B, S, K, H, Gd, Gr, Gc, Gdata, machine, transpose, grad_acc):
    """Megatron-AxoNN examples/comm_model.py model_v2, transcribed (seconds)."""
    gib = 2 / 1024 / 1024 / 1024
    dp = 4 * (Gdata - 1) / Gdata * K * H * H / (Gc * Gr * Gd) * gib
    depth = 3 / 2 * 2 * (Gd - 1) / Gd * K * H * H / (Gc * Gr) * gib * grad_acc
    if not transpose:
        row = 2 * (Gr - 1) / Gr * (B / Gdata / Gd * S * H / Gc) * gib
        col = 2 * 2 * (Gc - 1) / Gc * (B / Gdata / Gd * S * K * H / Gr) * gib
    else:
        row = 2 * 2 * (Gr - 1) / Gr * (B / Gdata / Gd * S * K * H / Gc) * gib
        col = 2 * (Gc - 1) / Gc * (B / Gdata / Gd * S * H / Gr) * gib
    t = 0.0
    for comm, ip, my in (
        (col, 1, Gc),
        (row, Gc, Gr),
        (depth, Gc * Gr, Gd),
        (dp, Gc * Gr * Gd, Gdata),
    ):
        if my > 1:
            t += comm / _axonn_get_bw(ip, my, machine)
    return t


@pytest.mark.parametrize("grid", [(4, 16, 4, 4), (16, 4, 4, 4), (2, 8, 16, 4), (64, 16, 1, 1)])
def test_axonn_mode_reproduces_published_model(grid):
    model = get_model("gpt-80b")
    gd, gz, gy, gx = grid
    B, S, H, acc = 2048, 2048, 12288, 4
    # AxoNN's block: a = QKV (K=3), b = out-proj (K=1, transposed), c = FC1 (K=4),
    # d = FC2 (K=4, transposed); iteration = num_layers * (a + b + c + d)
    want = 42 * sum(
        _axonn_model_v2(B, S, K, H, gz, gy, gx, gd, "perlmutter", tr, acc)
        for K, tr in ((3, False), (1, True), (4, False), (4, True))
    )
    got = axonn_comm(model, PERL, grid, B, S, acc)
    assert got["total"] == pytest.approx(want, rel=1e-12)


def test_axonn_transposed_term_deviates_from_layout():
    # FC2 (4H -> H, transposed) as coded: X term 2 f t H / G_y; the layout: 2 f t 4H / G_y
    grid, t, h = (1, 1, 2, 2), 1000.0, 64
    coded = axonn_linear_volumes(h, 4 * h, True, t, grid, 1)
    layout_x = 2 * 0.5 * t * 4 * h / 2 * 2 / 1024**3  # backward dx all-reduce over X, bf16
    assert coded["x"] == pytest.approx(layout_x / 4)
    layout_y = 2 * 2 * 0.5 * t * h / 2 * 2 / 1024**3  # forward all-reduce over Y, x2 recompute
    assert coded["y"] == pytest.approx(layout_y * 4)


def test_estimate_rejects_batch_that_does_not_split():
    ctx = StepQuestion(get_model(SMALL), PERL, 16, 6)
    with pytest.raises(PlanError, match="not divisible"):
        estimate(ctx, (2, 2, 1, 1), 1, False)
    assert math.isfinite(estimate(ctx, (2, 1, 1, 1), 3, False).step_s)


def test_gather_windows_follow_each_stages_blocks():
    """The sharded optimizer's all-gather after the update of a stage's first block hides behind
    the stages before it: each stage's last block that another stage of the rank follows waits
    ``rounds`` micro-batches through its stage (``1 + (rounds - 1) b`` block forwards, ``b`` its
    blocks); uneven stages and a head stage of no blocks included (docs: gather_units)."""
    from tetrad.plan.comm.layers import gather_units
    from tetrad.plan.step_time import make_step

    ctx = StepQuestion(get_model("llama-3.1-8b"), get_machine("dgx-h100"), 4096, 64)
    st = make_step(ctx, (8, 1, 1, 1), 1, "none")
    st.rounds, fwd = 4, st.comp.block_fwd

    def windows(L, chunk_blocks, chunks):
        st.model = dataclasses.replace(st.model, n_layers=L)
        st.chunks, st.chunk_blocks = chunks, chunk_blocks
        return [round(a / fwd, 9) for name, _, a in gather_units(st) if name == "blocks"]

    even = windows(4, (), 2)
    assert even == windows(4, (2, 2), 2) == [1, 7, 1, 1]  # the first stage's 2nd block waits
    assert windows(4, (1, 3), 2) == [4, 1, 1, 1]  # uneven: after the 1-block stage
    assert windows(3, (2, 1, 0), 3) == [1, 7, 4]  # the head's stage of no blocks follows
