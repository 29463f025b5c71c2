"""model.quantization=fp8 on Diffusion-Gemma (fluxlab/models/diffusion_gemma/fp8_checkpoint.py): which
weights are e4m3, the FP8 checkpoint (names, scales, refusals), the engine and config validation.
Exactness against the reference and batch invariance: tests/test_fp8_diffusion_gemma_exact.py."""
from __future__ import annotations

import json

import pytest
import torch

from fluxlab.engine.layers.fp8 import FP8_DTYPE
from fluxlab.models.diffusion_gemma.fp8_checkpoint import PROJECTIONS, write_fp8_checkpoint
from fluxlab.models.diffusion_gemma.layers import Fp8GemmaExperts
from fluxlab.models.diffusion_gemma.loader import load_diffusion_gemma


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from fluxlab.checkpoint import write_checkpoint

    return write_checkpoint("tiny_diffusion_gemma", tmp_path_factory.mktemp("dg") / "tiny_dg", seed=0)




# ------------------------------------------------------------------------------- which weights, the checkpoint

def test_quantize_at_load_makes_projections_and_experts_fp8_and_nothing_else(tiny):
    model = load_diffusion_gemma(tiny, torch.float32, "cpu", quantization="fp8")
    fp8 = {n for n, p in model.named_parameters() if p.dtype == FP8_DTYPE}
    want = set()
    for i, layer in enumerate(model.layers):
        want |= {f"layers.{i}.{p}.weight" for p in PROJECTIONS if not (p.endswith("v_proj") and layer.self_attn.v_proj is None)}
        want |= {f"layers.{i}.experts.gate_up_proj", f"layers.{i}.experts.down_proj"}
    assert fp8 == want and len(want) == 4 * 8 + 2 * 1  # sliding layers have v_proj, full layers not (k_eq_v)
    for name, p in model.named_parameters():
        if name.endswith("_scale_inv"):
            assert p.dtype == torch.float32 and name.removesuffix("_scale_inv") in fp8, name
        elif name not in fp8:  # router, norms, scales, the embedding/head, the self-conditioning MLP
            assert p.dtype == torch.float32, name
    assert model.layers[0].experts.gate_up_proj_scale_inv.shape == (4, 2, 1)  # I = 32: a grid per half


def test_an_fp8_checkpoint_has_transformers_names_and_loads_to_the_quantize_at_load_weights(tiny, tmp_path):
    from safetensors import safe_open

    dst = write_fp8_checkpoint(tiny, tmp_path / "fp8")
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    assert (dst / "generation_config.json").is_file() and (dst / "tokenizer.json").is_file()
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.decoder.layers.1.self_attn.q_proj.weight").dtype == FP8_DTYPE
        assert f.get_tensor("model.decoder.layers.1.self_attn.q_proj.weight_scale_inv").shape == (1, 1)
        assert f.get_tensor("model.decoder.layers.0.experts.gate_up_proj").dtype == FP8_DTYPE
        assert f.get_tensor("model.decoder.layers.0.experts.gate_up_proj_scale_inv").shape == (4, 2, 1)
        assert f.get_tensor("model.decoder.layers.0.router.proj.weight").dtype == torch.float32
    assert "model.decoder.self_conditioning.gate_proj.weight_scale_inv" not in names
    assert "model.decoder.embed_tokens.weight_scale_inv" not in names
    got = dict(load_diffusion_gemma(dst, torch.float32, "cpu", quantization="fp8").named_parameters())
    want = dict(load_diffusion_gemma(tiny, torch.float32, "cpu", quantization="fp8").named_parameters())
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name].float(), want[name].float()), name


