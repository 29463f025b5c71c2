"""Shared pieces of the attention backend tests: random paged rows, a backend's tokens beside sdpa's
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
