"""SDAR on the GPU (pytest -m gpu): the tiny SDAR model on CUDA fp32 gives the CPU's tokens, and its
bf16 graph replay on the paged Triton attention gives the eager forward's tokens (dense and MoE)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _llm(model: str, *overrides):
    from fluxlab.llm import LLM

    return LLM(overrides=[f"model={model}", "engine.device=cuda", "decoding.block_length=4", "model.max_model_len=256",
                          "scheduler.max_num_seqs=8", *overrides])


def _prompts(llm, n: int) -> list[list[int]]:
    ids = llm.tokenizer.encode("Janet has 16 eggs and sells the rest at the market. " * 4, add_special_tokens=False)
    return [ids[i:i + 3 + 5 * i] for i in range(n)]


@pytest.mark.parametrize("model", ["tiny_sdar", "tiny_sdar_moe"])
def test_tiny_sdar_on_gpu_equals_cpu_at_fp32(model):
    from fluxlab.engine.request import SamplingParams

    params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.0)  # CUDA and CPU generators draw differently
    cpu = _llm(model, "engine.device=cpu", "engine.dtype=float32", "attention=sdpa")
    want = [r.token_ids for r in cpu.generate(_prompts(cpu, 4), params)]
    cpu.shutdown()
    gpu = _llm(model, "engine.dtype=float32", "attention=sdpa")
    assert [r.token_ids for r in gpu.generate(_prompts(gpu, 4), params)] == want
    gpu.shutdown()


@pytest.mark.parametrize("model", ["tiny_sdar", "tiny_sdar_moe"])
def test_sdar_graph_replay_on_triton_attention_equals_eager(model):
    from fluxlab.engine.request import SamplingParams

    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 9, 17, 30, 5)]
    base = ["engine.dtype=bfloat16", "attention=triton"]
    eager = _llm(model, *base)
    want = [r.token_ids for r in eager.generate(_prompts(eager, 5), params)]
    eager.shutdown()
    graphs = _llm(model, *base, "attention.use_decode_cuda_graph=true", "attention.cuda_graph_capture_bs=[1,2,4,8]")
    got = [r.token_ids for r in graphs.generate(_prompts(graphs, 5), params)]
    assert graphs.engine.runner.num_graph_forwards > 0
    assert got == want
    graphs.shutdown()
