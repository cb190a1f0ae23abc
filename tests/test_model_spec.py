"""One model description, one spelling: ``--model`` gives the same model to ``tetrad train``,
``tetrad plan`` and ``tetrad memory`` (and configuration files), for every preset tetrad
trains and every size key; the planner's former spellings stay as aliases; an unknown key gets
one line naming the nearest known one."""

import dataclasses

import pytest

from tetrad.cli import build_parser, main
from tetrad.spec.model import ModelError, ModelSpec, check_trainable
from tetrad.spec.presets import ALIASES, PRESETS, SIZE_KEYS, get_model, parse_model
from tetrad.train.config import load_config


def _trainable(model: ModelSpec) -> bool:
    try:
        check_trainable(model)
    except ModelError:
        return False
    return True


TRAINED = [name for name, m in PRESETS.items() if _trainable(m)]

# A value for every size key that still describes a model when applied to ``moe-small``.
VALUES = {
    "family": "llama",
    "dim": "512",
    "n_layers": "6",
    "n_heads": "16",
    "n_kv_heads": "2",
    "ffn_dim": "1024",
    "vocab_size": "8192",
    "max_positions": "0",
    "tied_embeddings": "false",
    "rope_theta": "500000",
    "norm_eps": "1e-6",
    "rope_factor": "8",
    "rope_low_freq_factor": "1",
    "rope_high_freq_factor": "4",
    "rope_original_positions": "8192",
    "unpadded_vocab": "8000",
    "attn_head_dim": "0",
    "qk_norm": "true",
    "n_experts": "4",
    "top_k": "3",
    "expert_ffn_dim": "128",
    "shared_ffn_dim": "64",
    "dense_layers": "1",
    "moe_every": "2",
    "router_score": "sigmoid",
    "router_renorm": "false",
    "route_scale": "2.5",
    "aux_loss_coef": "0.001",
    "aux_loss_scope": "batch",
    "router_z_loss_coef": "0.001",
    "bias_update_rate": "0.001",
    "kv_lora_rank": "0",
    "q_lora_rank": "0",
    "rope_head_dim": "0",
    "v_head_dim": "0",
}


def _train(text: str) -> ModelSpec:
    """The model ``tetrad train --model TEXT`` trains (before the tokenizer sets the
    vocabulary)."""
    cfg = load_config(None, {"model": text})
    return cfg.model_config()


def _planner(command: str, text: str) -> ModelSpec:
    """The model ``tetrad plan`` or ``tetrad memory`` reads from ``--model TEXT``: the
    command's own argument parser, then the planner's model lookup."""
    extra = (
        ["--gpus", "8", "--global-batch", "8", "--machine", "dgx-h100"] if command == "plan" else []
    )
    args = build_parser().parse_args([command, "--model", text, *extra])
    return get_model(args.model)


def test_every_size_key_has_a_test_value():
    assert set(VALUES) == set(SIZE_KEYS)


@pytest.mark.parametrize("name", TRAINED)
def test_every_training_preset_is_the_same_model_everywhere(name):
    model = _train(name)
    assert model == _planner("plan", name) == _planner("memory", name) == PRESETS[name]


@pytest.mark.parametrize("key", sorted(VALUES))
def test_every_size_key_is_the_same_model_everywhere(key):
    text = f"moe-small,{key}={VALUES[key]}"
    model = _train(text)
    assert model == _planner("plan", text) == _planner("memory", text)
    kind = type(getattr(PRESETS["moe-small"], key))
    value = VALUES[key] == "true" if kind is bool else kind(VALUES[key])
    assert getattr(model, key) == value


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_aliases_name_the_same_size(alias):
    key = ALIASES[alias]
    value = VALUES[key]
    assert get_model(f"moe-small,{alias}={value}") == dataclasses.replace(
        get_model(f"moe-small,{key}={value}"), name=f"moe-small,{alias}={value}"
    )


def test_config_file_sizes_are_the_same_model(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "small"\nn_layers = 8\nhidden = 512\n')
    from_file = load_config(str(path), {}).model_config()
    assert (from_file.n_layers, from_file.dim) == (8, 512)
    assert dataclasses.replace(from_file, name="x") == dataclasses.replace(
        get_model("small,n_layers=8,dim=512"), name="x"
    )


@pytest.mark.parametrize(
    "text, nearest",
    [("small,ffn_hiden=8", "ffn_hidden"), ("small,n_layer=8", "n_layers"), ("smal", "small")],
)
def test_an_unknown_key_names_the_nearest(text, nearest):
    with pytest.raises(ModelError) as info:
        parse_model(text)
    assert "\n" not in str(info.value) and f"did you mean {nearest!r}" in str(info.value)


def test_planner_answers_for_the_models_people_train(capsys):
    assert main(["memory", "--model", "moe-small", "--grid", "1,1,1,1"]) == 0
    assert "moe-small" in capsys.readouterr().out
    argv = ["plan", "--model", "small,n_layers=8", "--gpus", "8", "--global-batch", "64"]
    assert main([*argv, "--machine", "dgx-h100", "--top", "1"]) == 0
    assert "small,n_layers=8" in capsys.readouterr().out


def test_train_refuses_a_model_its_llama_lacks(capsys):
    with pytest.raises(ModelError, match="not a Llama"):
        _train("gpt-5b")


def test_top1_renormalised_routing_is_refused_everywhere(capsys, tmp_path):
    # one weight over itself is 1.0: the router would get no gradient from the LM loss
    for argv in (
        ["train", "--model", "moe-tiny,top_k=1", "--steps", "1", "--run-dir", str(tmp_path)],
        ["memory", "--model", "moe-small,top_k=1", "--grid", "1,1,1,1"],
        ["plan", "--model", "moe-small,top_k=1", "--gpus", "8", "--global-batch", "8"],
    ):
        assert main([*argv, "--machine", "dgx-h100"] if argv[0] == "plan" else argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "top_k=1 with router_renorm=true" in err, argv
        assert "set router_renorm=false" in err
    from tetrad.spec.hf_config import moe_config

    qwen = dict(
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=128,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=1,
    )
    assert moe_config(qwen).top_k == 1  # norm_topk_prob false (transformers' default)
    with pytest.raises(ModelError, match="top_k=1 with router_renorm"):
        moe_config(qwen | {"norm_topk_prob": True})
    assert get_model("moe-small,top_k=1,router_renorm=false").top_k == 1
