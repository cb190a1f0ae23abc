"""The planner's MoE step model (tetrad/plan/moe_step.py) and search (tetrad/plan/search/moe.py):
the all-to-all on the network hierarchy, the routed experts' terms, the imbalance input, the
dense stand-in, and the searches' answers (in process, small questions)."""

import pytest

from tetrad.plan.comm.experts import all_to_all_seconds
from tetrad.plan.machine.description import get_machine
from tetrad.plan.machine.network import ALL_REDUCE
from tetrad.plan.moe_step import (
    dense_stand_in,
    expert_times,
    grad_sync_seconds,
    moe_estimate,
    stand_in_question,
)
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.moe import search_moe_4d, search_moe_classic
from tetrad.plan.search.plan import plan
from tetrad.spec.presets import get_model

H100 = get_machine("dgx-h100")


def test_all_to_all_on_the_hierarchy():
    net = H100.network  # 8 GPUs per node, 360 GB/s in a node, 45 GB/s per GPU across nodes
    sent = 7 * 2**20  # 1 MiB to each of 7 peers
    inside = all_to_all_seconds(net, 1, 8, sent)
    lat = net.latency_base_us * 1e-6 + 7 * net.latency_hop_intra_us * 1e-6
    assert inside == pytest.approx(lat + sent / (net.intra_node_gbps * 1e9))
    # stride 8: each member on its own node, every byte through the rank's NIC share
    across = all_to_all_seconds(net, 8, 8, sent)
    lat = net.latency_base_us * 1e-6 + 7 * net.latency_hop_inter_us * 1e-6
    assert across == pytest.approx(lat + sent / (net.inter_node_gbps_per_member * 1e9))
    # 16 ranks, 8 per node: 7 peers in the node, 8 across; the slower side sets the time
    mixed = all_to_all_seconds(net, 1, 16, 15 * 2**20)
    lat = net.latency_base_us * 1e-6 + 15 * net.latency_hop_inter_us * 1e-6
    assert mixed == pytest.approx(lat + 8 * 2**20 / (net.inter_node_gbps_per_member * 1e9))
    assert all_to_all_seconds(net, 1, 1, sent) == 0.0


def test_dense_stand_in_keeps_everything_but_the_routed_experts():
    qwen = dense_stand_in(get_model("qwen3-30b-a3b"))  # no dense block, no shared expert
    assert not qwen.is_moe and qwen.ffn_dim == 128 and qwen.n_layers == 48
    ds = dense_stand_in(get_model("deepseek-v3"))  # 3 x 18432 and 58 x 2048: mean 2854
    assert ds.ffn_dim == 2944 and ds.kv_lora_rank == 512


def test_routed_expert_terms():
    model = get_model("qwen3-30b-a3b")
    ctx = StepQuestion(model, H100, 4096, 64)
    stand = stand_in_question(ctx)
    roles = (8, 1, 1, 1, 1)
    one = expert_times(ctx, stand, roles, 1, 8, 1.0)
    skew = expert_times(ctx, stand, roles, 1, 8, 1.5)
    assert skew.fwd > one.fwd and skew.a2a_fwd > one.a2a_fwd  # the busiest rank's rows
    # grouped GEMMs: 3 x 2 R h f_e FLOPs on R = T k rows, at one group's efficiency
    rows, h, f = 4096 * 8, 2048, 768
    group = 2.0 * rows * h * f / 16  # 16 local experts
    gemm = 3 * 2.0 * rows * h * f / (H100.peak_flops * H100.gemm_efficiency(group))
    assert one.fwd > gemm and one.bwd > 2 * gemm
    # one rank: no all-to-all; a rank's own slots only, whatever the imbalance
    alone = expert_times(ctx, stand, roles, 1, 1, 1.5)
    assert alone.a2a_fwd == alone.a2a_bwd == 0.0
    assert alone.fwd == expert_times(ctx, stand, roles, 1, 1, 1.0).fwd


