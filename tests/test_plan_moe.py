"""The planner's mixture-of-experts models: sizes of the published presets, active-parameter
FLOPs, the runtime's expert memory (``E / G_expert`` experts per rank, the expert axis folded
over any ranks of a stage), and one-line refusals where the planner cannot model them yet."""

import pytest

from tetrad.cli import main
from tetrad.plan.memory.states import local_parameter_elements
from tetrad.spec.model import ModelError, check_trainable
from tetrad.spec.presets import PRESETS, get_model
from tetrad.spec.sharding import check_grid

# (total, routed experts, active incl. embedding) in billions: the model cards (Mixtral 46.7B /
# 12.9B active; Qwen3-30B-A3B 30.5B / 3.3B; DeepSeek-V3 671B / 37B) and the notes' table
# (3 h f E per MoE block: 45.1B, 29.0B, 653.9B)
PUBLISHED = {
    "mixtral-8x7b": (46.7, 45.1, 12.9),
    "qwen3-30b-a3b": (30.5, 29.0, 3.3),
    "qwen3-235b-a22b": (235.1, 227.1, 22.2),  # model card: 235B, 22B activated
    "deepseek-v3": (671.0, 653.9, 37.5),
}


EXACT = {  # our counts (Qwen3's q/k norm weights, 48 x 2 x 128 = 12,288, are left out)
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_110_336,
    "qwen3-235b-a22b": 235_093_610_496,
    "deepseek-v3": 671_026_404_352,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_sizes(name):
    assert PRESETS[name].num_params() == EXACT[name]
    m = PRESETS[name]
    total, experts, active = PUBLISHED[name]
    assert m.num_params() / 1e9 == pytest.approx(total, abs=0.05)
    assert m.moe_layers * m.expert_params() / 1e9 == pytest.approx(experts, abs=0.05)
    assert (m.matmul_params() + m.vocab_size * m.dim) / 1e9 == pytest.approx(active, abs=0.1)


def test_flops_count_active_experts():
    """Qwen3-30B-A3B by hand: 48 blocks of attention (2048 -> (32 + 2 x 4) x 128, 4096 -> 2048),
    router 128 x 2048 and 8 of 128 experts (3 x 2048 x 768 each), and the LM head."""
    m, s = PRESETS["qwen3-30b-a3b"], 4096
    attention = 2048 * 40 * 128 + 4096 * 2048
    block = attention + 128 * 2048 + 8 * 3 * 2048 * 768
    want = 6 * (48 * block + 151936 * 2048) + 6 * 48 * s * 32 * 128
    assert m.flops_per_token(s) == want


def test_runtime_memory_splits_experts_over_the_expert_axis_only():
    m = PRESETS["qwen3-30b-a3b"]
    n = local_parameter_elements(m, (8, 1, 1, 1))
    assert n["matrices"] + n["vectors"] == m.num_params() and n["experts"] == 0
    z = local_parameter_elements(m, (1, 2, 1, 1))  # Z halves the Linears and tables only
    whole = m.moe_layers * (m.router_params() + m.expert_params())
    assert z["vectors"] - n["vectors"] == 0 and z["matrices"] == n["matrices"] // 2
    assert n["vectors"] >= whole  # router and experts replicated like the norms
    ep = local_parameter_elements(m, (8, 1, 1, 1), expert=8)  # E/8 experts per rank
    assert ep["experts"] == m.moe_layers * m.expert_params() // 8
    assert ep["vectors"] == n["vectors"] - m.moe_layers * m.expert_params()
    assert ep["matrices"] == n["matrices"]
    check_grid(m, (1, 1, 2, 1))  # experts whole on every tensor rank (tetrad/parallel/moe_tensor)


@pytest.mark.parametrize("grid", [(1, 8, 1, 1), (1, 1, 4, 2), (2, 4, 1, 1), (8, 1, 1, 1)])
def test_expert_states_fall_as_one_over_the_expert_axis_on_any_ranks(grid):
    """MoE Parallel Folding: ``G_expert`` consecutive ranks of the stage, whatever axes they
    span, hold ``E / G_expert`` experts each; Z, Y and X shard the other Linears as before."""
    m = PRESETS["qwen3-30b-a3b"]
    routed = m.moe_layers * m.expert_params()
    whole = local_parameter_elements(m, grid)
    for ep in (2, 4, 8):
        n = local_parameter_elements(m, grid, expert=ep)
        assert n["experts"] == routed // ep
        assert n["matrices"] == whole["matrices"]
        assert n["vectors"] == whole["vectors"] - routed


def test_the_expert_axis_divides_a_stage_and_the_experts():
    from tetrad.spec.sharding import moe_grid_problem

    m = PRESETS["qwen3-30b-a3b"]  # 128 experts
    for grid, ep in [((1, 1, 2, 1, 1), 2), ((1, 1, 1, 2, 2), 4), ((2, 1, 2, 1, 1), 4)]:
        assert moe_grid_problem(m, grid, 1, ep, 4096) is None
    assert "the 4 ranks of a pipeline stage" in moe_grid_problem(m, (2, 1, 2, 1, 1), 1, 8)
    assert "n_experts=128" in moe_grid_problem(m, (3, 1, 1, 1, 1), 1, 3)


def test_the_runtime_refuses_the_presets_it_lacks():
    for name in ("moe-tiny", "moe-small", "mixtral-8x7b"):
        assert check_trainable(PRESETS[name]) is PRESETS[name]
    with pytest.raises(ModelError, match="latent attention"):
        check_trainable(PRESETS["deepseek-v3"])
    with pytest.raises(ModelError, match="heads of 128"):  # heads of 128 with h/a = 64
        check_trainable(PRESETS["qwen3-30b-a3b"])
    assert get_model("mixtral-8x7b,n_layers=4").moe_layers == 4


def test_plan_ranks_moe_with_the_expert_axis(capsys):
    argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "64", "--global-batch", "512"]
    assert main([*argv, "--machine", "dgx-h100", "--seq-len", "4096", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "exp expert" in out and " ep=" in out and "exp ep" in out  # 4D and classic
    assert main([*argv, "--machine", "dgx-h100", "--moe-imbalance", "0.5"]) == 2
    assert "--moe-imbalance 0.5 must be at least 1.0" in capsys.readouterr().err
    assert main([*argv, "--machine", "dgx-h100", "--comm-model", "axonn"]) == 2
    assert "use tetrad" in capsys.readouterr().err


def test_memory_prints_the_moe_terms(capsys):
    argv = ["memory", "--model", "qwen3-30b-a3b", "--seq-len", "4096"]
    assert main([*argv, "--grid", "data=8,expert=8", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "expert axis 8" in out and "MoE terms" in out
    # 29.0B routed weights split over 8 ranks, 16 bytes each: 54.0 GiB
    assert "routed expert states (fp32 weights, fp32 gradients, AdamW): 54.000 GiB" in out
    assert main([*argv, "--grid", "data=8", "--expert-parallel", "8", "--json"]) == 0
    assert "moe_terms_bytes" in capsys.readouterr().out
    assert main([*argv, "--grid", "data=8,expert=3"]) == 2
    assert "divide n_experts" in capsys.readouterr().err
    # the expert axis over the tensor ranks: the same expert states, the Linears 8 ways
    assert main([*argv, "--grid", "z=8,expert=8", "--activation-checkpointing"]) == 0
    assert "routed expert states (fp32 weights, fp32 gradients, AdamW): 54.000 GiB" in (
        capsys.readouterr().out
    )
    assert main([*argv, "--grid", "z=4,expert=8"]) == 2
    assert "the 4 ranks of a pipeline stage" in capsys.readouterr().err
    # the sharded optimizer splits the experts' AdamW states over expert-data (data=16 over
    # G_expert 8: 2 ranks): 8 + 8/2 bytes per element, 40.5 GiB; with G_expert 16, whole (one)
    wide = [*argv, "--grid", "data=16,expert=8", "--shard-optimizer"]
    assert main(wide) == 0
    assert "routed expert states (fp32 weights, fp32 gradients, AdamW): 40.500 GiB" in (
        capsys.readouterr().out
    )


def test_bf16_weights_in_the_moe_search():
    """``tetrad plan --param-dtype bf16`` searches an MoE model too: 2-byte weights with fp32
    masters among the states (sharded with them), and no bf16 copies of the expert weights
    saved for backward. Qwen3-235B-A22B on 256 H100s: its best 4D plan is faster than with fp32
    weights and than the best Megatron-style plan (0.958 of its time; 1.013 while the LM head's
    later micro-batches added their scaled ``dW`` into the gradient in backward, on the head's
    stage of 256 micro-batches, before it went into the gradient in forward: the closed
    ``HEAD_ADD`` gap of tests/test_classic_map.py); Qwen3-30B-A3B on 8 fits only with
    fp32 weights (its experts' states stay whole: 18 bytes per element with bf16 weights and
    masters, 16 with fp32)."""
    from tetrad.plan.machine.description import get_machine
    from tetrad.plan.search.plan import plan

    h100 = get_machine("dgx-h100")
    model = get_model("qwen3-235b-a22b")
    steps = {}
    for params in ("fp32", "bf16"):
        result = plan(model, h100, 256, 1024, 4096, top=1, params=params)
        steps[params] = result.rows[0].step_s
        assert result.rows[0].memory.fits and result.inputs["param_dtype"] == params
    assert steps["bf16"] < steps["fp32"]
    assert steps["bf16"] <= result.classic[0].step_s
    with pytest.raises(Exception, match="no configuration of qwen3-30b-a3b fits"):
        plan(get_model("qwen3-30b-a3b"), h100, 8, 64, 4096, top=1, params="bf16")


@pytest.mark.parametrize(
    "name, gpus, batch", [("moe-small", 4, 16), ("mixtral-8x7b", 64, 256), ("llama-3.1-8b", 8, 64)]
)
def test_emitted_config_builds_the_planned_model(name, gpus, batch, tmp_path):
    """``tetrad plan --emit-config`` writes every size that differs from the defaults (an MoE
    model's experts, routing and balancing; Qwen3's q/k norms; Llama 3's RoPE scaling): the file
    loads to the planned model, not a dense one of the same widths."""
    import dataclasses

    from tetrad.train.config import load_config

    path = tmp_path / "plan.toml"
    argv = ["plan", "--model", name, "--machine", "dgx-h100", "--gpus", str(gpus)]
    argv += ["--global-batch", str(batch), "--seq-len", "256", "--top", "1"]
    assert main([*argv, "--emit-config", str(path)]) == 0
    got = load_config(str(path), {}).model_config()
    want = get_model(name)
    for f in dataclasses.fields(want):
        if f.name not in ("name", "vocab_size", "unpadded_vocab", "max_positions"):
            assert getattr(got, f.name) == getattr(want, f.name), (name, f.name)
