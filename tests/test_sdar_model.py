"""SDAR forward parity: fluxlab's SDARModel against the published modeling code (tests/reference_sdar/, loaded by
tests/sdar_oracle.py) on the same random checkpoint, fp32 on CPU; tied (tiny_sdar) and untied MoE
(tiny_sdar_moe) heads."""
import json

import pytest
import torch

import sdar_oracle
from fluxlab.engine.layers.attention_dense import DenseBlockCausalAttention, block_causal_mask
from fluxlab.models.sdar.checkpoint import write_sdar_checkpoint
from fluxlab.models.sdar.loader import checkpoint_layout, load_model
from fluxlab.models.sdar.model import SDARConfig

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 4


@pytest.fixture(scope="module", params=["tiny_sdar", "tiny_sdar_moe"])
def pair(request, tmp_path_factory):
    folder = write_sdar_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    ours, config = load_model(folder, torch.float32, "cpu", progress=False)
    return request.param, folder, sdar_oracle.load_model(folder), ours, config


def _ours(model, sequences, block=BLOCK):
    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(len(s)) for s in sequences])
    attn = DenseBlockCausalAttention([len(s) for s in sequences], block)
    return model.compute_logits(model(ids, positions, attn))


def _published(model, ids, block=BLOCK):
    n = ids.shape[0]
    with torch.no_grad():
        return model(ids[None], attention_mask=block_causal_mask(n, block)[None, None],
                     position_ids=torch.arange(n)[None]).logits[0]


def test_checkpoint_folder_is_what_the_published_code_reads(pair):
    preset, folder, published, ours, config = pair
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == ("sdar_moe" if preset == "tiny_sdar_moe" else "sdar")
    assert cfg["mask_token_id"] < cfg["vocab_size"] and cfg["pad_token_id"] == cfg["eos_token_id"]
    assert config.tie_word_embeddings == (preset == "tiny_sdar")
    assert ("lm_head.weight" in checkpoint_layout(config)) != config.tie_word_embeddings
    if config.tie_word_embeddings:
        assert published.lm_head.weight.data_ptr() == published.model.embed_tokens.weight.data_ptr()
        assert ours.lm_head.weight is ours.embed_tokens.weight


@pytest.mark.parametrize("length", [3, 4, 13])
def test_logits_equal_published_forward(pair, length):
    _, _, published, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    mine, theirs = _ours(ours, [ids]), _published(published, ids)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-4)
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))


def test_batch_of_sequences_equals_each_alone_published(pair):
    _, _, published, ours, config = pair
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (9, 4, 15)]
    batched = _ours(ours, seqs).split([9, 4, 15])
    for ids, mine in zip(seqs, batched):
        torch.testing.assert_close(mine, _published(published, ids), rtol=1e-5, atol=1e-4)


def test_cached_prefix_forward_equals_published_store_kv_path(pair):
    """The published decode step: prefix K/V stored by a store_kv=True forward, then one block against it."""
    from transformers.cache_utils import DynamicCache

    _, _, published, ours, config = pair
    ids = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(7))
    mask = block_causal_mask(12, BLOCK)[None, None]
    cache = DynamicCache()
    with torch.no_grad():
        published(ids[None, :8], attention_mask=mask[..., :8, :8], position_ids=torch.arange(8)[None],
                  past_key_values=cache, use_cache=True, store_kv=True)
        step = published(ids[None, 8:], attention_mask=mask[..., 8:, :12], position_ids=torch.arange(8, 12)[None],
                         past_key_values=cache, use_cache=True, store_kv=False).logits[0]
    torch.testing.assert_close(_ours(ours, [ids])[8:], step, rtol=1e-5, atol=1e-4)


def test_config_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="rope_scaling"):
        SDARConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="attention_bias"):
        SDARConfig(attention_bias=True)
    with pytest.raises(ValueError, match="model_type"):
        SDARConfig(model_type="qwen3")


def test_moe_layers_follow_qwen3_moe_rule():
    c = SDARConfig(model_type="sdar_moe", num_experts=8, num_hidden_layers=4, mlp_only_layers=[0],
                   decoder_sparse_step=1)
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert not SDARConfig(num_hidden_layers=2).is_moe_layer(1)