def test_the_expert_group_is_consecutive_ranks_on_any_axes():
    """The expert axis folds over the stage's ranks innermost first: its all-to-alls run over
    ``G_expert`` consecutive ranks (stride 1) whatever axes they span, with the bytes of the
    tokens each rank routes; the expert gradients are summed over expert-data only (the
    stage's ranks over ``G_expert``, at stride ``G_expert``)."""
    model = get_model("qwen3-30b-a3b")
    ctx = StepQuestion(model, H100, 4096, 64)
    stand = stand_in_question(ctx)
    data = expert_times(ctx, stand, (8, 1, 1, 1, 1), 1, 8, 1.0)
    z = expert_times(ctx, stand, (1, 1, 8, 1, 1), 1, 8, 1.0)  # Z ranks: other samples' tokens
    assert (z.a2a_fwd, z.a2a_bwd) == (data.a2a_fwd, data.a2a_bwd)
    t, k, h = 4096 / 8, model.top_k, model.dim  # y=4, x=2: each tensor rank routes 1/8
    yx = expert_times(ctx, stand, (1, 1, 1, 4, 2), 1, 8, 1.0)
    sent = t * k * h * 2 * 7 / 8
    # (all of the exchanges' time: two per piece, the tokens in the expert overlap's two
    # pieces, which hides some of it: below)
    want = 4 * all_to_all_seconds(H100.network, 1, 8, sent / 2)
    assert yx.a2a_total_bwd == pytest.approx(want) and yx.a2a_total_bwd < z.a2a_total_bwd
    # 16 consecutive ranks: two nodes, where 8 of them were in one
    wide = expert_times(ctx, stand, (2, 1, 8, 1, 1), 1, 16, 1.0)
    assert wide.a2a_total_bwd > 2 * data.a2a_total_bwd
    # gradients: one all-reduce over the stage's 32 / 4 = 8 ranks at stride 4
    experts = 4 * model.moe_layers * model.expert_params() / 4
    ep, _ = grad_sync_seconds(ctx, (2, 1, 4, 2, 2), 4)
    assert ep == pytest.approx(H100.network.link(4, 8).time(ALL_REDUCE, experts))
    assert grad_sync_seconds(ctx, (1, 1, 2, 2, 2), 8)[0] == 0.0  # no expert-data group
    assert grad_sync_seconds(ctx, (1, 1, 2, 2, 2), 4)[0] > 0.0  # over Z's... and Y's ranks


def test_moe_estimate_adds_the_expert_axis():
    model = get_model("qwen3-30b-a3b")
    ctx = StepQuestion(model, get_machine("h200-node"), 4096, 64)
    ep = moe_estimate(ctx, (8, 1, 1, 1, 1), 1, "none", 8)
    ex = expert_times(ctx, stand_in_question(ctx), (8, 1, 1, 1, 1), 1, 8, 1.0)
    blocks, acc = model.moe_layers, ep.grad_accum
    a2a = blocks * acc * (ex.a2a_fwd + ex.a2a_bwd)
    assert ep.exposed_s["expert"] == pytest.approx(a2a)  # no Z, expert-data, Y or X to sum over
    assert moe_estimate(ctx, (8, 1, 1, 1, 1), 1, "none", 1).exposed_s["expert"] == 0.0
    skewed = moe_estimate(ctx, (8, 1, 1, 1, 1), 1, "none", 8, imbalance=1.5)
    assert skewed.step_s > ep.step_s
    full = moe_estimate(ctx, (8, 1, 1, 1, 1), 1, "full", 8)
    assert full.recompute_s > 0 and full.exposed_s["expert"] > ep.exposed_s["expert"]


def test_the_searches_rank_moe_configurations():
    model = get_model("mixtral-8x7b")
    rows, stats = search_moe_4d(model, H100, 64, 256, 4096, top=3)
    assert len(rows) == 3 and stats["evaluated"] >= 3
    assert rows[0].step_s <= rows[1].step_s <= rows[2].step_s
    for r in rows:
        assert r.memory.fits and r.expert >= 1
        d, c, z, y, x = r.grid
        assert (d * c * z * y * x) % r.expert == 0 and model.n_experts % r.expert == 0
        assert r.pipe * d * c * z * y * x == 64
    classic, _ = search_moe_classic(model, H100, 64, 256, 4096, top=2)
    assert classic and all(r.memory.fits and r.expert >= 1 for r in classic)
    # the same question through plan(): both spaces, the expert axis in the labels
    res = plan(model, H100, 64, 256, 4096, top=2)
    assert " ep=" in res.rows[0].label() and " ep=" in res.classic[0].label()
    assert res.rows[0].to_dict()["expert_parallel"] == res.rows[0].expert


def test_qwen3_30b_fits_on_eight_h100s_with_experts_over_tensor_ranks():
    """Issue 46's question: Qwen3-30B-A3B on one DGX H100 node (global batch 64 x 4096) fits
    only with the expert axis over tensor ranks (the Linears and the experts both split 8
    ways; over data alone the other weights stay whole)."""
    from tetrad.plan.memory.runtime import runtime_memory

    model = get_model("qwen3-30b-a3b")
    rows, _ = search_moe_4d(model, H100, 8, 64, 4096, top=3)
    for r in rows:
        d, c, z, y, x = r.grid
        assert r.memory.fits and r.expert == 8 and d * c < 8  # over Z, Y or X ranks too
    data = runtime_memory(
        model,
        (8, 1, 1, 1, 1),
        1,
        4096,
        H100.memory_bytes,
        activation_checkpointing="full",
        expert=8,
        shard_optimizer=True,
    )
    assert not data.fits  # the experts over data alone: the attention and tables whole


