"""The MoE feed-forward on one process: grouped GEMMs against a per-expert loop, the router's
rules, the load-balancing loss's normalisation, the aux-loss-free bias update, and the
activation-checkpointing modes against none."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tetrad.models.moe import (
    GroupedExperts,
    Router,
    can_grouped_mm,
    combine,
    expert_counts,
    expert_swiglu,
    load_balance_loss,
    put_rows,
    router_z_loss,
    routing_figures,
    sort_by_expert,
)
from tetrad.models.reference import Llama
from tetrad.parallel import init_parameters
from tetrad.spec.model import ModelError
from tetrad.spec.presets import PRESETS, parse_model

CFG = PRESETS["moe-tiny"]


def test_grouped_mm_equals_loop_with_empty_groups():
    g = torch.Generator().manual_seed(0)
    e, f, h = 4, 8, 16
    w1, w3 = torch.randn(e, f, h, generator=g), torch.randn(e, f, h, generator=g)
    w2 = torch.randn(e, h, f, generator=g)
    xs = torch.randn(10, h, generator=g)
    counts = torch.tensor([3, 0, 7, 0])  # two experts without tokens
    assert can_grouped_mm(xs, h, f)
    outs, grads = [], []
    for grouped in (True, False):
        ws = [w.clone().requires_grad_() for w in (w1, w3, w2)]
        x = xs.clone().requires_grad_()
        y = expert_swiglu(x, counts, *ws, grouped=grouped)
        y.backward(torch.ones_like(y) * 0.5 + 0.0)  # a contiguous upstream gradient
        outs.append(y)
        grads.append([x.grad, *(w.grad for w in ws)])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_experts_equal_a_dense_per_token_sum():
    """Dropless dispatch + combine: each token gets sum_j w_j SwiGLU_{id_j}(x)."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(6, 16)
    ids = torch.tensor([[0, 2], [2, 0], [1, 3], [3, 3 - 1], [0, 1], [2, 1]])
    w = torch.rand(6, 2)
    want = torch.stack(
        [
            sum(
                w[t, j]
                * (
                    (F.silu(x[t] @ experts.w1[e].t()) * (x[t] @ experts.w3[e].t()))
                    @ experts.w2[e].t()
                )
                for j, e in enumerate(ids[t].tolist())
            )
            for t in range(6)
        ]
    )
    torch.testing.assert_close(experts(x, ids, w), want, rtol=1e-5, atol=1e-6)


