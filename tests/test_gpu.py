"""GPU checks (pytest -m gpu): FlashInfer vs sdpa, CUDA graphs vs eager, the tiny model on GPU = CPU."""
from __future__ import annotations

import random

import pytest
import torch
from backend_helpers import random_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _flashinfer():
    return pytest.importorskip("flashinfer")


def test_flashinfer_matches_sdpa_on_random_paged_inputs():
    _flashinfer()
    from fluxlab.engine.layers.attention import KVCache, SdpaAttention, build_metadata
    from fluxlab.engine.layers.attention_flashinfer import FlashInferAttention
    from fluxlab.engine.layers.segments import Segments
    from fluxlab.models.llada2.model import LLaDA2MoeConfig
    from fluxlab.models.llada2.presets import preset_config

    device, bl = torch.device("cuda"), 32
    config = LLaDA2MoeConfig.from_dict(preset_config("small"))
    rows = random_rows(6, 64, random.Random(0))
    caches = [KVCache(1, 64, bl, 4, 128, torch.bfloat16, device) for _ in range(2)]
    torch.manual_seed(0)
    caches[0].k.normal_()
    caches[0].v.normal_()
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    tokens = sum(n for _, n, _ in rows) * bl
    q = torch.randn(tokens, 16, 128, dtype=torch.bfloat16, device=device)
    k = torch.randn(tokens, 4, 128, dtype=torch.bfloat16, device=device)
    v = torch.randn(tokens, 4, 128, dtype=torch.bfloat16, device=device)
    sdpa, fi = SdpaAttention(caches[0]), FlashInferAttention(caches[1], config, device)
    sdpa.begin(build_metadata(Segments.of_rows(rows), bl, device))
    fi.begin(build_metadata(Segments.of_rows(rows), bl, device, dense=False))
    want, got = sdpa.forward(0, q, k, v).float(), fi.forward(0, q, k, v).float()
    assert (want - got).abs().max().item() < 2e-2
    assert torch.equal(caches[0].k, caches[1].k)


def _llm(*overrides):
    from fluxlab.llm import LLM

    return LLM(overrides=["model=tiny_llada2", "engine.device=cuda", "decoding.block_length=32", "model.max_model_len=512",
                          "scheduler.max_num_seqs=8", "scheduler.max_scheduled_tokens=512", *overrides])


def _prompts(llm, n):
    text = "Janet has 16 eggs and sells the rest at the market for two dollars each. " * 6
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    return [ids[i:i + 10 + 7 * i] for i in range(n)]


@pytest.mark.parametrize("policy", ["paged", "dynamic"])
def test_graph_replay_gives_the_same_tokens_as_eager(policy, monkeypatch):
    """One graph runner replays every batch either policy makes (decode, commit + decode, prefill
    chunks, any mix and row count) with the eager forward's tokens. The engine's ladder has every
    size up to 32 segments, so no batch here would pad: a sparse ladder makes both modes pad and
    split."""
    _flashinfer()
    from fluxlab.engine import graph_runner
    from fluxlab.engine.request import SamplingParams

    monkeypatch.setattr(graph_runner, "ladder_sizes", lambda top: {n for n in (1, 2, 4, 8, 16) if n <= top})

    base = ["model=llada2_mini", "model.preset=small", "model.load_format=random", "attention=flashinfer",
            "engine.dtype=bfloat16", "decoding.steps=8", f"scheduler={policy}"]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (96, 40, 70, 96, 33, 64, 50)]
    eager = _llm(*base)
    want = [r.token_ids for r in eager.generate(_prompts(eager, 7), params)]
    assert eager.engine.runner.num_graph_forwards == 0
    eager.shutdown()
    for mode in ("padded", "decomposed"):
        graphs = _llm(*base, "attention.use_decode_cuda_graph=true", "attention.cuda_graph_capture_bs=[1,2,4,8]",
                      f"attention.cuda_graph_decode_mode={mode}")
        runner = graphs.engine.runner
        assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8, 16]  # 16 = 2 x 8
        # one FlashInfer workspace for the eager backend and every graph (replays interleave sizes below)
        assert len({id(runner.attention.workspace)} | {id(g.attention.workspace) for g in runner.graphs.graphs.values()}) == 1
        got = [r.token_ids for r in graphs.generate(_prompts(graphs, 7), params)]
        assert got == want, mode
        # every forward here holds at most 16 segments, so none falls back to eager
        assert runner.num_eager_forwards == 0 and runner.num_graph_forwards > 0, mode
        graphs.shutdown()


def test_tiny_model_on_gpu_equals_cpu_at_fp32():
    from fluxlab.engine.request import SamplingParams

    params = SamplingParams(max_new_tokens=64)
    cpu = _llm("engine.device=cpu", "engine.dtype=float32", "attention=sdpa")
    gpu = _llm("engine.dtype=float32", "attention=sdpa")
    prompts = _prompts(cpu, 4)
    assert [r.token_ids for r in gpu.generate(prompts, params)] == [r.token_ids for r in cpu.generate(prompts, params)]