def test_memory_falls_with_the_expert_axis():
    """The search takes a configuration that does not fit with ``G_expert`` as not fitting
    with any smaller one (2 or more): the memory model must be monotone in it."""
    from tetrad.plan.memory.pipeline import stage_memory
    from tetrad.plan.memory.runtime import runtime_memory
    from tetrad.plan.moe_step import moe_split

    model = get_model("qwen3-30b-a3b")
    ctx = StepQuestion(model, H100, 4096, 64)
    for grid, mode, zero in [((1, 1, 8, 1, 1), "full", False), ((2, 2, 1, 2, 1), "none", True)]:
        totals = [
            runtime_memory(
                model,
                grid,
                1,
                4096,
                H100.memory_bytes,
                activation_checkpointing=mode,
                expert=ep,
                shard_optimizer=zero,
            ).total
            for ep in (2, 4, 8)
        ]
        assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]
        rank = moe_split(ctx, grid, 1, mode, 2)[0]
        stages = [
            stage_memory(
                model,
                grid,
                1,
                4096,
                H100.memory_bytes,
                rank,
                "1f1b",
                2,
                8,
                activation_checkpointing=mode,
                expert=ep,
                shard_optimizer=zero,
            ).total
            for ep in (2, 4, 8)
        ]
        assert stages == sorted(stages, reverse=True) and stages[0] > stages[-1]


@pytest.mark.parametrize("gpus, batch", [(64, 256), (8, 64)])
def test_the_search_floor_is_below_every_step(monkeypatch, gpus, batch):
    """The best-first search may skip a configuration only if its floor is not below the top's
    slowest: each floor must be at most the configuration's step."""
    import tetrad.plan.search.moe as search

    seen, timed = [], search._row

    def row(ctx, cand, imbalance, *rest):
        r = timed(ctx, cand, imbalance, *rest)
        seen.append((search._floor(ctx, *cand[:5], imbalance), r.step_s))
        return r

    monkeypatch.setattr(search, "_row", row)
    search_moe_4d(get_model("qwen3-30b-a3b"), H100, gpus, batch, 4096, top=20)
    assert len(seen) >= 20
    assert all(floor <= step * (1 + 1e-12) for floor, step in seen)


def test_expert_overlap_hides_exchanges_behind_the_other_pieces():
    """Without the ``expert`` overlap every all-to-all is exposed; with it (the default) the
    tokens in two pieces: each piece's exchanges run behind the other's GEMMs, so about half
    the rows' time is exposed when the GEMMs are the longer, and the piece GEMMs are timed at
    their own (smaller) rows; the classic model takes one piece."""
    from tetrad.plan.comm.experts import pipelined_seconds

    model = get_model("qwen3-30b-a3b")
    roles = (8, 1, 1, 1, 1)
    on = StepQuestion(model, H100, 4096, 64)
    off = StepQuestion(model, H100, 4096, 64, overlaps="prefetch,reduce_scatter,dp_all_reduce")
    stand = stand_in_question(on)
    a, b = expert_times(on, stand, roles, 1, 8, 1.0), expert_times(off, stand, roles, 1, 8, 1.0)
    # the same bytes in twice the calls: each call's latency once more
    assert b.a2a_total_bwd < a.a2a_total_bwd < 1.1 * b.a2a_total_bwd
    assert (b.a2a_fwd, b.a2a_bwd) == pytest.approx((b.a2a_total_fwd, b.a2a_total_bwd))
    assert b.a2a_total_bwd / 2 <= a.a2a_bwd < 0.75 * b.a2a_total_bwd
    assert a.fwd >= b.fwd  # two half-size GEMMs, no faster than one
    assert expert_times(on, stand, roles, 1, 8, 1.0, pieces=1) == b
    # the span: dispatches d (both issued at once), computes c, combines d; c > d hides all
    # but the first dispatch and the last combine
    assert pipelined_seconds([1, 1], [3, 3], [1, 1]) == 1 + 3 + 3 + 1
    assert pipelined_seconds([1], [3], [1]) == 5
    # exchanges longer than the GEMMs: the communicator is the critical path
    assert pipelined_seconds([4, 4], [1, 1], [4, 4]) == 16  # every exchange back to back


def test_expert_gradient_sums_hide_behind_backward():
    """With the ``dp_all_reduce`` overlap the experts' expert-data sum is issued a block at a
    time during backward (tetrad/parallel/expert_grads.py): exposed, one block's share and
    whatever each share exceeds a block's backward by; without it all of it."""
    from tetrad.plan.moe_step import expert_sync_exposed

    model = get_model("qwen3-30b-a3b")
    on = StepQuestion(model, H100, 4096, 64)
    off = StepQuestion(model, H100, 4096, 64, overlaps="prefetch,reduce_scatter")
    assert expert_sync_exposed(off, 4.8, 48, 0.01) == 4.8
    assert expert_sync_exposed(on, 4.8, 48, 0.2) == pytest.approx(0.1)  # shares hidden
    assert expert_sync_exposed(on, 4.8, 48, 0.04) == pytest.approx(0.1 + 47 * 0.06)
    assert expert_sync_exposed(on, 0.0, 48, 0.04) == 0.0
