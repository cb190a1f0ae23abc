"""The planner's model sizes: every preset's parameter count, linears, parsing and errors."""

import json
import subprocess
import sys

import pytest

from tetrad.spec.model import Linear, ModelError, ModelSpec
from tetrad.spec.presets import PRESETS, get_model

# Published totals (Hugging Face model cards / safetensors metadata).
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
}

# AxoNN's GPT table (axonn-4d-algorithm.md section 5): layers, hidden, heads.
GPT_TABLE = {
    "gpt-5b": (24, 4096, 32),
    "gpt-10b": (32, 5120, 40),
    "gpt-20b": (32, 7168, 56),
    "gpt-40b": (38, 9216, 72),
    "gpt-60b": (56, 9216, 72),
    "gpt-80b": (42, 12288, 96),
    "gpt-160b": (84, 12288, 96),
    "gpt-320b": (96, 16384, 128),
    "gpt-640b": (192, 16384, 128),
    # T3's models (arXiv 2401.16677): Megatron-LM's 8.3B GPT-2 (arXiv 1909.08053, Table 2) and
    # Turing-NLG 17B, in the same GPT layout.
    "mega-gpt-2": (72, 3072, 32),
    "t-nlg": (78, 4256, 28),
}


def gpt_count(L, h, V=51200, P=2048):
    """Per block: QKV 3h^2 + 3h, out-proj h^2 + h, fc1 4h^2 + 4h, fc2 4h^2 + h, two LayerNorms
    2 * 2h: 12 h^2 + 13 h. Outside: token table V h, position table P h, final LayerNorm 2h,
    untied LM head V h (no bias)."""
    return 12 * L * h * h + 13 * L * h + (2 * V + P) * h + 2 * h


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_llama_presets_match_published_totals(name):
    assert PRESETS[name].num_params() == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(GPT_TABLE))
def test_gpt_presets(name):
    L, h, a = GPT_TABLE[name]
    m = PRESETS[name]
    assert (m.family, m.n_layers, m.dim, m.n_heads, m.n_kv_heads) == ("gpt", L, h, a, a)
    assert (m.ffn_dim, m.vocab_size, m.max_positions, m.tied_embeddings) == (
        4 * h,
        51200,
        2048,
        False,
    )
    assert m.num_params() == gpt_count(L, h)
    # The table's 12 L h^2 is the blocks' weights only.
    assert sum(lin.weight_elements for lin in m.linears()) * L == 12 * L * h * h


def test_gpt_5b_by_hand():
    assert PRESETS["gpt-5b"].num_params() == 5_260_943_360


def test_every_preset_is_pinned():
    moe = {"mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"}  # test_plan_moe.py
    own = {"tiny", "small", "medium", "moe-tiny", "moe-small", "llama-1b"}  # tetrad's own
    assert set(PRESETS) == set(PUBLISHED) | set(GPT_TABLE) | own | moe


def test_linears_llama():
    m = PRESETS["llama-3-8b"]
    got = [(lin.name, lin.in_features, lin.out_features, lin.transposed) for lin in m.linears()]
    assert got == [
        ("wqkv", 4096, 4096 + 2 * 1024, False),
        ("wo", 4096, 4096, True),
        ("w13", 4096, 2 * 14336, False),
        ("w2", 14336, 4096, True),
    ]
    assert all(lin.count == 1 and not lin.bias for lin in m.linears())
    assert m.lm_head() == Linear("output", 4096, 128256, False)
    assert (m.head_dim, m.q_dim, m.kv_dim) == (128, 4096, 1024)


def test_linears_gpt():
    m = PRESETS["gpt-10b"]
    got = [
        (lin.name, lin.in_features, lin.out_features, lin.transposed, lin.bias)
        for lin in m.linears()
    ]
    assert got == [
        ("qkv", 5120, 15360, False, True),
        ("proj", 5120, 5120, True, True),
        ("fc1", 5120, 20480, False, True),
        ("fc2", 20480, 5120, True, True),
    ]


