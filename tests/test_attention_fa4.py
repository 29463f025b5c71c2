"""attention=fa4: its segment tables (CPU), and on a GPU (`-m gpu`, flash-attn-4 installed) the same
outputs as sdpa on paged decode and block-causal prefill rows, eager and under a CUDA graph, and the
same tokens as FlashInfer through the engine."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fluxlab.engine.layers.attention_fa4 import segment_tables
from fluxlab.engine.layers.attention_flashinfer import segments


def random_rows(num_rows: int, num_pages: int, rng: random.Random, max_blocks: int = 3):
    pages = list(range(num_pages))
    rng.shuffle(pages)
    rows = []
    for _ in range(num_rows):
        first = rng.randrange(0, 4)
        n = rng.choice([1, 1, 2, max_blocks])  # decode, commit + decode, a prefill chunk
        rows.append((first, n, [pages.pop() for _ in range(first + n)]))
    return rows


def test_segment_tables_hold_the_pages_flashinfer_plans():
    rows = random_rows(7, 64, random.Random(3), max_blocks=4)
    table, used = segment_tables(rows, width=8, fill_page=63)
    _, kv_indptr, kv_indices = segments(rows, 32)
    assert table.shape == (len(kv_indptr) - 1, 8) and table.dtype == np.int32
    for s in range(table.shape[0]):
        pages = kv_indices[kv_indptr[s]:kv_indptr[s + 1]]
        assert used[s] == len(pages) and table[s, :used[s]].tolist() == pages.tolist()
        assert (table[s, used[s]:] == 63).all()  # a real page past the segment's keys


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
    sdpa.begin(build_metadata(rows, bl, device))
    fa4.begin(build_metadata(rows, bl, device, dense=False))
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
    from fluxlab.engine.layers.attention import AttentionMetadata, build_metadata
    from fluxlab.engine.layers.attention_fa4 import Fa4Attention

    device, bl, segs = torch.device("cuda"), 32, 8
    rows = random_rows(4, 60, random.Random(7), max_blocks=2)  # <= 6 segments in 3 rows: padding left
    (eager_cache, graph_cache), (q, k, v) = _paged_case([(0, segs, [0] * segs)])
    eager = Fa4Attention(eager_cache, device, num_qo_heads=16, head_dim=128, max_blocks_per_seq=8)
    graphed = Fa4Attention(graph_cache, device, num_qo_heads=16, head_dim=128, max_blocks_per_seq=8,
                           graph_segments=segs)
    scratch = [(0, 1, [63])] * segs
    slots = torch.arange(63 * bl, 64 * bl, device=device).repeat(segs)
    graphed.meta = AttentionMetadata(slots, [])
    graphed.plan(scratch)
    graphed.forward(0, q, k, v)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = graphed.forward(0, q, k, v)
    for trial in range(2):
        trial_rows = rows[:2 + trial]
        n = sum(r[1] for r in trial_rows)
        meta = build_metadata(trial_rows, bl, device, dense=False)
        eager.begin(meta)
        want = eager.forward(0, q[:n * bl], k[:n * bl], v[:n * bl])
        slots[:n * bl].copy_(meta.slot_mapping)
        slots[n * bl:] = torch.arange(63 * bl, 64 * bl, device=device).repeat(segs - n)
        graphed.plan(trial_rows + scratch[:segs - n])
        graph.replay()
        # the same kernel on another batch shape: equal up to a bf16 rounding step
        torch.testing.assert_close(out[:n * bl], want, rtol=0, atol=2e-2)


@pytest.mark.gpu
def test_fa4_gives_the_same_tokens_as_flashinfer_on_a_batch():
    """The trained embedded model (confident predictions) in bf16, decode graphs on: FA4 and
    FlashInfer disagree only by rounding, which moves no argmax of a trained model here."""
    _fa4()
    pytest.importorskip("flashinfer")
    import json

    from fluxlab import LLM
    from fluxlab.config.compose import ASSETS_DIR

    prompts = [json.loads(line)["messages"] for line in (ASSETS_DIR / "arith_test.jsonl").read_text().splitlines()[:8]]
    outputs = {}
    for backend in ("flashinfer", "fa4"):
        llm = LLM(overrides=["engine.device=cuda", "engine.dtype=bfloat16", f"attention={backend}",
                             "attention.use_decode_cuda_graph=true", "scheduler.max_num_seqs=8"])
        outputs[backend] = [r.token_ids for r in llm.generate(prompts)]
        assert llm.engine.runner.num_graph_forwards > 0
        llm.shutdown()
    assert outputs["fa4"] == outputs["flashinfer"]
