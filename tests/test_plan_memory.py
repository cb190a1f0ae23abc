"""Memory estimators: Fujii et al.'s reference values, and tetrad's runtime model by hand."""

import json

import pytest

from tetrad.plan.errors import PlanError
from tetrad.plan.memory.activations import block_saved_bytes, saved_activations
from tetrad.plan.memory.breakdown import FIT_FRACTION, MemoryBreakdown
from tetrad.plan.memory.buffers import gathered_weight_bytes, weight_gradient_bytes
from tetrad.plan.memory.fujii import fujii2024
from tetrad.plan.memory.runtime import fewest_selective, runtime_memory
from tetrad.plan.memory.states import local_parameter_elements
from tetrad.spec.activation_checkpointing import CheckpointingError, recompute_order
from tetrad.spec.grid import GridError
from tetrad.spec.overlap import REDUCE_SCATTERS_IN_FLIGHT
from tetrad.spec.presets import PRESETS, get_model
from tetrad.spec.sharding import check_grid, grid_problems
from tetrad.spec.units import GiB

L31_8B = PRESETS["llama-3.1-8b"]
L3_8B = PRESETS["llama-3-8b"]
L3_70B = PRESETS["llama-3-70b"]


def split(r: MemoryBreakdown) -> tuple[float, float]:
    """(weight + optimizer GiB, activation GiB) as the paper reports them."""
    c = r.components
    w = c["parameters"] + c["gradients"] + c["optimizer_states"]
    a = c["activations"] + c["embedding_input"] + c["logits_and_loss"]
    return w / GiB, a / GiB


# memory-estimation.md section 7: the authors' unit-test expectations (s = 8192).
AUTHORS = [  # t, c, p, b, d, weight + optimizer GiB, activation GiB
    (2, 1, 1, 1, 2, 44.87260437011719, 22.64453125),
    (1, 2, 1, 1, 2, 67.30887222290039, 22.64453125),
    (2, 1, 2, 1, 32, 11.919273376464844, 20.75),
    (2, 2, 1, 2, 32, 23.137436628341675, 22.64453125),
]


@pytest.mark.parametrize("t, c, p, b, d, weights, acts", AUTHORS)
def test_fujii_authors_values(t, c, p, b, d, weights, acts):
    r = fujii2024(
        L31_8B, tp=t, cp=c, pp=p, dp=d, micro_batch=b, seq_len=8192, gpu_memory_bytes=94e9
    )
    w, a = split(r)
    assert w == pytest.approx(weights, rel=1e-6)
    assert a == pytest.approx(acts, rel=1e-6)


# Section 7 "further outputs" (printed to 2 decimals). Exact values derived by hand:
# P_layer(8B) = 218,112,000, P_layer(70B) = 855,654,400, V h = 525,336,576 (8B) and
# 1,050,673,152 (70B); activation units per layer 41 (8B) and 40.5 (70B) sbh.
EXTRA = [  # model, t, p, c, d, exact weight+opt bytes, exact activation bytes, printed w, a, total
    (
        L3_8B,
        4,
        1,
        1,
        2,
        (8_030_257_152 / 4 + 4096) * 12,
        41 * 8192 * 4096 / 4 * 32 + 8 * 8192 * 4096 / 4 + 4 * 8192 * (4096 + 128256) / 4,
        22.44,
        11.32,
        33.76,
    ),
    (
        L3_8B,
        4,
        8,
        1,
        4,
        (4 * 218_112_000 + 525_336_576) / 4 * 9,
        41 * 8192 * 4096 / 4 * 32 + 8 * 8192 * 4096 * 8 / 4,
        2.93,
        10.75,
        13.68,
    ),
    (
        L3_70B,
        8,
        8,
        1,
        2,
        (10 * 855_654_400 + 1_050_673_152) / 8 * 12,
        40.5 * 8192 * 8192 / 8 * 80 + 8 * 8192 * 8192 * 8 / 8,
        13.42,
        25.81,
        39.23,
    ),
    (
        L3_70B,
        8,
        4,
        2,
        1,
        (20 * 855_654_400 + 1_050_673_152) / 8 * 12,
        40.5 * 4096 * 8192 / 8 * 80 + 8 * 4096 * 8192 * 4 / 8,
        25.37,
        12.78,
        38.16,
    ),
    (
        L3_70B,
        4,
        8,
        1,
        4,
        (10 * 855_654_400 + 1_050_673_152) / 4 * 9,
        40.5 * 8192 * 8192 / 4 * 80 + 8 * 8192 * 8192 * 8 / 4,
        20.13,
        51.62,
        71.76,
    ),
]


