"""FP8 in the planner (issue 49): the machines' FP8 GEMM rate, the step model's FP8 terms (block
Linears at the FP8 rate with their casts, the Z all-gather in FP8 bytes and the amax
all-reduces under tensorwise), the search's bounds with them, and ``tetrad plan --fp8``.
``--fp8 off`` leaving every number as before is tests/test_plan_snapshot.py's."""

import pytest

from tetrad import cli
from tetrad.plan.compute.block import block_compute
from tetrad.plan.compute.fp8 import (
    CAST_BYTES,
    RESCALE_BYTES,
    ROWWISE_GEMM_FACTOR,
    cast_elements,
    converts,
    rescale_elements,
)
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import get_machine, parse_machine
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.four_d import search_4d
from tetrad.plan.search.fp8_choice import fp8_breakdown
from tetrad.plan.step_time import collectives, estimate
from tetrad.spec.presets import get_model

H100 = get_machine("dgx-h100")
L8B = get_model("llama-3.1-8b")


# ---- 1. machines ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dgx-h100", "h200-node"])
def test_hopper_fp8_peak_is_twice_bf16_and_cited(name):
    m = get_machine(name)
    assert m.has_fp8 and m.fp8_peak_flops == 1979e12  # the datasheet rounds 2 x 989.4
    assert m.fp8_peak_flops == pytest.approx(2 * m.peak_flops, rel=1e-3)
    assert "1,979 dense" in m.sources["peak_fp8_tflops"]
    assert "FBGEMM" in m.sources["fp8_gemm_efficiency"]
    # the sanity check of the curve: an 8192^3 GEMM runs 1.8-2.0x faster in FP8 (FBGEMM
    # PR #2546 measured 1.88-2.09x on an H100), a 1e8-FLOP one takes the bf16 seconds
    big, small = 2 * 8192.0**3, 1e8
    rate = lambda f, fp8: (  # noqa: E731
        m.fp8_peak_flops * m.fp8_gemm_efficiency(f) if fp8 else m.peak_flops * m.gemm_efficiency(f)
    )
    assert 1.8 <= rate(big, True) / rate(big, False) <= 2.0
    assert rate(small, True) == pytest.approx(rate(small, False), rel=1e-3)


def test_machines_without_fp8_refuse_it_in_one_line():
    a100 = get_machine("perlmutter")
    assert not a100.has_fp8
    with pytest.raises(PlanError, match="perlmutter .* describes no FP8 GEMMs"):
        StepQuestion(L8B, a100, 2048, 8, fp8="tensorwise")
    with pytest.raises(PlanError, match="unknown"):
        StepQuestion(L8B, H100, 2048, 8, fp8="blockwise")
    raw = {
        "gpus_per_node": 8,
        "memory_gib": 80,
        "peak_tflops": 989,
        "hbm_gbps": 3350,
        "peak_fp8_tflops": 1979,
        "network": {
            "intra_node_gbps": 360,
            "inter_node_gbps_per_member": 45,
            "latency_base_us": 8.4,
            "latency_hop_intra_us": 1.9,
            "latency_hop_inter_us": 2.5,
        },
        "compute": {"gemm_efficiency": [[1e9, 0.5]], "attention_efficiency": 0.4},
    }
    with pytest.raises(PlanError, match="together"):
        parse_machine(raw, "half")
    raw["compute"]["fp8_gemm_efficiency"] = [[1e9, 0.4]]
    assert parse_machine(raw, "whole").fp8_gemm_efficiency(1e9) == 0.4


# ---- 2. the step model ---------------------------------------------------------------------


