"""attention=triton (kernels/block_attention.py): on CPU under the Triton interpreter the kernel and
the backend give sdpa's outputs on paged decode, commit + decode and prefill rows (fp32, eager and
through fixed graph buffers with padding), and the engine gives the sdpa engine's tokens; on a GPU
(`-m gpu`) the same outputs within bf16 tolerance, a CUDA graph replay that follows new rows, fp32
tokens equal to sdpa's, and graph replay = eager through the engine."""
from __future__ import annotations

import importlib.util
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from backend_helpers import fused_and_unfused_writes, graph_replays_and_eager, random_rows  # noqa: E402
from triton_helpers import run_interpreter_checks  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def compare_with_sdpa(device: torch.device, dtype: torch.dtype, bl: int, heads: int, kv_heads: int, dim: int,
                      graph_segments: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(triton backend output, sdpa backend output) on random rows over one layer's random pages."""
    from fluxlab.engine.layers.attention import AttentionMetadata, KVCache, SdpaAttention, build_metadata
    from fluxlab.engine.layers.attention_triton import TritonAttention
    from fluxlab.engine.layers.segments import Segments

    num_pages = 40
    rows = random_rows(5, num_pages, random.Random(seed), max_blocks=3)
    gen = torch.Generator().manual_seed(seed)
    caches = [KVCache(1, num_pages + 1, bl, kv_heads, dim, dtype, device) for _ in range(2)]
    caches[0].k.copy_(torch.randn(caches[0].k.shape, generator=gen))
    caches[0].v.copy_(torch.randn(caches[0].v.shape, generator=gen))
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    n = sum(r[1] for r in rows)
    q, k, v = (torch.randn(n * bl, h, dim, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads))
    sdpa = SdpaAttention(caches[0])
    sdpa.begin(build_metadata(Segments.of_rows(rows), bl, device))
    want = sdpa.forward(0, q, k, v)
    backend = TritonAttention(caches[1], device, num_qo_heads=heads, head_dim=dim, max_blocks_per_seq=8,
                              graph_segments=graph_segments)
    meta = build_metadata(Segments.of_rows(rows), bl, device, dense=False)
    if graph_segments:  # as the graph runner replays: real rows, then scratch segments on the last page
        pad = graph_segments - n
        scratch = torch.arange(num_pages * bl, (num_pages + 1) * bl, device=device).repeat(pad)
        backend.meta = AttentionMetadata(torch.cat([meta.slot_mapping, scratch]), None)
        backend.plan(Segments.of_rows(rows).padded(pad, num_pages))
        backend.copy_plan_in()  # what the graph's first kernel does
        q, k, v = (torch.cat([t, torch.zeros(pad * bl, *t.shape[1:], dtype=dtype, device=device)]) for t in (q, k, v))
        got = backend.forward(0, q, k, v)[:n * bl]
    else:
        backend.begin(meta)
        got = backend.forward(0, q, k, v)
    assert torch.equal(caches[0].k[0, :num_pages], caches[1].k[0, :num_pages])  # K/V written as sdpa writes them
    return got, want


def _interpreter_checks() -> None:
    cpu = torch.device("cpu")
    # GQA 2:1, 4:1 (a program stacks a KV head's query heads) and MHA; a block of 8 (the kernel pads its
    # rows to 16) and of 16; eager and graph buffers
    for bl, heads, kv_heads, dim, graph_segments in ((8, 4, 2, 16, 0), (8, 8, 2, 16, 0), (16, 2, 2, 32, 0),
                                                     (8, 4, 2, 16, 14)):
        got, want = compare_with_sdpa(cpu, torch.float32, bl, heads, kv_heads, dim, graph_segments, seed=bl + heads)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _check_stacked_heads_give_the_per_head_programs_outputs()
    _check_pages_per_step_give_the_one_page_outputs()
    fused, unfused = fused_and_unfused_writes(cpu, torch.float32)
    assert fused[1].any() and fused[2].any()
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)
    # (bf16 only on the GPU: the interpreter's bf16 tl.dot returns garbage, ~1e10 off on a 16x16 product)
    _engine_check()
    print("interpreter checks ok")


