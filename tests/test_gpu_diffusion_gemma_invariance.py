"""Batch invariance of Diffusion-Gemma in bf16 on the GPU (issue 36.2, pytest -m gpu): a request's
tokens do not depend on what else is in the batch.

A transformers-written checkpoint of Diffusion-Gemma's structure at a small size (canvas 256, the
default 5:1 sliding/full pattern, a window of two canvases, full layers with their own head_dim and
KV heads, 32 experts top-8, soft-cap), random weights, served in bf16 with the denoiser graphs:
one request alone, then the same request (same prompt, same seed) first in batches of 8 and 64
requests of other prompts, lengths (one to three canvases: eager prefills beside it), seeds and
lengths. Its tokens must be equal in all three (with the engine's defaults: at batch 1 the dense MLP runs on a
second stream, model.dense_beside_experts_). Then one stream against two streams at every batch.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CANVAS = 256


def _shape():
    from test_diffusion_gemma_shapes import Shape

    return Shape("gpu_invariance", dict(
        hidden_size=512, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, global_head_dim=128, num_global_key_value_heads=2, sliding_window=2 * CANVAS,
        layer_types=None, final_logit_softcapping=30.0, num_experts=32, top_k_experts=8, moe_intermediate_size=128),
        canvas=CANVAS, vocab=4096, requests=(), scale=1.0, peak=4.0, generation=dict(
            max_denoising_steps=6, entropy_bound=1.0, t_min=0.4, t_max=1.0, stability_threshold=0,
            confidence_threshold=0.5))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from test_diffusion_gemma_shapes import write_checkpoint

    from fluxlab.llm import LLM

    path = write_checkpoint(_shape(), tmp_path_factory.mktemp("ckpt") / "dg")
    llm = LLM(overrides=[
        "model=tiny_diffusion_gemma", f"model.path={path}", "model.preset=null", f"decoding.canvas_length={CANVAS}",
        f"model.max_model_len={8 * CANVAS}", f"model.max_new_tokens={2 * CANVAS}", "engine.dtype=bfloat16",
        "engine.device=cuda", "scheduler=paged", "scheduler.max_num_seqs=64",
        f"scheduler.max_scheduled_tokens={64 * 2 * CANVAS}", "scheduler.num_device_pages=640",
        "scheduler.enable_prefix_cache=false", "attention.use_decode_cuda_graph=true",
        "attention.cuda_graph_capture_bs=[1,8,64]"])
    yield llm
    llm.shutdown()


def _request(i: int) -> tuple[list[int], object]:
    from fluxlab.engine.request import SamplingParams

    g = torch.Generator().manual_seed(1000 + i)
    length = 1 + int(torch.randint(0, 3 * CANVAS, (1,), generator=g))  # up to three canvases of prompt
    prompt = torch.randint(4, 4096, (length,), generator=g).tolist()
    max_new = (CANVAS, 2 * CANVAS, CANVAS + 37)[i % 3]
    return prompt, SamplingParams(max_new_tokens=max_new, seed=i, ignore_eos=True)


def _target_in_batch(llm, size: int) -> list[int]:
    """The target request's tokens, first in a batch of `size` (the others: `_request`)."""
    from fluxlab.engine.request import SamplingParams

    target = ([5 + (7 * j) % 4000 for j in range(100)], SamplingParams(max_new_tokens=2 * CANVAS, seed=12345,
                                                                      ignore_eos=True))
    others = [_request(i) for i in range(1, size)]
    prompts = [target[0]] + [p for p, _ in others]
    params = [target[1]] + [s for _, s in others]
    token_ids = llm.generate(prompts, params)[0].token_ids
    assert len(token_ids) == 2 * CANVAS
    return token_ids


def test_a_requests_tokens_do_not_depend_on_the_batch(llm):
    results = {size: _target_in_batch(llm, size) for size in (1, 8, 64)}
    runner = llm.engine.runner
    assert runner.num_graph_forwards > 0 and runner.num_eager_forwards > 0  # both paths met
    # the bf16 engine runs q/k/v and gate/up fused (model.fuse_projections_), as the speed benchmarks do
    assert all(layer.self_attn.qkv_weight is not None and layer.mlp.gate_up_weight is not None
               for layer in runner.model.layers)
    assert results[8] == results[1], "batch of 8"
    assert results[64] == results[1], "batch of 64"


def test_the_dense_mlp_beside_the_experts_changes_no_token(llm):
    """DiffusionGemmaModel.dense_beside_experts_: the dense MLP on a second stream, forked and joined inside
    the captured graphs; the same kernels on the same inputs, so the same tokens (a missing join is a race)."""
    from fluxlab.models.diffusion_gemma.loader import DENSE_BESIDE_EXPERTS_TOKENS

    runner = llm.engine.runner
    assert all(layer.side_max_tokens == DENSE_BESIDE_EXPERTS_TOKENS for layer in runner.model.layers)  # the default
    results = {}
    for max_tokens in (0, 1 << 20):  # one stream; two streams at every batch here
        runner.model.dense_beside_experts_(max_tokens)
        runner.graphs.release()  # captured again with (or without) the fork and join
        graph_forwards = runner.num_graph_forwards
        results[max_tokens] = {size: _target_in_batch(llm, size) for size in (1, 8)}
        assert runner.num_graph_forwards > graph_forwards
    runner.model.dense_beside_experts_(DENSE_BESIDE_EXPERTS_TOKENS)
    runner.graphs.release()
    assert results[1 << 20] == results[0]