def _rewrite(dst, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_fp8_checkpoints_that_do_not_fit_are_refused_naming_the_tensor(tiny, tmp_path):
    from fluxlab.engine.layers.fp8 import quantize_blocks

    dst = write_fp8_checkpoint(tiny, tmp_path / "fp8")
    with pytest.raises(ValueError, match="set model.quantization=fp8"):
        load_diffusion_gemma(dst, torch.float32, "cpu")

    _rewrite(dst, lambda t: t.pop("model.decoder.layers.2.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=r"layers\.2\.self_attn\.o_proj\.weight_scale_inv"):
        load_diffusion_gemma(dst, torch.float32, "cpu", quantization="fp8")

    dst = write_fp8_checkpoint(tiny, tmp_path / "router")  # another writer's choice: an FP8 router
    name = "model.decoder.layers.0.router.proj.weight"
    _rewrite(dst, lambda t: t.update(zip((name, name + "_scale_inv"), quantize_blocks(t[name]))))
    with pytest.raises(ValueError, match=r"router\.proj\.weight: torch.float8_e4m3fn in the checkpoint"):
        load_diffusion_gemma(dst, torch.float32, "cpu", quantization="fp8")

    dst = write_fp8_checkpoint(tiny, tmp_path / "one_grid")  # one grid over gate and up (transformers' layout)
    name = "model.decoder.layers.3.experts.gate_up_proj"
    _rewrite(dst, lambda t: t.update({name + "_scale_inv": t[name + "_scale_inv"][:, :1].contiguous()}))
    with pytest.raises(ValueError, match="a grid for the gate half|one 128-row scale grid for the gate half"):
        load_diffusion_gemma(dst, torch.float32, "cpu", quantization="fp8")


BASE = ["engine.dtype=float32", "engine.device=cpu", "scheduler.max_num_seqs=4", "scheduler.max_scheduled_tokens=64"]


def test_the_engine_serves_fp8_quantized_at_load_and_from_an_fp8_checkpoint(tiny, tmp_path, one_thread):
    from fluxlab import LLM
    from fluxlab.engine.request import SamplingParams

    at_load = LLM(overrides=BASE + ["model=tiny_diffusion_gemma", f"model.path={tiny}", "model.quantization=fp8"])
    assert isinstance(at_load.engine.model.layers[0].experts, Fp8GemmaExperts)
    vocab = at_load.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.randint(0, vocab, (n,), generator=gen).tolist(), n % 3, m) for n, m in zip((1, 3, 9, 21), (5, 8, 20, 8))]
    params = [SamplingParams(max_new_tokens=n, seed=s) for _, s, n in cases]
    want = [r.token_ids for r in at_load.generate([p for p, _, _ in cases], params)]
    assert all(len(w) > 0 for w in want)
    dst = write_fp8_checkpoint(tiny, tmp_path / "fp8")
    with pytest.raises(ValueError, match="set model.quantization=fp8"):
        LLM(overrides=BASE + ["model=tiny_diffusion_gemma", f"model.path={dst}"])
    from_file = LLM(overrides=BASE + ["model=tiny_diffusion_gemma", f"model.path={dst}", "model.quantization=fp8"])
    assert [r.token_ids for r in from_file.generate([p for p, _, _ in cases], params)] == want


def test_fp8_tokens_of_a_request_alone_equal_its_tokens_in_a_batch_through_the_engine(tiny, one_thread):
    """CPU engine, 8 requests at 4 seats (batches change as requests finish and others come in): each one's
    tokens equal its tokens alone. The paged sdpa runs each row over its own keys on CPU; over a key axis
    padded to the batch, an ulp moved before a quantization moved an e4m3 code and so a sampled token."""
    from fluxlab import LLM
    from fluxlab.engine.request import SamplingParams

    llm = LLM(overrides=BASE + ["model=tiny_diffusion_gemma", f"model.path={tiny}", "model.quantization=fp8"])
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 2, 3, 6, 9, 14, 21, 30)]
    params = [SamplingParams(max_new_tokens=m, seed=i) for i, m in enumerate((5, 8, 20, 8, 12, 3, 16, 9))]
    batched = [r.token_ids for r in llm.generate(prompts, params)]
    assert [llm.generate([p], [s])[0].token_ids for p, s in zip(prompts, params)] == batched


def test_fp8_config_is_accepted_for_diffusion_gemma_and_tp_still_refused():
    from fluxlab.config import ConfigError, compose, validate_config

    validate_config(compose("serve", ["model=tiny_diffusion_gemma", "model.quantization=fp8"]), cuda_available=False)
    with pytest.raises(ConfigError, match="parallel.tp_size"):
        validate_config(compose("serve", ["model=tiny_diffusion_gemma", "model.quantization=fp8", "parallel=tp2"]),
                        cuda_available=False)