@pytest.mark.parametrize("model, t, p, c, d, w_exact, a_exact, w2, a2, total2", EXTRA)
def test_fujii_further_outputs(model, t, p, c, d, w_exact, a_exact, w2, a2, total2):
    r = fujii2024(model, tp=t, cp=c, pp=p, dp=d, micro_batch=1, seq_len=8192, gpu_memory_bytes=94e9)
    w, a = split(r)
    assert w == pytest.approx(w_exact / GiB, rel=1e-6)
    assert a == pytest.approx(a_exact / GiB, rel=1e-6)
    assert abs(w - w2) <= 0.005 + 1e-9 and abs(a - a2) <= 0.005 + 1e-9
    assert abs(r.total / GiB - total2) <= 0.01


def test_fujii_worked_decomposition_row_1():
    r = fujii2024(L31_8B, 2, 1, 1, 2, 1, 8192, 94e9).components
    n = 4_015_132_672
    assert r["parameters"] == 2 * n and r["gradients"] == 4 * n and r["optimizer_states"] == 6 * n
    assert r["activations"] / GiB == 20.5
    assert r["embedding_input"] / GiB == 0.125
    assert r["logits_and_loss"] / GiB == 2.01953125


def test_fujii_options():
    base = fujii2024(L31_8B, 2, 1, 4, 8, 1, 8192, 80e9)
    # fewer micro-batches than stages: activations (layers + embedding input) scale by m/p
    few = fujii2024(L31_8B, 2, 1, 4, 8, 1, 8192, 80e9, num_microbatches=2)
    assert few.components["activations"] == base.components["activations"] / 2
    assert few.components["embedding_input"] == base.components["embedding_input"] / 2
    # interleaved 1F1B: 1 + (p-1)/(p v)
    inter = fujii2024(L31_8B, 2, 1, 4, 8, 1, 8192, 80e9, virtual_pp=2)
    assert inter.components["activations"] == base.components["activations"] * (1 + 3 / 8)
    # no distributed optimizer: 12 bytes per parameter; bf16 gradients: 2
    plain = fujii2024(L31_8B, 2, 1, 4, 8, 1, 8192, 80e9, distributed_optimizer=False, grad_bytes=2)
    n = plain.components["parameters"] / 2
    assert plain.components["optimizer_states"] == 12 * n
    assert plain.components["gradients"] == 2 * n
    assert base.components["logits_and_loss"] == 0  # only when p = 1


def test_fujii_gpt_uses_korthikanti():
    m = PRESETS["gpt-5b"]
    r = fujii2024(m, 4, 1, 1, 8, 1, 2048, 80e9)
    assert r.components["activations"] == 24 * 34 * 2048 * 4096 / 4


@pytest.mark.parametrize("kw", [dict(tp=0), dict(pp=5), dict(micro_batch=-1), dict(grad_bytes=3)])
def test_fujii_errors(kw):
    args = dict(tp=1, cp=1, pp=1, dp=1, micro_batch=1, seq_len=8192, gpu_memory_bytes=80e9)
    args.update(kw)
    with pytest.raises(PlanError):
        fujii2024(L31_8B, **args)