def test_combine_in_bf16_within_its_tolerance_and_put_rows_is_the_inverse_gather():
    """In bf16 each slot's weight and its product with the expert output are rounded to bf16
    (2**-8 of each, bf16's unit roundoff) before the sum over ``k``, where the fp32 combine
    multiplied the same bf16 outputs by the fp32 weights exactly: each token's output is within
    2**-7 of the sum of its terms' magnitudes of that; put_rows equals a gather by the inverse
    permutation, forward and backward."""
    g = torch.Generator().manual_seed(0)
    t, k, h = 64, 4, 32
    ys = torch.randn(t * k, h, generator=g).bfloat16()
    ids = torch.randint(0, 8, (t, k), generator=g)
    weights = torch.rand(t, k, generator=g)
    order, _ = sort_by_expert(ids, 8)
    slot = ys.double() * weights.flatten()[order, None].double()  # the fp32 path's terms
    exact = put_rows(slot, order).view(t, k, h).sum(1)
    scale = put_rows(slot.abs(), order).view(t, k, h).sum(1)
    got = combine(ys, order, weights, torch.float64)
    assert ((got - exact).abs() <= 2**-7 * scale).all()
    assert (got - exact).abs().max() > 0  # really rounded
    x = torch.randn(t * k, h, generator=g, requires_grad=True)
    y = put_rows(x, order)
    assert torch.equal(y, x[torch.argsort(order)])
    dy = torch.randn(t * k, h, generator=g)
    (gx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(gx, dy[order])


def test_sort_by_expert_is_stable():
    order, counts = sort_by_expert(torch.tensor([[2, 0], [0, 1], [2, 1]]), 4)
    assert order.tolist() == [1, 2, 3, 5, 0, 4] and counts.tolist() == [2, 2, 2, 0]


def test_softmax_router_renormalises_and_scales():
    cfg = dataclasses.replace(CFG, route_scale=2.0)
    gate = torch.nn.Linear(8, 4, bias=False)
    router = Router(cfg, gate)
    x = torch.randn(5, 8)
    ids, w, probs = router(x)
    p = torch.softmax(gate(x), -1)
    top = p.topk(2, -1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(w, 2.0 * top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(probs, p)


def test_sigmoid_bias_chooses_but_does_not_weigh():
    cfg = dataclasses.replace(
        CFG, router_score="sigmoid", bias_update_rate=0.1, router_renorm=False
    )
    gate = torch.nn.Linear(8, 4, bias=False)
    router = Router(cfg, gate).train()
    router.bias.copy_(torch.tensor([10.0, 10.0, -10.0, -10.0]))  # force experts 0 and 1
    x = torch.randn(5, 8)
    ids, w, _ = router(x)
    assert sorted(ids[0].tolist()) == [0, 1]
    torch.testing.assert_close(w, torch.sigmoid(gate(x)).gather(-1, ids))  # unbiased scores
    assert router.tokens_per_expert.tolist() == [5.0, 5.0, 0.0, 0.0]


def test_bias_update_sign_rule_zero_mean():
    cfg = dataclasses.replace(CFG, bias_update_rate=0.01)
    router = Router(cfg, torch.nn.Linear(8, 4, bias=False))
    router.update_bias(torch.tensor([10.0, 2.0, 2.0, 2.0]))  # mean 4: expert 0 overloaded
    # delta = 0.01 * sign(4 - c) = [-1, 1, 1, 1] * 0.01, minus its mean 0.005
    torch.testing.assert_close(router.bias, torch.tensor([-0.015, 0.005, 0.005, 0.005]))
    assert router.tokens_per_expert.sum() == 0


def test_load_balance_loss_is_one_when_balanced_and_larger_when_not():
    b, s, e, k = 2, 8, 4, 2
    probs = torch.full((b, s, e), 1 / e)
    ids = torch.tensor([[0, 1], [2, 3]] * (b * s // 2)).view(b, s, k)  # each expert s/2 times
    assert load_balance_loss(probs, ids, e).item() == pytest.approx(b)  # 1 per sequence
    assert load_balance_loss(probs, ids, e, "batch").item() == pytest.approx(b)
    skew = torch.zeros(b, s, e)
    skew[..., 0] = 1.0
    collapsed = torch.zeros(b, s, k, dtype=torch.long)
    collapsed[..., 1] = 1
    # all slots on experts 0 and 1, all probability on 0: E * (1/2 * 1) = 2 per sequence
    assert load_balance_loss(skew, collapsed, e).item() == pytest.approx(2 * b)


def test_load_balance_loss_value_and_routing_figures():
    """``E sum_i f_i P_i`` on a case where neither ``f`` nor ``P`` is uniform (either one
    uniform gives 1 whatever the other: why the max/mean load is reported beside it), and the
    figures a run reports from the summed statistics."""
    e = 4
    ids = torch.tensor([[[0, 1], [0, 2], [0, 1], [0, 2]]])  # slots: 4, 2, 2, 0 of 8
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1]).expand(1, 4, e)
    # f = [1/2, 1/4, 1/4, 0]: 4 * (0.5 * 0.4 + 0.25 * 0.3 + 0.25 * 0.2) = 1.3
    assert load_balance_loss(probs, ids, e).item() == pytest.approx(1.3)
    assert load_balance_loss(torch.full((1, 4, e), 1 / e), ids, e).item() == pytest.approx(1)
    counts = expert_counts(ids, e)
    assert counts.tolist() == [4, 2, 2, 0] and counts.dtype == torch.int64
    # two such sequences: their summed statistics, then per step max/mean 4/2, balance 1.3
    stats = torch.cat([2 * counts.float(), torch.tensor([2 * 1.3, 0.0])])
    max_load, balance, _ = routing_figures(torch.stack([stats, stats]), 2)
    assert max_load.tolist() == [2.0, 2.0] and balance.tolist() == pytest.approx([1.3, 1.3])


def test_router_z_loss_is_the_mean_squared_logsumexp():
    """ST-MoE eq. 5 per sequence, summed over sequences; a sequence cut in two parts (context,
    Y, X) gives shares that add up to the whole."""
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]])  # 1 sequence, 2 tokens
    lse = torch.tensor([math.log(4.0), math.log(sum(math.exp(v) for v in (1, 2, 3, 4)))])
    assert router_z_loss(logits).item() == pytest.approx(lse.square().mean().item(), rel=1e-6)
    both = torch.cat([logits, 2 * logits])  # two sequences: the sum of their means
    want = router_z_loss(logits) + router_z_loss(2 * logits)
    assert router_z_loss(both).item() == pytest.approx(want.item(), rel=1e-6)
    parts = [router_z_loss(both[:, i : i + 1], parts=2) for i in (0, 1)]
    assert sum(parts).item() == pytest.approx(want.item(), rel=1e-6)