def _check_stacked_heads_give_the_per_head_programs_outputs() -> None:
    from fluxlab.kernels.block_attention import block_attention, heads_per_program

    assert heads_per_program(4, 32) == 4 and heads_per_program(8, 32) == 1 and heads_per_program(3, 16) == 1
    gen = torch.Generator().manual_seed(5)
    bl, heads, kv_heads, dim, pages = 8, 8, 2, 16, 6
    k, v = (torch.randn(pages, bl, kv_heads, dim, generator=gen) for _ in range(2))
    q = torch.randn(3 * bl, heads, dim, generator=gen)
    table = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 0]], dtype=torch.int32)
    used = torch.tensor([3 * bl, bl, 2 * bl], dtype=torch.int32)
    outs = {p: block_attention(q, k, v, table, used, dim ** -0.5, pack=p) for p in (1, 2, 4)}
    for p in (2, 4):
        torch.testing.assert_close(outs[p], outs[1], rtol=1e-6, atol=1e-6)
    # and against the definition: block s attends to every key of its pages
    s, kv = 2, 1
    keys = torch.cat([k[4], k[5]])[:, kv]
    vals = torch.cat([v[4], v[5]])[:, kv]
    head = 5  # of KV head 1
    want = torch.softmax(q[2 * bl:3 * bl, head] @ keys.T * dim ** -0.5, dim=-1) @ vals
    torch.testing.assert_close(outs[4][s * bl:(s + 1) * bl, head], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pack=3"):  # 4 heads per KV head
        block_attention(q, k, v, table, used, 1.0, pack=3)


def _check_pages_per_step_give_the_one_page_outputs() -> None:
    from fluxlab.kernels.block_attention import block_attention

    gen = torch.Generator().manual_seed(7)
    bl, heads, kv_heads, dim, pages = 8, 4, 2, 16, 9
    k, v = (torch.randn(pages, bl, kv_heads, dim, generator=gen) for _ in range(2))
    q = torch.randn(4 * bl, heads, dim, generator=gen)
    # 5, 1, 3 and 7 pages: steps of 2 and 4 pages end on a partial step (its missing pages masked)
    table = torch.tensor([[0, 1, 2, 3, 4, 0, 0], [5, 0, 0, 0, 0, 0, 0], [6, 7, 8, 0, 0, 0, 0],
                          [8, 7, 6, 5, 4, 3, 2]], dtype=torch.int32)
    used = torch.tensor([5 * bl, bl, 3 * bl, 7 * bl], dtype=torch.int32)
    outs = {n: block_attention(q, k, v, table, used, dim ** -0.5, pages_per_step=n) for n in (1, 2, 4)}
    assert torch.isfinite(outs[4]).all()
    for n in (2, 4):
        torch.testing.assert_close(outs[n], outs[1], rtol=1e-5, atol=1e-5)
    # block 3 attends to pages 8, 7, ..., 2 (the table's order does not matter to the softmax)
    keys, vals = (torch.cat([t[i] for i in (8, 7, 6, 5, 4, 3, 2)])[:, 0] for t in (k, v))
    want = torch.softmax(q[3 * bl:, 1] @ keys.T * dim ** -0.5, dim=-1) @ vals
    torch.testing.assert_close(outs[4][3 * bl:, 1], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pages_per_step=3"):
        block_attention(q, k, v, table, used, 1.0, pages_per_step=3)


def _engine_check() -> None:
    """The runner's eager path with attention=triton gives the sdpa engine's tokens (fp32, CPU)."""
    from backend_helpers import sdpa_and_backend_tokens
    from fluxlab.checkpoint import ensure_tiny_checkpoint

    torch.set_num_threads(1)
    want, got, runner = sdpa_and_backend_tokens(ensure_tiny_checkpoint(), "triton", max_model_len=256,
                                                max_new_tokens=40)
    assert got == want, (got, want)
    assert runner.num_eager_forwards > 0


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_kernel_backend_and_engine_under_the_triton_interpreter():
    run_interpreter_checks(__file__)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_the_kernel_refuses_shapes_it_cannot_tile():
    from fluxlab.kernels.block_attention import block_attention

    k = torch.zeros(4, 8, 2, 24)
    table, used = torch.zeros(1, 4, dtype=torch.int32), torch.full((1,), 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim=24"):
        block_attention(torch.zeros(8, 4, 24), k, k, table, used, 1.0)
    with pytest.raises(ValueError, match="whole blocks of 8"):
        block_attention(torch.zeros(12, 4, 16), torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16), table, used, 1.0)


# ---------------------------------------------------------------------------------------------- GPU

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("graph_segments", [0, 24])
def test_triton_matches_sdpa_on_gpu(graph_segments):
    cuda = torch.device("cuda")
    got, want = compare_with_sdpa(cuda, torch.bfloat16, 32, 16, 4, 128, graph_segments)
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all()
    assert (want - got).norm() / want.norm() < 1e-2 and (want - got).abs().max().item() < 3e-2
    got, want = compare_with_sdpa(cuda, torch.float32, 32, 16, 4, 128, graph_segments)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@requires_cuda
def test_fused_kv_write_gives_the_backend_writes_cache_and_output():
    """bf16: the fused QK-norm + RoPE writing K/V to the slot rows gives, bit for bit, the cache and
    the attention output of qk_norm_rope + the backend's own write."""
    fused, unfused = fused_and_unfused_writes(torch.device("cuda"), torch.bfloat16)
    assert fused[1].any() and fused[2].any()
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


@pytest.mark.gpu
@requires_cuda
def test_triton_graph_replay_follows_new_rows():
    """A captured kernel reads its page table and key counts from fixed buffers: replays with other
    rows (fewer real segments, the rest padding) give the eager call's output bit for bit."""
    from fluxlab.engine.layers.attention_triton import TritonAttention

    for replayed, eager in graph_replays_and_eager(TritonAttention):
        assert torch.equal(replayed, eager)


@pytest.mark.gpu
@requires_cuda
def test_triton_engine_at_fp32_gives_the_sdpa_tokens_and_graphs_the_eager_tokens():
    """fp32 on the GPU: attention=triton (eager) gives attention=sdpa's tokens on a batch, and in
    bf16 its CUDA graphs give its eager tokens, paged and dynamic."""
    from fluxlab.engine.request import SamplingParams
    from fluxlab.llm import LLM

    base = ["model=tiny_llada2", "model.load_format=random", "decoding.block_length=32", "model.max_model_len=512",
            "scheduler.max_num_seqs=8", "scheduler.enable_prefix_cache=false"]
    prompts = [[5 + i + j for j in range(17 + 23 * i)] for i in range(6)]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)

    def tokens(*extra):
        llm = LLM(overrides=base + list(extra))
        out = [r.token_ids for r in llm.generate(prompts, params)]
        llm.engine.shutdown()
        return out

    assert tokens("engine.dtype=float32", "attention=triton") == tokens("engine.dtype=float32", "attention=sdpa")
    for policy in ("paged", "dynamic"):
        eager = tokens("engine.dtype=bfloat16", "attention=triton", f"scheduler={policy}")
        graphed = tokens("engine.dtype=bfloat16", "attention=triton", f"scheduler={policy}",
                         "attention.use_decode_cuda_graph=true")
        assert graphed == eager, policy


if __name__ == "__main__":
    _interpreter_checks()