def test_breakdown_verdict_and_dict():
    r = MemoryBreakdown({"a": 60.0, "b": 20.0}, gpu_memory_bytes=100.0)
    assert r.total == 80.0 and r.fraction == 0.8 and r.fits and FIT_FRACTION == 0.8
    r.components["b"] = 20.5
    assert not r.fits
    d = json.loads(json.dumps(r.to_dict()))
    assert d["total_bytes"] == 80.5 and d["fits"] is False


# ---- tetrad ----------------------------------------------------------------------------------


def test_tetrad_parameters_by_hand():
    grid = (2, 2, 2, 2)
    r = runtime_memory(L31_8B, grid, 1, 8192, 141e9)
    h, f, kv, V, L = 4096, 14336, 1024, 128256, 32
    matrices = (L * (2 * h * h + 2 * h * kv + 3 * h * f) + 2 * V * h) // (2 * 2 * 2)
    vectors = (2 * L + 1) * h // 2  # RMSNorm weights h/G_x, replicated over Y, Z, data
    assert local_parameter_elements(L31_8B, grid)["matrices"] == matrices
    assert r.components["parameters"] == 4 * (matrices + vectors)
    assert r.components["gradients"] == 4 * (matrices + vectors)
    assert r.components["optimizer_states"] == 8 * (matrices + vectors)


def test_bf16_weights_with_fp32_masters_by_hand():
    """``params="bf16"`` (``--param-dtype bf16``): 2-byte weights, 4-byte gradients, 12-byte
    states (masters with the moments, all sharded over data x context with the sharded
    optimizer: Fujii et al.'s 2 + 4 + 12 / (d c); unsharded 18 bytes, more than fp32
    weights' 16); with ``G_z = 1`` the bf16 weights are read
    as they are (no gathered copy) and the sharded all-gathers after the update are bf16."""
    grid = (8, 4, 1, 2, 1)  # data 8 x context 4 x Y 2: the 70B layout without pipe
    args = (L3_70B, grid, 1, 8192, 141e9)
    for shard in (False, True):
        fp32 = runtime_memory(*args, shard_optimizer=shard)
        bf16 = runtime_memory(*args, shard_optimizer=shard, params="bf16")
        n = fp32.components["parameters"] / 4
        states = 12 * n / (32 if shard else 1)
        assert bf16.components["parameters"] == 2 * n
        assert bf16.components["gradients"] == fp32.components["gradients"] == 4 * n
        assert bf16.components["optimizer_states"] == pytest.approx(states, rel=1e-12)
        # 18 bytes per element against 16 unsharded (Megatron's too); 6 + 12/G sharded
        assert (bf16.total < fp32.total) == shard
    lin = L3_70B.linears()[2]
    assert gathered_weight_bytes(lin, (1, 1, 2, 1), "bf16", "bf16") == 0
    assert gathered_weight_bytes(lin, (1, 2, 2, 1), "bf16", "bf16") == gathered_weight_bytes(
        lin, (1, 2, 2, 1), "bf16", "fp32"
    )
    # the sharded step: reduced fp32 pieces 4n/G + the first unit's (the embedding's) bf16
    # all-gather 2 e (1 + 1/G), e = V h / G_y: the only one in flight
    n = local_parameter_elements(L3_70B, (4, 1, 2, 1))
    n = n["matrices"] + n["vectors"]
    step = runtime_memory(L3_70B, (4, 1, 2, 1), 1, 8192, 141e9, shard_optimizer=True, params="bf16")
    e = L3_70B.vocab_size * L3_70B.dim / 2
    assert step.phases["optimizer step"] == pytest.approx(
        sum(step.components[k] for k in ("parameters", "gradients", "optimizer_states"))
        + 4 * n / 4
        + 2 * e * (1 + 1 / 4)
    )
    with pytest.raises(PlanError, match="param dtype 'fp16' is unknown: use fp32 or bf16"):
        runtime_memory(*args, params="fp16")


