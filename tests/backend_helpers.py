"""Shared pieces of the attention backend tests: random paged rows, one attention layer's fused and unfused
K/V writes, a backend's tokens beside sdpa's
through the engine (tiny model, CPU, fp32), and a page-table backend's graph replay beside its eager call."""
from __future__ import annotations

import random


def random_rows(num_rows: int, num_pages: int, rng: random.Random, max_blocks: int = 3):
    """(first_block, num_blocks, page_table) rows on distinct pages: decode (1 block), commit +
    decode (2), prefill chunks (max_blocks), after 0-3 cached blocks."""
    pages = list(range(num_pages))
    rng.shuffle(pages)
    rows = []
    for _ in range(num_rows):
        first = rng.randrange(0, 4)
        n = rng.choice([1, 1, 2, max_blocks])
        rows.append((first, n, [pages.pop() for _ in range(first + n)]))
    return rows


def fused_and_unfused_writes(device, dtype, seed: int = 0, make_cache=None):
    """[(output, K pool, V pool)] of one LLaDA2 attention layer over random paged rows with the fused
    QK-norm + RoPE: first writing K/V straight to the triton backend's slot rows (PagedBackend.kv_rows +
    attend), then through the same backend hidden behind a plain `forward` (k, v out, then the
    backend's index_put write). use_fused is forced on, so this runs on CPU under the interpreter too.
    make_cache(num_kv_heads, head_dim, num_pages, page_size) builds the pages (default: a model-dtype
    KVCache); the pools come back as bytes, so FP8 pages compare bit for bit too."""
    from unittest import mock

    import torch

    from fluxlab.engine.layers.attention import KVCache, build_metadata
    from fluxlab.engine.layers.attention_triton import TritonAttention
    from fluxlab.engine.layers.rotary import PartialRotary
    from fluxlab.engine.layers.segments import Segments
    from fluxlab.models.llada2 import model as llada2_moe
    from fluxlab.models.llada2.model import LLaDA2MoeAttention, LLaDA2MoeConfig

    class Forward:  # the backend without kv_rows/attend: the model takes the qk_norm_rope + forward path
        def __init__(self, backend):
            self.backend = backend

        def forward(self, *args):
            return self.backend.forward(*args)

    bl, num_pages = 16, 24
    c = LLaDA2MoeConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    gen = torch.Generator().manual_seed(seed)
    layer = LLaDA2MoeAttention(c, 0, dtype, device)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_((1 + 0.1 * torch.randn(prm.shape, generator=gen)) if prm.dim() == 1
                      else torch.randn(prm.shape, generator=gen) * prm.shape[-1] ** -0.5)
    rows = random_rows(5, num_pages, random.Random(seed), max_blocks=3)
    segments = Segments.of_rows(rows)
    n = sum(r[1] for r in rows) * bl
    x = torch.randn(n, c.hidden_size, generator=gen).to(device, dtype)
    rope = PartialRotary(c.head_dim, c.rotary_dim, c.rope_theta, 4096).to(device)
    cos, sin = rope.cos_sin(torch.from_numpy(segments.slot_mapping(bl) % 4096).to(device), dtype)
    results = []
    for wrap in (False, True):
        cache = (make_cache(c.num_key_value_heads, c.head_dim, num_pages, bl) if make_cache
                 else KVCache(1, num_pages, bl, c.num_key_value_heads, c.head_dim, dtype, device))
        backend = TritonAttention(cache, device, num_qo_heads=c.num_attention_heads, head_dim=c.head_dim,
                                  max_blocks_per_seq=8)
        backend.begin(build_metadata(segments, bl, device, dense=False))
        with mock.patch.object(llada2_moe, "use_fused", lambda t: True):
            out = layer(x, (cos[:, None, :], sin[:, None, :]), Forward(backend) if wrap else backend)
        results.append((out, cache.k.view(torch.uint8).clone(), cache.v.view(torch.uint8).clone()))
    return results


def sdpa_and_backend_tokens(ckpt, backend: str, max_model_len: int, max_new_tokens: int):
    """(sdpa tokens, `backend` tokens, the backend's runner) of four prompts of 20-107 tokens:
    prefill chunks, decode and commit + decode rows in batches of one to four."""
    from fluxlab.engine.request import SamplingParams
    from fluxlab.llm import LLM

    llm = LLM(overrides=[f"model.path={ckpt}", "model=tiny_llada2", "engine.device=cpu", "engine.dtype=float32",
                         "decoding.block_length=32", f"model.max_model_len={max_model_len}",
                         "scheduler.max_num_seqs=4", "scheduler.enable_prefix_cache=false"])
    text = "Janet has 16 eggs and sells the rest at the market for two dollars each. " * 8
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    prompts = [ids[:20 + 29 * i] for i in range(4)]
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    want = [r.token_ids for r in llm.generate(prompts, params)]
    llm.engine.runner = runner = llm.engine.make_runner(backend)
    return want, [r.token_ids for r in llm.generate(prompts, params)], runner


def graph_replays_and_eager(backend_cls, segs: int = 8, bl: int = 32):
    """[(replayed, eager)] outputs of a page-table backend (FA4, triton; bf16 on the GPU) captured once
    for `segs` segments, then replayed with two batches of new rows: fewer real segments, the rest
    scratch padding on page 63, as the graph runner replays them."""
    import torch

    from fluxlab.engine.layers.attention import AttentionMetadata, KVCache, build_metadata
    from fluxlab.engine.layers.segments import Segments

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    caches = [KVCache(1, 64, bl, 4, 128, torch.bfloat16, device) for _ in range(2)]
    caches[0].k.normal_(generator=gen)
    caches[0].v.normal_(generator=gen)
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    q, k, v = (torch.randn(segs * bl, h, 128, dtype=torch.bfloat16, device=device, generator=gen) for h in (16, 4, 4))
    eager = backend_cls(caches[0], device, num_qo_heads=16, head_dim=128, max_blocks_per_seq=8)
    graphed = backend_cls(caches[1], device, num_qo_heads=16, head_dim=128, max_blocks_per_seq=8,
                          graph_segments=segs)
    scratch = torch.arange(63 * bl, 64 * bl, device=device).repeat(segs)
    slots = scratch.clone()
    graphed.meta = AttentionMetadata(slots, None)
    graphed.plan(Segments.scratch(segs, 63))
    graphed.copy_plan_in()
    graphed.forward(0, q, k, v)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.copy_plan_in()  # as the graph runner captures it: the plan from mapped host memory
        out = graphed.forward(0, q, k, v)
    rows = random_rows(4, 60, random.Random(7), max_blocks=2)  # <= 6 segments in 3 rows: padding left
    pairs = []
    for trial in range(2):
        trial_rows = rows[:2 + trial]
        n = sum(r[1] for r in trial_rows)
        meta = build_metadata(Segments.of_rows(trial_rows), bl, device, dense=False)
        eager.begin(meta)
        want = eager.forward(0, q[:n * bl], k[:n * bl], v[:n * bl])
        slots[:n * bl].copy_(meta.slot_mapping)
        slots[n * bl:].copy_(scratch[n * bl:])
        graphed.plan(Segments.of_rows(trial_rows).padded(segs - n, 63))
        graph.replay()
        torch.cuda.synchronize()
        pairs.append((out[:n * bl].clone(), want))
    return pairs