def test_sizes_spelled_out_equal_the_preset():
    """A preset and its sizes spelled out are the same model (counts and FLOPs)."""
    tiny = PRESETS["tiny"]
    spec = get_model(
        f"dim={tiny.dim},n_layers={tiny.n_layers},n_heads={tiny.n_heads},"
        f"n_kv_heads={tiny.n_kv_heads},ffn_dim={tiny.ffn_dim},"
        f"vocab_size={tiny.vocab_size}"
    )
    assert spec.num_params() == tiny.num_params()
    assert spec.flops_per_token(2048) == tiny.flops_per_token(2048)


def test_get_model_sizes_and_overrides():
    m = get_model("hidden=4096,n_layers=32,n_heads=32,n_kv_heads=8,ffn_dim=14336,vocab=128256")
    assert m.family == "llama" and m.num_params() == PUBLISHED["llama-3-8b"]
    half = get_model("llama-3-8b, n_layers=16")
    assert half.n_layers == 16 and half.dim == 4096 and "n_layers=16" in half.name
    mha = get_model("hidden=1024,n_layers=2,n_heads=8,ffn_dim=2048,vocab=1000")
    assert mha.n_kv_heads == 8
    gpt = get_model("family=gpt,hidden=1024,n_layers=2,n_heads=8")
    assert (gpt.ffn_dim, gpt.vocab_size, gpt.max_positions) == (4096, 51200, 2048)
    assert gpt.num_params() == gpt_count(2, 1024)
    tied = get_model("llama-3-8b,tied_embeddings=true")
    assert tied.num_params() == PUBLISHED["llama-3-8b"] - 128256 * 4096


def test_get_model_hf_config(tmp_path):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
    }
    path = tmp_path / "Llama-3.1-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    m = get_model(str(path))
    assert m.num_params() == PUBLISHED["llama-3.1-8b"]
    assert m.name == "Llama-3.1-8B" and m.max_positions == 0
    assert get_model(str(path.parent)) == m  # a folder holding config.json
    assert get_model(f"{path},n_layers=2").n_layers == 2
    cfg["tie_word_embeddings"] = True
    path.write_text(json.dumps(cfg))
    assert get_model(str(path)).num_params() == PUBLISHED["llama-3.1-8b"] - 128256 * 4096


@pytest.mark.parametrize(
    "text, words",
    [
        ("lama-3-8b", ["unknown model", "did you mean 'llama-3-8b'"]),
        ("gpt-80", ["unknown model", "did you mean"]),
        ("llama-3-8b,n_layer=3", ["unknown model size", "did you mean 'n_layers'"]),
        ("llama-3-8b,n_layers=x", ["not an integer"]),
        ("llama-3-8b,n_layers", ["not key=value"]),
        ("hidden=4096", ["lack", "n_layers"]),
        ("hidden=4096,n_layers=2,n_heads=5,ffn_dim=8,vocab=8", ["divisible by n_heads"]),
        ("llama-3-8b,n_kv_heads=5", ["n_kv_heads"]),
        ("llama-3-8b,family=bert", ["family"]),
        ("nowhere/config.json", ["cannot read"]),
        ("", ["no model given"]),
    ],
)
def test_get_model_errors(text, words):
    with pytest.raises(ModelError) as info:
        get_model(text)
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg
    assert isinstance(info.value, ValueError)


def test_hf_config_missing_keys(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ModelError, match="lacks"):
        get_model(str(path))


def test_spec_is_frozen():
    with pytest.raises(AttributeError):
        PRESETS["gpt-5b"].dim = 1  # type: ignore[misc]
    assert isinstance(PRESETS["gpt-5b"], ModelSpec)


def test_plan_imports_no_torch():
    code = (
        "import sys, tetrad.plan, tetrad.spec.model, tetrad.plan.memory.runtime; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