def test_tetrad_gpt_parameters_by_hand():
    m = PRESETS["gpt-5b"]
    h, L, V, P = 4096, 24, 51200, 2048
    gd, gz, gy, gx = 1, 4, 2, 2
    matrices = (L * 12 * h * h + (2 * V + P) * h) // (gx * gy * gz)
    # biases: qkv 3h/G_y, proj h/G_x, fc1 4h/G_y, fc2 h/G_x; LayerNorms 2h/G_x each
    vectors = L * (3 * h // gy + h // gx + 4 * h // gy + h // gx + 2 * 2 * h // gx) + 2 * h // gx
    r = runtime_memory(m, (gd, gz, gy, gx), 1, 2048, 80e9)
    assert r.components["parameters"] == 4 * (matrices + vectors)


def test_tetrad_block_activations_by_hand():
    S, b = 8192, 1
    m = b * S
    grid = (1, 1, 2, 2)
    hx, qy, kvy, fy, ay, hd = 2048, 2048, 512, 7168, 16, 128
    rope = 4 * S * (hd // 2) * 4
    # bf16 with an fp32 stream (--residual-dtype fp32): residual fp32 [x, h], normalised fp32
    # (x2), rsqrt (x2), bf16 copies of the norm outputs for the fused wqkv and w13; q, k, v,
    # SDPA out in bf16, fp32 log-sum-exp; 4 SwiGLU.
    rest = 2 * 4 * m + 2 * 2 * m * hx + 2 * m * (2 * qy + 2 * kvy) + 4 * m * ay + rope
    rest += 3 * 2 * m * fy  # w13 output 2f, the product f (silu(gate) rebuilt)
    bf16 = 4 * 4 * m * hx + rest
    assert block_saved_bytes(L31_8B, grid, b, S, "bf16", residual="fp32") == bf16
    # the bf16 stream (the default): [x, h] in bf16, no normalised tensor (rebuilt in backward)
    assert block_saved_bytes(L31_8B, grid, b, S, "bf16") == 2 * 2 * m * hx + rest
    # fp32: one norm output each, SDPA out plus the out-proj input copy.
    fp32 = (
        6 * 4 * m * hx + 2 * 4 * m + 4 * m * (3 * qy + 2 * kvy) + 4 * m * ay + rope + 3 * 4 * m * fy
    )
    assert block_saved_bytes(L31_8B, grid, b, S, "fp32") == fp32


def test_tetrad_gpt_block_by_hand():
    m_spec = PRESETS["gpt-5b"]
    S, grid = 2048, (1, 2, 2, 2)
    m, hx, qy, fy, ay = S, 2048, 2048, 8192, 16
    norm = 4 * m * hx + 2 * 4 * m + 4 * m * hx + 2 * m * hx  # input, mean+rstd, normed, cast
    attn = 2 * m * (3 * qy + qy) + 4 * m * ay
    want = 2 * norm + attn + 2 * 2 * m * fy
    assert block_saved_bytes(m_spec, grid, 1, S, "bf16", residual="fp32") == want
    # a bf16 stream: the input in bf16, no normalised tensor
    assert block_saved_bytes(m_spec, grid, 1, S, "bf16") == want - 2 * (2 + 4) * m * hx


def test_tetrad_checkpointing_and_totals():
    grid, S = (4, 1, 2, 4), 8192
    plain = saved_activations(L31_8B, grid, 1, S, dtype="bf16")
    ckpt = saved_activations(L31_8B, grid, 1, S, activation_checkpointing=True, dtype="bf16")
    blk = block_saved_bytes(L31_8B, grid, 1, S, "bf16")
    inp = 2 * S * 4096 // 4  # bf16: the residual stream in the compute dtype
    assert plain["blocks"] == 32 * blk and plain["recompute"] == 0
    # the block inputs and the one positions tensor [S] int64 every checkpoint keeps
    assert ckpt["blocks"] == 32 * inp + 8 * S and ckpt["recompute"] == blk - inp
    # with G_z = 1 the fused LM head and loss puts its dW into the gradient in forward; with
    # G_z > 1 it keeps its dW [V/(G_y G_x), h] in bf16 for the Z reduce-scatter (the LM head
    # splits V over Y and X), whatever the tokens
    assert ckpt["loss"] == plain["loss"] == 0
    z2 = saved_activations(L31_8B, (2, 2, 2, 4), 1, S, dtype="bf16")
    assert z2["loss"] == 2 * 128256 // (2 * 4) * 4096
    for ac in (False, True, "none", "selective", "full"):
        r = runtime_memory(L31_8B, grid, 1, S, 141e9, activation_checkpointing=ac)
        assert r.total == pytest.approx(max(r.phases.values()), rel=1e-12)
        assert r.phases[r.peak_phase] == pytest.approx(r.total, rel=1e-12)
        assert set(r.components) >= {
            "parameters",
            "gradients",
            "optimizer_states",
            "activations",
            "logits_and_loss",
            "gathered_weights",
            "reduce_scatter_buffers",
            "recompute_activations",
        }
    totals = [
        runtime_memory(L31_8B, grid, 1, S, 141e9, activation_checkpointing=mode).total
        for mode in ("full", "selective", "none")
    ]
    assert totals == sorted(totals) and totals[0] < totals[1] < totals[2]


def test_tetrad_selective_block_by_hand():
    """Selective checkpointing keeps per block the two norm inputs (bf16: the residual stream)
    and their rstd, the wqkv output, inv_freq, SDPA's output and log-sum-exp and the w13 output
    (bf16); the positions [S] int64 once; in backward the largest rebuilt set (here
    SwiGLU's). With an fp32 stream the norm inputs are fp32."""
    grid, S, b = (2, 1, 2, 4), 4096, 2
    m, hx, qy, kvy, ay, fy, d = b * S, 4096 // 4, 4096 // 2, 1024 // 2, 32 // 2, 14336 // 2, 128
    per_block = 2 * (2 * m * hx + 4 * m) + 2 * m * (qy + 2 * kvy) + 2 * m * qy + 4 * m * ay
    per_block += 2 * m * 2 * fy + 4 * d // 2
    sel = saved_activations(L31_8B, grid, b, S, activation_checkpointing="selective")
    assert sel["blocks"] == 32 * per_block + 8 * S
    assert sel["recompute"] == max(2 * m * (qy + 2 * kvy), 2 * 2 * m * fy, 12 * m * hx)
    kept = saved_activations(
        L31_8B, grid, b, S, activation_checkpointing="selective", residual="fp32"
    )
    assert kept["blocks"] == sel["blocks"] + 32 * 2 * 2 * m * hx
    assert kept["recompute"] == max(2 * m * (qy + 2 * kvy), 2 * 2 * m * fy, 10 * m * hx)
    plain = saved_activations(L31_8B, grid, b, S, activation_checkpointing="none")
    assert {k: sel[k] for k in ("embedding", "final_norm", "loss")} == {
        k: plain[k] for k in ("embedding", "final_norm", "loss")
    }
    with pytest.raises(CheckpointingError):
        saved_activations(L31_8B, grid, b, S, activation_checkpointing="partial")
    # selective:K: the last K blocks selective, the other 32 - K as without checkpointing
    part = saved_activations(L31_8B, grid, b, S, activation_checkpointing="selective:5")
    assert part["blocks"] == 5 * per_block + 27 * plain["blocks"] / 32 + 8 * S
    assert part["recompute"] == sel["recompute"]
    for bad in ("selective:0", "selective:x", "full:3", "selective:33"):
        with pytest.raises(CheckpointingError, match="selective"):
            saved_activations(L31_8B, grid, b, S, activation_checkpointing=bad)


def test_fewest_selective_blocks_fit_and_one_fewer_does_not():
    """Llama-3.1-8B on 64 GPUs of 64 GiB, S 8192, an fp32 residual stream: ``none`` does not
    fit on 4,1,16,1,1, ``selective`` does; the search's ``selective:K`` is the smallest K that
    fits (K - 1 does not), and the compute model charges K blocks' recompute."""
    grid, gpu, S, fp32 = (4, 1, 16, 1, 1), 64 * GiB, 8192, {"residual": "fp32"}

    def fits(mode):
        return runtime_memory(L31_8B, grid, 1, S, gpu, activation_checkpointing=mode, **fp32).fits

    assert not fits("none") and fits("selective")
    mode = fewest_selective(L31_8B, grid, 1, S, gpu, **fp32)
    k = int(mode.split(":")[1])
    assert 1 < k < 32 and fits(mode) and not fits(f"selective:{k - 1}")
    assert recompute_order("none") < recompute_order(mode) < recompute_order("selective")


def test_tetrad_transients():
    S, w13 = 4096, L31_8B.linears()[2]  # the fused gate/up [2f, h], the largest block weight
    f2 = 2 * 14336
    # fp32 with G_z = 1: the shard is used as is, nothing gathered
    assert gathered_weight_bytes(w13, (1, 1, 2, 2), "fp32") == 0
    # otherwise the block [2f/G_y, h/G_x] in compute dtype
    assert gathered_weight_bytes(w13, (1, 1, 2, 2), "bf16") == 2 * f2 * 4096 // 4
    assert gathered_weight_bytes(w13, (1, 4, 2, 2), "fp32") == 4 * f2 * 4096 // 4
    # dW in compute dtype (+ its fp32 copy, the reduce-scatter input, under bf16)
    assert weight_gradient_bytes(w13, (1, 4, 2, 2), "bf16") == 6 * f2 * 4096 // 4
    assert weight_gradient_bytes(w13, (1, 4, 2, 2), "fp32") == 4 * f2 * 4096 // 4
    r = runtime_memory(L31_8B, (1, 4, 2, 2), 1, S, 141e9, activation_checkpointing=True)
    blocks = r.phases["backward: blocks"]
    static = r.components["parameters"] * 4
    saved = saved_activations(L31_8B, (1, 4, 2, 2), 1, S, activation_checkpointing=True)
    # prefetch: the three largest gathered blocks (w13, w2, wqkv: in use, two in flight);
    # async reduce-scatter: the dW of w13 being formed and REDUCE_SCATTERS_IN_FLIGHT more
    in_flight = 1 + REDUCE_SCATTERS_IN_FLIGHT
    assert blocks == pytest.approx(
        static
        + saved["blocks"]
        + saved["embedding"]
        + saved["recompute"]
        + 2 * (f2 + 14336 + 6144) * 4096 // 4
        + in_flight * 6 * f2 * 4096 // 4,
        rel=1e-12,
    )
    no_pf = runtime_memory(
        L31_8B,
        (1, 4, 2, 2),
        1,
        S,
        141e9,
        activation_checkpointing=True,
        prefetch=False,
        async_reduce_scatter=False,
    )
    extra_dw = REDUCE_SCATTERS_IN_FLIGHT * 6 * f2
    assert blocks - no_pf.phases["backward: blocks"] == (2 * (14336 + 6144) + extra_dw) * 4096 // 4
    # the fused LM head and loss in forward, V/(G_y G_x) = 32064 logits per token: one block of
    # all 8192 rows (1 GiB of fp32 logits holds 8372) as bf16 logits, fp32 softmax and its bf16
    # copy (V is split: the block's statistics are all-reduced before its gradient, no more
    # logits kept); the input gathered over X [m, h] bf16; three fp32 statistics per token; the
    # head weight and the two prefetched next block weights (counted as the two largest, w13
    # and w2)
    fwd = r.phases["forward: LM head"] - static - saved["blocks"] - saved["embedding"]
    fwd -= saved["final_norm"] + saved["loss"]
    v = 128256 // 4
    logits = S * v * (2 + 4 + 2) + 2 * S * 4096 + 12 * S
    assert fwd == logits + 2 * (128256 + 2 * 14336 + 14336) * 4096 // 4
    # backward: the scaled dx [m, h] bf16 and dW's fp32 copy (the reduce-scatter input); the
    # head weight is no longer held; the two prefetched block weights (w13, w2)
    bwd = r.phases["backward: LM head"] - static - saved["blocks"] - saved["embedding"]
    bwd -= saved["final_norm"] + saved["loss"]
    assert bwd == 2 * S * 4096 + 4 * v * 4096 + 2 * 3 * 14336 * 4096 // 4


def test_tetrad_fits_a_big_model_only_when_sharded():
    m = PRESETS["llama-3.1-70b"]
    assert not runtime_memory(m, (8, 1, 1, 1), 1, 8192, 80e9).fits
    assert runtime_memory(m, (1, 4, 4, 4), 1, 4096, 80e9, activation_checkpointing=True).fits


def test_grid_problems():
    assert grid_problems(L31_8B, (1, 1, 8, 1)) == []
    bad = grid_problems(L31_8B, (1, 1, 16, 1))
    assert any("n_kv_heads=8 divisible by G_y=16" in b for b in bad)
    with pytest.raises(GridError, match="does not shard"):
        check_grid(L31_8B, (1, 1, 16, 1))
    with pytest.raises(GridError, match="does not shard"):
        runtime_memory(get_model("llama-3-8b,vocab=1001"), (1, 1, 2, 1), 1, 1024, 80e9)
    with pytest.raises(GridError):
        runtime_memory(L31_8B, (1, 1, 1), 1, 1024, 80e9)
    with pytest.raises(PlanError, match="dtype"):
        runtime_memory(L31_8B, (1, 1, 1, 1), 1, 1024, 80e9, dtype="fp8")


def test_fujii2024_refuses_sizes_that_do_not_split():
    """``tetrad memory`` (fujii2024) refuses what ``tetrad train`` and the classic search refuse:
    heads (and the other TP-split sizes) by TP, layers by PP, the sequence by 2 CP."""
    with pytest.raises(PlanError, match="n_heads=32 divisible by TP=3"):
        fujii2024(L31_8B, 3, 1, 1, 1, 1, 8192, 80e9)
    with pytest.raises(PlanError, match="32 layers do not split"):
        fujii2024(L31_8B, 1, 1, 5, 1, 1, 8192, 80e9)
    with pytest.raises(PlanError, match="2\\*CP = 6"):
        fujii2024(L31_8B, 1, 3, 1, 1, 1, 8192, 80e9)


def test_compiled_blocks_lower_the_estimate_through_every_door(capsys):
    """``compiled`` reaches the saved sets from :func:`runtime_memory`, its phase totals and
    ``tetrad memory --compile`` (llama-1b, micro-batch 16, seq 2048: the H200 lease's compiled
    run peaked at 62.63 GiB with the fp32 residual stream of the time, docs/performance.md;
    ``--residual-dtype fp32`` reproduces it: 60.41 GiB, 60.54 while the LM head kept its
    ``dW`` for backward)."""
    from tetrad import cli
    from tetrad.plan.memory.runtime import phase_totals
    from tetrad.spec.presets import parse_model

    model, _ = parse_model("llama-1b,vocab_size=32768")
    args, fp32 = (model, (1, 1, 1, 1), 16, 2048), {"residual": "fp32"}
    eager, compiled = (
        runtime_memory(*args, 139.8 * GiB, compiled=c, **fp32) for c in (False, True)
    )
    assert compiled.total < eager.total
    assert abs(compiled.total / GiB - 60.41) < 0.01 and abs(eager.total / GiB - 68.43) < 0.01
    assert max(phase_totals(*args, compiled=True, **fp32).values()) == compiled.total
    stream = runtime_memory(*args, 139.8 * GiB, compiled=True)  # the bf16 stream: less
    assert stream.total < compiled.total
    argv = ["memory", "--model", "llama-1b,vocab_size=32768", "--grid", "1,1,1,1"]
    argv += ["--micro-batch", "16", "--seq-len", "2048", "--compile", "--json"]
    argv += ["--residual-dtype", "fp32"]
    assert cli.main(argv) == 0
    assert abs(json.loads(capsys.readouterr().out)["total_bytes"] - compiled.total) < 1