def test_rowwise_filter_converts_what_torchao_converts():
    # the notes: at dim 2048 only the FFN up-projection qualifies; at 8B every block Linear
    one_b = {lin.name for lin in get_model("llama-1b").linears() if converts(lin, "rowwise")}
    assert one_b == {"w13"}
    assert all(converts(lin, "rowwise") for lin in L8B.linears())
    assert all(converts(lin, "tensorwise") for lin in get_model("llama-1b").linears())
    assert not any(converts(lin, "off") for lin in L8B.linears())
    w13 = get_model("llama-1b").linears()[2]  # [16384, 2048] on G_x = G_y = 2, 2048 tokens
    x, w, dy = 2048 * 2048 / 2, 16384 * 2048 / 4, 2048 * 16384 / 2
    assert cast_elements(w13, 2048, 2, 2) == 2 * (x + w + dy)  # each operand in two GEMMs


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_converted_gemms_run_at_the_fp8_rate_with_their_casts(recipe):
    model, grid, b, seq = get_model("llama-1b"), (1, 1, 2, 2, 2), 2, 1024
    off = block_compute(model, H100, grid, b, seq)
    on = block_compute(model, H100, grid, b, seq, fp8=recipe)
    m, hbm, total = b * seq, H100.hbm_bytes_per_s, 0.0
    for lin, f, t_off, t_on in zip(model.linears(), on.gemm_flops, off.gemm, on.gemm, strict=True):
        if not converts(lin, recipe):
            assert t_on == t_off, lin.name
            continue
        moved = CAST_BYTES * cast_elements(lin, m, 2, 2)
        peak = H100.fp8_peak_flops
        if recipe == "rowwise":
            moved += RESCALE_BYTES * rescale_elements(lin, m, 2, 2)
            peak *= ROWWISE_GEMM_FACTOR
        want = f / (peak * H100.fp8_gemm_efficiency(f)) + moved / hbm / 3
        assert t_on == pytest.approx(want, rel=1e-12), lin.name
        total += moved / hbm
    assert on.casts == pytest.approx(total, rel=1e-12) and total > 0
    assert on.head == off.head and on.post_fwd == off.post_fwd  # LM head, norms: bf16


def test_z_all_gather_moves_fp8_bytes_under_tensorwise_only():
    grid, b, seq, gb = (1, 1, 4, 2, 1), 1, 2048, 8
    rows = {
        r: collectives(L8B, H100, grid, b, seq, gb, fp8=r) for r in ("off", "tensorwise", "rowwise")
    }
    gathers = {
        r: {(c.layer, c.phase): c.payload_bytes for c in cols if c.kind == "all_gather"}
        for r, cols in rows.items()
    }
    for lin in L8B.linears():
        shard = lin.weight_elements / 2  # G_x G_y = 2
        assert gathers["tensorwise"][(lin.name, "forward")] == shard * 1
        assert gathers["rowwise"][(lin.name, "forward")] == shard * 2
        assert gathers["off"][(lin.name, "backward")] == shard * 2
    for r in rows:  # the LM head and the embedding stay in bf16
        assert gathers[r][("output", "forward")] == L8B.vocab_size * L8B.dim / 2 * 2
        assert gathers[r][("embedding", "forward")] == gathers["off"][("embedding", "forward")]


