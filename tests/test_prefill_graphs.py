"""attention.use_prefill_cuda_graph (GPU, `-m gpu`): prefill forwards too large for the decode graphs
replay graphs captured at attention.cuda_graph_capture_sizes, with the eager forward's tokens."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _llm(*overrides):
    from fluxlab.llm import LLM

    return LLM(overrides=["model=llada2_mini", "model.preset=small", "model.load_format=random", "engine.device=cuda",
                          "engine.dtype=bfloat16", "decoding.block_length=32", "decoding.steps=8",
                          "model.max_model_len=1024", "scheduler.max_num_seqs=4", "scheduler.max_scheduled_tokens=1024",
                          *overrides])


@pytest.mark.parametrize("backend", ["flashinfer", "fa4"])
def test_prefill_graphs_replay_prefill_forwards_with_the_eager_tokens(backend):
    pytest.importorskip("flash_attn.cute" if backend == "fa4" else "flashinfer")
    from fluxlab.engine.graph_runner import ladder_sizes
    from fluxlab.engine.request import SamplingParams

    base = [f"attention={backend}"]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    eager = _llm(*base)
    text = "Janet has 16 eggs and sells the rest at the market for two dollars each. " * 20
    ids = eager.tokenizer.encode(text, add_special_tokens=False)
    prompts = [ids[:100 + 37 * i] for i in range(4)]  # 4..7 blocks each: the first forward is ~22 segments
    want = [r.token_ids for r in eager.generate(prompts, params)]
    eager.shutdown()

    decode_only = _llm(*base, "attention.use_decode_cuda_graph=true", "attention.cuda_graph_capture_bs=[1,2,4]")
    assert decode_only.engine.runner.graphs.sizes == sorted(ladder_sizes(8)) == [1, 2, 3, 4, 5, 6, 7, 8]  # 8 = 2 x 4
    assert [r.token_ids for r in decode_only.generate(prompts, params)] == want
    assert decode_only.engine.runner.num_eager_forwards > 0  # the prefill forward does not fit
    decode_only.shutdown()

    both = _llm(*base, "attention.use_decode_cuda_graph=true", "attention.cuda_graph_capture_bs=[1,2,4]",
                "attention.use_prefill_cuda_graph=true", "attention.cuda_graph_capture_sizes=[512,1024]")
    runner = both.engine.runner
    assert runner.graphs.sizes == sorted(ladder_sizes(8) | {16, 32})  # 512 and 1024 tokens are 16 and 32 blocks
    assert [r.token_ids for r in both.generate(prompts, params)] == want
    assert runner.num_eager_forwards == 0 and runner.num_graph_forwards > 0
    both.shutdown()
