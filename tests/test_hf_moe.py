"""Hugging Face Mixtral and Qwen3-MoE against tetrad's reference: a small random fp32 model of
transformers (eager expert loop), its weights converted, equal logits; export -> import exact."""

import pytest
import torch

from tetrad.models.hf_moe import from_hf_state, moe_config, moe_hf_config, to_hf_state
from tetrad.models.reference import Llama

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 12
COMMON = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)


def mixtral():
    return transformers.MixtralConfig(
        **COMMON, intermediate_size=48, num_local_experts=4, rope_theta=1e6
    )


def qwen3_moe():
    return transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        rope_theta=1e6,
    )


MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe}


def hf_model(kind):
    torch.manual_seed(0)
    config = MODELS[kind]()
    config._experts_implementation = "eager"  # the per-expert loop as the reference
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms away from 1, routers sharp enough to matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_logits_equal_transformers_and_round_trip(kind):
    hf = hf_model(kind)
    cfg = moe_config(hf.config.to_dict())
    assert cfg.n_experts == (4 if kind == "mixtral" else 8)
    assert cfg.moe_blocks() == (3 if kind == "mixtral" else 2)
    ours = Llama(cfg)
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    hf_state = hf.state_dict()
    ours.load_state_dict(from_hf_state(cfg, hf_state, shapes))
    batch = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=batch).logits
        got = ours(batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rel = ((got - want).norm() / want.norm()).item()
    print(f"{kind}: logits relative difference {rel:.2e}, max {(got - want).abs().max():.2e}")

    exported = to_hf_state(cfg, {n: p.detach() for n, p in ours.named_parameters()}, VOCAB)
    assert exported.keys() == hf_state.keys()
    assert all(torch.equal(exported[k], hf_state[k]) for k in hf_state)
    back = from_hf_state(cfg, exported, shapes)
    assert all(torch.equal(back[n], p) for n, p in ours.named_parameters())
    config = moe_hf_config(cfg, kind, VOCAB)
    assert moe_config(config) == cfg