def test_amax_all_reduces_as_the_runtime_issues_them():
    """``tensorwise``: per block Linear and micro-batch, one fp32 all-reduce of the weight's
    amax on each of Z, Y and X at every gather (forward, backward, recompute), of ``x``'s on
    the input axis (forward, recompute) and of ``dy``'s on the output axis (backward), and on
    context for both (tetrad/parallel/fp8.py; ``tests/test_plan_validation.py`` counts the
    runtime's). None under rowwise, nor for data-parallel replicas."""
    grid, b, seq, gb = (2, 1, 2, 2, 2), 1, 2048, 8  # acc = 2
    calls = L8B.n_layers * 2
    for ckpt, phases in (("none", ("forward", "backward")), ("full", ("forward", "recompute"))):
        cols = collectives(
            L8B, H100, grid, b, seq, gb, fp8="tensorwise", **{"activation_checkpointing": ckpt}
        )
        amax = [c for c in cols if c.layer.endswith(" amax")]
        got = {(c.layer, c.phase, c.axis) for c in amax}
        for lin in L8B.linears():
            in_ax, out_ax = ("y", "x") if lin.transposed else ("x", "y")
            for phase in phases:
                assert {(f"{lin.name} weight amax", phase, a) for a in "zyx"} <= got
                operand = ("dy", out_ax) if phase == "backward" else ("x", in_ax)
                assert (f"{lin.name} {operand[0]} amax", phase, operand[1]) in got
        assert len(got) == len(amax) == 4 * len(L8B.linears()) * (2 + (ckpt == "full"))
        for c in amax:
            link = H100.network.grid_links(grid)[c.axis]
            assert (c.kind, c.payload_bytes, c.calls) == ("all_reduce", 4, calls)
            assert c.time_s == link.time("all_reduce", 4) and c.exposed_s == c.calls * c.time_s
    context = collectives(L8B, H100, (1, 2, 2, 1, 1), b, seq, gb // 2, fp8="tensorwise")
    on_context = {c.layer for c in context if c.layer.endswith(" amax") and c.axis == "context"}
    assert on_context == {f"{lin.name} {op} amax" for lin in L8B.linears() for op in ("x", "dy")}
    for r, g in (("rowwise", grid), ("tensorwise", (8, 1, 1, 1, 1))):  # none: rowwise, replicas
        cols = collectives(L8B, H100, g, b, seq, gb, fp8=r)
        assert not [c for c in cols if c.layer.endswith(" amax")], r


def test_fp8_wins_where_the_notes_measured_it():
    """Llama 3 8B on 8 H100s, the whole model sharded over Z (FSDP-like): torchao measured
    tensorwise 1.19-1.25x and rowwise 1.10x bf16 (the notes; pytorch/ao#1793)."""
    got = fp8_breakdown(L8B, H100, (1, 1, 8, 1, 1), 1, "selective", 8192, 64)
    tw = got["off"]["step"] / got["tensorwise"]["step"]
    rw = got["off"]["step"] / got["rowwise"]["step"]
    assert 1.15 <= tw <= 1.30 and 1.05 <= rw <= 1.20 and rw < tw
    # half the bytes; the latency of each call stays
    assert 0.5 < got["tensorwise"]["z_gather"] / got["rowwise"]["z_gather"] < 0.6
    assert got["off"]["casts"] == got["off"]["amax"] == 0 < got["tensorwise"]["amax"]


def test_fine_overlap_is_left_out_with_fp8():
    assert StepQuestion(L8B, H100, 2048, 8, fp8="tensorwise").fine == ()
    with pytest.raises(PlanError, match="fine"):
        StepQuestion(L8B, H100, 2048, 8, overlaps="prefetch,fine", fp8="rowwise")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_bounds_stay_below_the_fp8_estimate(recipe):
    from tests.test_plan_bounds import check_bounds_below_estimates

    gpus, batch, seq, n = 16, 32, 2048, 0
    for overlaps in ("all", "none"):
        ctx = StepQuestion(L8B, H100, seq, batch, overlaps=overlaps, fp8=recipe)
        n += check_bounds_below_estimates(ctx, gpus)
    assert n > 100


def test_pruned_fp8_search_equals_the_best_estimate():
    """The best-first search with its floors (the pipeline's too) finds the fastest 5D
    configuration that every estimate finds."""
    from tests.test_plan_bounds import configurations
    from tetrad.plan.memory.runtime import runtime_memory

    gpus, batch, seq = 16, 32, 2048
    rows, _ = search_4d(L8B, H100, gpus, batch, seq, top=1, fp8="tensorwise", pipeline=False)
    ctx = StepQuestion(L8B, H100, seq, batch, fp8="tensorwise")
    best = min(
        estimate(ctx, g, b, ck).step_s
        for g, b, ck in configurations(L8B, gpus, batch, seq)
        if ck != "selective:1"
        and runtime_memory(L8B, g, b, seq, H100.memory_bytes, activation_checkpointing=ck).fits
    )
    assert rows[0].step_s <= best * (1 + 1e-12)
    piped, _ = search_4d(L8B, H100, gpus, batch, seq, top=1, fp8="tensorwise")
    assert piped[0].step_s <= rows[0].step_s


# ---- 3. tetrad plan --fp8 ------------------------------------------------------------------

PLAN = "plan --model llama-3.1-8b --machine dgx-h100 --gpus 8 --global-batch 64 --seq-len 8192"


def test_plan_fp8_auto_says_where_fp8_wins(capsys, tmp_path):
    path = tmp_path / "best.toml"
    rc = cli.main([*PLAN.split(), "--top", "2", "--fp8", "auto", "--emit-config", str(path)])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "fp8 tensorwise: 1.2" in out and "x bf16's best (wins" in out
    assert "fp8 rowwise: 1.1" in out and "fp8 auto: the fastest is tensorwise" in out
    assert "; fp8 tensorwise (MFU against the bf16 peak" in out
    # the written config trains with the recipe it was planned with
    from tetrad.train.config import load_config

    assert '[precision]\nfp8 = "tensorwise"' in path.read_text()
    assert load_config(str(path), {}).policy.fp8 == "tensorwise"


def test_plan_fp8_errors_are_one_line(capsys):
    for extra, words in (
        ("--fp8 tensorwise --machine perlmutter", "describes no FP8 GEMMs"),
        ("--fp8 rowwise --comm-model axonn", "comm-model tetrad only"),
    ):
        rc = cli.main([*PLAN.split(), *extra.split()])
        _, err = capsys.readouterr()
        assert rc == 2 and words in err and err.count("\n") == 1, err
    rc = cli.main([*PLAN.split(), "--fp8", "auto", "--machine", "perlmutter", "--top", "1"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "fp8: machine perlmutter" in out and "bf16 only" in out
