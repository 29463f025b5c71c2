"""Diffusion-Gemma denoiser CUDA graphs (pytest -m gpu): replays draw each request's numbers from its
own generator and give the tokens of the same static path called as is (bf16, fp32) and of the
eager engine (fp32), for batches of several row counts padded to the ladder."""
from __future__ import annotations

import functools

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BASE = ["model=tiny_diffusion_gemma", "engine.device=cuda", "scheduler.max_num_seqs=6",
        "scheduler.max_scheduled_tokens=64", "scheduler.num_device_pages=96"]
GRAPHS = ["attention.use_decode_cuda_graph=true", "attention.cuda_graph_capture_bs=[1,2,4]"]


def _llm(*overrides):
    from fluxlab.llm import LLM

    return LLM(overrides=BASE + list(overrides))


@functools.lru_cache(maxsize=None)
def _run(*overrides: str, static_sizes: tuple = ()) -> tuple[list, dict]:
    """(tokens, runner counters and captured graph keys) of one engine over the workload."""
    llm = _llm(*overrides)
    if static_sizes:
        llm.engine.runner.enable_denoise_graphs(list(static_sizes), capture=False)
    tokens = _generate(llm)
    runner = llm.engine.runner
    info = dict(graph=runner.num_graph_forwards, eager=runner.num_eager_forwards,
                captured=list(runner.graphs.denoisers) if runner.graphs is not None else [])
    llm.shutdown()
    return tokens, info


def _generate(llm, num_requests: int = 9):
    from fluxlab.engine.request import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 3, 7, 8, 9, 13, 16, 21, 30)]
    params = [SamplingParams(max_new_tokens=n, seed=s) for s, n in zip(range(num_requests), (5, 8, 20) * 3)]
    return [r.token_ids for r in llm.generate(prompts[:num_requests], params)]


def test_graph_generator_slot_draws_the_requests_numbers():
    """The mechanism alone: a graph drawing from a registered slot generator, whose state is copied
    in from a request's generator before each replay and back after, draws what the request's
    generator draws eagerly (exponential_ then randint, as the sampler), replay after replay."""
    device = torch.device("cuda")
    slot = torch.Generator(device=device)
    noise = torch.empty(4, 1000, device=device)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(slot)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up
        noise.exponential_(1, generator=slot)
        torch.randint(0, 50, (1, 8), generator=slot, device=device)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        noise.exponential_(1, generator=slot)
        drawn = torch.randint(0, 50, (1, 8), generator=slot, device=device)
    requests = [torch.Generator(device=device).manual_seed(s) for s in (3, 4)]
    mirrors = [torch.Generator(device=device).manual_seed(s) for s in (3, 4)]
    for _ in range(3):
        for request, mirror in zip(requests, mirrors):
            slot.set_state(request.get_state())
            graph.replay()
            request.set_state(slot.get_state())
            want_noise = torch.empty(4, 1000, device=device).exponential_(1, generator=mirror)
            want = torch.randint(0, 50, (1, 8), generator=mirror, device=device)
            assert torch.equal(noise, want_noise) and torch.equal(drawn, want)
            assert torch.equal(request.get_state(), mirror.get_state())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_replay_equals_the_static_path_called_eagerly(dtype):
    """Same buffers, same kernels: a replay gives exactly the un-captured static path's tokens.
    Six seats and graphs of 1, 2, 4 rows: batches of 3 pad to 4, of 5-6 run eagerly; steps that
    commit a canvas replay the commit graph."""
    got, info = _run(*GRAPHS, f"engine.dtype={dtype}")
    assert info["graph"] > 0 and info["eager"] > 0
    captured = info["captured"]
    assert len({key[0] for key in captured}) >= 2 and any(key[3] for key in captured)  # row sizes; a commit graph
    want, _ = _run(f"engine.dtype={dtype}", static_sizes=(1, 2, 4))
    assert got == want


def test_graph_replay_equals_the_eager_engine_at_fp32():
    got, _ = _run(*GRAPHS, "engine.dtype=float32")
    want, info = _run("engine.dtype=float32")
    assert info["graph"] == 0 and got == want
