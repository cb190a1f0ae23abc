"""Hugging Face Mixtral and Qwen3-MoE against tetrad: a small random fp32 model of
transformers (experts_implementation="eager": the per-expert loop) saved as a folder (the Hub's
per-expert tensors), loaded by tetrad's reader: equal logits, on one process and on 2-rank
grids; exported back, transformers loads the same weights; the fused in-memory state dicts
convert both ways exactly."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests import hf_ranks
from tests.distributed import run_distributed
from tests.run_dirs import bpe_tokenizer
from tests.test_hf import _fine_tune, corpus, hf_loss  # noqa: F401  (corpus: a fixture)
from tetrad.models.hf import hf_config, load_weights, read_config, to_hf
from tetrad.models.hf_moe_state import from_hf_state, to_hf_state
from tetrad.models.reference import Llama
from tetrad.spec.hf_config import moe_config

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 384, 16  # room for the test tokenizer (about 300 tokens)
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
    rope_theta=1e6,
)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, intermediate_size=48, num_local_experts=4
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        norm_topk_prob=True,
        mlp_only_layers=[0],  # a dense first block
    ),
}


def hf_model(kind: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[kind](), experts_implementation="eager"
    )
    with torch.no_grad():  # norms away from 1, routers sharp enough to matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return model.float().eval()


def load_hf(folder: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, experts_implementation="eager"
    )
    return model.eval()


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def folder(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    hf_model(request.param).save_pretrained(out)
    return out


def test_folder_logits_equal_transformers_and_export_round_trips(folder, tmp_path):
    cfg, raw = read_config(folder)
    kind = raw["model_type"]
    assert cfg.n_experts == (4 if kind == "mixtral" else 8) and cfg.top_k == 2
    assert cfg.moe_layers == (3 if kind == "mixtral" else 2) and cfg.qk_norm == (kind != "mixtral")
    ours = Llama(cfg)
    load_weights(ours, folder)
    hf, tokens = load_hf(folder), batch()[:, :-1]
    with torch.no_grad():
        want, got = hf(input_ids=tokens).logits, ours(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rel = ((got - want).norm() / want.norm()).item()
    print(f"{kind}: logits relative difference {rel:.2e}, max {(got - want).abs().max():.2e}")

    out = tmp_path / "exported"  # what `tetrad export --to hf` writes, tensor by tensor
    out.mkdir()
    tensors = {}
    for name, p in ours.named_parameters():
        tensors.update(to_hf(name, p.detach(), cfg, VOCAB))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = hf_config(cfg, VOCAB, raw, "float32")
    (out / "config.json").write_text(json.dumps(config))
    assert moe_config(config, cfg.name) == cfg  # the name is a label
    again = load_hf(out)
    assert again.state_dict().keys() == hf.state_dict().keys()
    for k, v in hf.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    back = Llama(cfg)
    load_weights(back, out)
    assert all(torch.equal(a, b) for a, b in zip(back.parameters(), ours.parameters(), strict=True))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_fused_state_dict_round_trip(kind):
    """transformers 5's in-memory layout (gate_up_proj [E, 2F, h], down_proj [E, h, F])."""
    hf = hf_model(kind)
    cfg = moe_config(hf.config.to_dict())
    ours = Llama(cfg)
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    state = hf.state_dict()
    assert state["model.layers.1.mlp.experts.gate_up_proj"].dim() == 3
    ours.load_state_dict(from_hf_state(cfg, state, shapes))
    tokens = batch()[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
    exported = to_hf_state(cfg, {n: p.detach() for n, p in ours.named_parameters()}, VOCAB)
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[k], state[k]) for k in state)


def test_mixtral_on_data_and_z_grids(tmp_path):
    """Each rank reads its own slices of the folder (experts whole); logits and loss equal."""
    folder = tmp_path / "mixtral"
    hf_model("mixtral").save_pretrained(folder)
    tokens = batch()
    with torch.no_grad():
        out = load_hf(folder)(input_ids=tokens, labels=tokens)
    want = out.loss.item()
    for sizes in [(2, 1, 1, 1), (1, 2, 1, 1)]:
        path = tmp_path / f"loss_{sizes[0]}.json"
        run_distributed(hf_ranks.loss_on_grid, 2, folder, sizes, tokens, out.logits[:, :-1], path)
        assert json.loads(path.read_text()) == pytest.approx(want, rel=1e-5), sizes


def test_fine_tune_mixtral_then_export_loads_in_transformers(tmp_path, corpus, monkeypatch):  # noqa: F811
    """``tetrad train --init-from hf:FOLDER`` on grid 2,1,1,1, ``tetrad export --to hf``: the
    exported Mixtral's loss in transformers equals tetrad's last validation loss."""
    from tetrad.data.corpus import prepare_corpus
    from tetrad.data.loader import val_batches
    from tetrad.train.export import export

    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "hf"
    hf_model("mixtral").save_pretrained(folder)
    bpe_tokenizer("</s>").save(str(folder / "tokenizer.json"))
    run_dir = tmp_path / "run"
    cfg = _fine_tune(folder, run_dir, corpus, "2,1,1,1", lr=1e-3, steps=2)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["aux_loss"] > 0 for r in rows)  # router_aux_loss_coef of the folder
    out = export(run_dir, tmp_path / "out", fmt="hf")
    d = cfg.data
    val = prepare_corpus(d.paths, d.tokenizer, d.vocab_size, d.val_fraction).val
    (tokens,) = val_batches(val, 1, 4, SEQ)
    _, theirs = hf_loss(out, tokens)
    assert theirs == pytest.approx(rows[-1]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_router_aux_coefficient_maps_to_the_pooled_loss(kind):
    """transformers adds ``router_aux_loss_coef`` x one Switch loss pooled over the MoE blocks
    (``k`` when balanced); tetrad adds its coefficient x each block's (1 when balanced): the
    imported coefficient gives the same loss when every block routes alike, and exports back."""
    from tetrad.models.moe import load_balance_loss

    hf_loss_func = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func
    layers = 3 if kind == "mixtral" else 5  # Qwen3: block 0 dense, 4 MoE blocks
    raw = CONFIGS[kind]().to_dict() | {"num_hidden_layers": layers, "router_aux_loss_coef": 0.02}
    cfg = moe_config(raw)
    e, k, blocks = cfg.n_experts, cfg.top_k, cfg.moe_layers
    assert blocks == 3 if kind == "mixtral" else 4
    assert cfg.aux_loss_coef == pytest.approx(0.02 * k / blocks, rel=1e-12)
    logits = torch.randn(64, e, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    theirs = 0.02 * hf_loss_func((logits,) * blocks, e, k)
    probs = torch.softmax(logits, -1)
    ids = torch.topk(probs, k, -1).indices
    ours = blocks * cfg.aux_loss_coef * load_balance_loss(probs[None], ids[None], e, "batch")
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)  # theirs sums in fp32
    assert hf_config(cfg, VOCAB, raw, "float32")["router_aux_loss_coef"] == 0.02