def test_z_loss_joins_the_aux_loss_and_the_routing_row():
    """A block's term is ``aux_loss_coef`` x balance + ``router_z_loss_coef`` x z; the routing
    row reports z per block; a coefficient of 0 leaves the row as it was."""
    from tetrad.train.routing import routing_row, take_step_routing

    cfg = dataclasses.replace(CFG, router_z_loss_coef=0.001)
    model = Llama(cfg)
    init_parameters(model, 3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    model.loss_sum(tokens[:, :-1], tokens[:, 1:])
    aux = model.aux_loss_sum().item()
    model.record_routing()
    (block,) = model.moe_blocks().values()
    row = routing_row(take_step_routing([model], cfg), cfg, 2)
    (i,) = row["moe_z_loss"]
    z, balance = row["moe_z_loss"][i], row["moe_balance"][i]
    assert z > 0 and aux / 2 == pytest.approx(0.01 * balance + 0.001 * z, rel=1e-6)
    captured = {}
    hook = block.router.gate.register_forward_hook(lambda m, a, out: captured.update(out=out))
    model.loss_sum(tokens[:, :-1], tokens[:, 1:])
    hook.remove()
    flat = torch.logsumexp(captured["out"].float(), -1).square().mean()
    assert z == pytest.approx(flat.item(), rel=1e-6)
    off = routing_row(take_step_routing([model], CFG), CFG, 2)
    assert "moe_z_loss" not in off


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_modes_match_none(mode):
    """With Qwen3's q/k norms too: their weights are inputs of the recomputed RoPE."""
    cfg = dataclasses.replace(CFG, qk_norm=True)
    tokens = torch.randint(0, CFG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    results = []
    for m in ("none", mode):
        model = Llama(cfg, activation_checkpointing=m)
        init_parameters(model, 3)
        torch.manual_seed(5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "_norm" in name and "attention." in name:
                    p.uniform_(0.5, 1.5)
        lm = model.loss_sum(tokens[:, :-1], tokens[:, 1:])
        aux = model.aux_loss_sum()
        (lm / tokens[:, 1:].numel() + aux / 4).backward()
        results.append((lm.detach(), aux.detach(), [p.grad.clone() for p in model.parameters()]))
        assert model.layers["1"].attention.q_norm.weight.grad.abs().sum() > 0
    (lm0, aux0, g0), (lm1, aux1, g1) = results
    assert torch.equal(lm0, lm1) and torch.equal(aux0, aux1)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_dense_blocks_and_names():
    model = Llama(CFG)
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.feed_forward.w13.weight" in names  # dense_layers=1
    for n in ("router.gate.weight", "experts.w1", "experts.w2", "experts.w3", "shared.w13.weight"):
        assert f"layers.1.feed_forward.{n}" in names
    assert model.layers["1"].feed_forward.experts.w1.shape == (4, 32, 64)
    assert model.layers["1"].feed_forward.experts.w2.shape == (4, 64, 32)
    assert sum(p.numel() for p in model.parameters()) == CFG.num_params()


def test_config_validation_and_parsing():
    cfg, given = parse_model("moe-tiny,router_score=sigmoid,router_renorm=false,top_k=1")
    assert cfg.router_score == "sigmoid" and cfg.router_renorm is False and cfg.top_k == 1
    with pytest.raises(ModelError, match="top_k=5"):
        parse_model("moe-tiny,top_k=5")
    with pytest.raises(ModelError, match="router_score"):
        parse_model("moe-tiny,router_score=relu")
    assert not PRESETS["small"].is_moe and PRESETS["small"].n_experts == 0


def test_moe_small_matches_small_active_parameters():
    small, moe = PRESETS["small"], PRESETS["moe-small"]
    assert moe.active_params() == small.num_params() + 4 * 8 * 256  # plus the routers
    assert moe.num_params() > 2 * small.num_params()
    assert moe.flops_per_token(256) == pytest.approx(small.flops_per_token(256), rel=2e-3)
