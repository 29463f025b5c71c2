"""attention=fa4: its segment tables (CPU), and on a GPU (`-m gpu`, flash-attn-4 installed) the same
outputs as sdpa on paged decode and block-causal prefill rows, eager and under a CUDA graph, and the
same tokens as FlashInfer through the engine."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fluxlab.engine.layers.page_tables import segment_tables
from fluxlab.engine.layers.attention_flashinfer import plan_indices
from fluxlab.engine.layers.segments import Segments
from backend_helpers import graph_replays_and_eager, random_rows


def test_segment_tables_hold_the_pages_flashinfer_plans():
    rows = random_rows(7, 64, random.Random(3), max_blocks=4)
    table, used = segment_tables(Segments.of_rows(rows), width=8, fill_page=63)
    _, kv_indptr, kv_indices = plan_indices(Segments.of_rows(rows), 32)
    assert table.shape == (len(kv_indptr) - 1, 8) and table.dtype == np.int32
    for s in range(table.shape[0]):
        pages = kv_indices[kv_indptr[s]:kv_indptr[s + 1]]
        assert used[s] == len(pages) and table[s, :used[s]].tolist() == pages.tolist()
        assert (table[s, used[s]:] == 63).all()  # a real page past the segment's keys


def _reference_fa4(q, k_pages, v_pages, *, page_table, seqused_k, softmax_scale, causal):
    """flash_attn.cute.flash_attn_varlen_func's paged contract in torch (CPU stand-in): q [B, Sq, Hq, D],
    pages [P, page, Hkv, D]; batch b attends, non-causally here, to the first seqused_k[b] keys of its
    pages in page_table order. Returns (out, lse) like the package."""
    assert not causal and page_table.dtype == torch.int32 and seqused_k.dtype == torch.int32
    batch, _, heads, dim = q.shape
    groups = heads // k_pages.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(seqused_k[b])
        keys = k_pages[page_table[b].long()].flatten(0, 1)[:n].repeat_interleave(groups, dim=1)
        values = v_pages[page_table[b].long()].flatten(0, 1)[:n].repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[b].float(), keys.float()) * softmax_scale
        out[b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.float()).to(q.dtype)
    return out, None


@pytest.fixture
def reference_fa4(monkeypatch):
    import sys
    import types

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_varlen_func = lambda q, k, v, **kw: _reference_fa4(q, k, v, **kw)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)


@pytest.mark.parametrize("graph_segments", [0, 12])  # eager tables, and fixed graph buffers with padding
def test_fa4_backend_matches_sdpa_through_the_package_contract(reference_fa4, graph_segments):
    """The backend's glue (q view, page tables, seqused_k, padding segments) on CPU in fp32, with a
    torch stand-in for the FA4 kernel: the block-causal rule, as sdpa applies it."""
    from fluxlab.engine.layers.attention import AttentionMetadata, KVCache, SdpaAttention, build_metadata
    from fluxlab.engine.layers.attention_fa4 import Fa4Attention

    device, bl = torch.device("cpu"), 8
    rows = random_rows(5, 40, random.Random(11), max_blocks=3)
    gen = torch.Generator().manual_seed(0)
    caches = [KVCache(1, 41, bl, 2, 16, torch.float32, device) for _ in range(2)]
    caches[0].k.normal_(generator=gen)
    caches[0].v.normal_(generator=gen)
    for c in caches[1:]:
        c.k.copy_(caches[0].k)
        c.v.copy_(caches[0].v)
    n = sum(r[1] for r in rows)
    q, k, v = (torch.randn(n * bl, h, 16, generator=gen) for h in (4, 2, 2))
    sdpa = SdpaAttention(caches[0])
    sdpa.begin(build_metadata(Segments.of_rows(rows), bl, device))
    want = sdpa.forward(0, q, k, v)
    fa4 = Fa4Attention(caches[1], device, num_qo_heads=4, head_dim=16, max_blocks_per_seq=8,
                       graph_segments=graph_segments)
    meta = build_metadata(Segments.of_rows(rows), bl, device, dense=False)
    if graph_segments:  # as the graph runner replays: real rows, then scratch segments on page 40
        pad = graph_segments - n
        fa4.meta = AttentionMetadata(torch.cat([meta.slot_mapping, torch.arange(40 * bl, 41 * bl).repeat(pad)]), None)
        fa4.plan(Segments.of_rows(rows).padded(pad, 40))
        fa4.copy_plan_in()  # what the graph's first kernel does
        q, k, v = (torch.cat([t, torch.zeros(pad * bl, *t.shape[1:])]) for t in (q, k, v))
        got = fa4.forward(0, q, k, v)[:n * bl]
    else:
        fa4.begin(meta)
        got = fa4.forward(0, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0].k[0, :40], caches[1].k[0, :40])


def test_engine_with_the_fa4_backend_gives_the_sdpa_tokens(reference_fa4, tiny_ckpt, one_thread):
    """The runner's eager path with attention=fa4 (CPU, fp32, the torch stand-in kernel): prefill
    chunks, decode and commit + decode rows give the tokens sdpa gives."""
    from backend_helpers import sdpa_and_backend_tokens

    want, got, runner = sdpa_and_backend_tokens(tiny_ckpt, "fa4", max_model_len=512, max_new_tokens=48)
    assert got == want
    assert runner.num_eager_forwards > 0


# ---------------------------------------------------------------------------------------------- GPU

def _fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return pytest.importorskip("flash_attn.cute")


def _paged_case(rows, bl=32, num_pages=64, heads=16, kv_heads=4, dim=128, seed=0):
    from fluxlab.engine.layers.attention import KVCache

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    caches = [KVCache(1, num_pages, bl, kv_heads, dim, torch.bfloat16, device) for _ in range(2)]
    caches[0].k.normal_(generator=gen)
    caches[0].v.normal_(generator=gen)
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    tokens = sum(n for _, n, _ in rows) * bl
    qkv = [torch.randn(tokens, h, dim, dtype=torch.bfloat16, device=device, generator=gen)
           for h in (heads, kv_heads, kv_heads)]
    return caches, qkv


@pytest.mark.gpu
@pytest.mark.parametrize("max_blocks", [1, 3])  # 1: paged decode rows only; 3: block-causal prefill chunks too
def test_fa4_matches_sdpa_on_paged_rows(max_blocks):
    _fa4()
    from fluxlab.engine.layers.attention import SdpaAttention, build_metadata
    from fluxlab.engine.layers.attention_fa4 import Fa4Attention

    device, bl = torch.device("cuda"), 32
    rows = random_rows(6, 64, random.Random(max_blocks), max_blocks)
    (ref_cache, fa4_cache), (q, k, v) = _paged_case(rows)
    sdpa = SdpaAttention(ref_cache)
    fa4 = Fa4Attention(fa4_cache, device, num_qo_heads=16, head_dim=128, max_blocks_per_seq=8)
    sdpa.begin(build_metadata(Segments.of_rows(rows), bl, device))
    fa4.begin(build_metadata(Segments.of_rows(rows), bl, device, dense=False))
    want, got = sdpa.forward(0, q, k, v).float(), fa4.forward(0, q, k, v).float()
    assert torch.isfinite(got).all()
    assert (want - got).norm() / want.norm() < 1e-2
    assert (want - got).abs().max().item() < 2e-2
    assert torch.equal(ref_cache.k, fa4_cache.k) and torch.equal(ref_cache.v, fa4_cache.v)


@pytest.mark.gpu
def test_fa4_graph_replay_follows_new_rows():
    """A captured FA4 call reads its page table and lengths from fixed buffers: replays with other
    rows (fewer real segments, the rest padding) give the eager call's output."""
    _fa4()
    from fluxlab.engine.layers.attention_fa4 import Fa4Attention

    for replayed, eager in graph_replays_and_eager(Fa4Attention):
        # the same kernel on another batch shape: equal up to a bf16 rounding step
        torch.testing.assert_close(replayed, eager, rtol=0, atol=2e-2)


@pytest.mark.gpu
def test_fa4_gives_the_same_tokens_as_flashinfer_on_a_batch():
    """The trained embedded model (confident predictions) in bf16, decode graphs on: FA4 and
    FlashInfer disagree only by rounding, which moves no argmax of a trained model here."""
    _fa4()
    pytest.importorskip("flashinfer")
    import json

    from fluxlab import LLM
    from fluxlab.config.paths import ASSETS_DIR

    prompts = [json.loads(line)["messages"] for line in (ASSETS_DIR / "arith_test.jsonl").read_text().splitlines()[:8]]
    outputs = {}
    for backend in ("flashinfer", "fa4"):
        llm = LLM(overrides=["engine.device=cuda", "engine.dtype=bfloat16", f"attention={backend}",
                             "attention.use_decode_cuda_graph=true", "scheduler.max_num_seqs=8"])
        outputs[backend] = [r.token_ids for r in llm.generate(prompts)]
        assert llm.engine.runner.num_graph_forwards > 0
        llm.shutdown()
    assert outputs["fa4"] == outputs["flashinfer"]
