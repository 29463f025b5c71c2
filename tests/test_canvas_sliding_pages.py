"""Diffusion-Gemma's sliding layers keep a ring of ceil(window / L) + 1 pages per request
(fluxlab/models/diffusion_gemma/pages.py): tokens still equal transformers' generate, no request ever holds
more, every page of both pools comes back (also under preemption and a failed step), and the
pools are sized per layer type."""
from __future__ import annotations

import math

import pytest
import torch
from test_canvas_engine import L, cases, check, engine_llm, prompt_ids

import fluxlab.models.diffusion_gemma.runner as canvas_runner
from fluxlab.models.diffusion_gemma.paged_attention import CanvasKVCache
from fluxlab.models.diffusion_gemma.pages import sliding_ring_size
from fluxlab.models.diffusion_gemma.runner import kv_shapes


@pytest.fixture(scope="module")
def hf(one_thread):
    from transformers import DiffusionGemmaForBlockDiffusion

    from fluxlab.models.diffusion_gemma.engine import canvas_model_dir

    path = canvas_model_dir(engine_llm().engine.cfg.model)
    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=torch.float32).eval()


def watch_rings(llm) -> list[int]:
    """Before every forward: each running request holds <= ring_size sliding pages, the pool's
    count of held pages is theirs, and both pools' accounting holds. Returns the longest request
    (in blocks) seen holding a ring."""
    engine, runner = llm.engine, llm.engine.runner
    manager = engine.block_manager
    longest = []
    run = runner.run

    def checked(batch):
        running = list(engine.scheduler.running)
        held = [len(r.sliding_pages) for r in running]
        assert max(held, default=0) <= manager.ring_size
        assert sum(held) == manager.num_sliding_pages - manager.num_free_sliding_pages
        for r in running:
            assert len(r.sliding_pages) == min(manager.ring_size, len(r.page_table))
        engine.check_pages()
        longest.append(max((r.num_blocks for r in running), default=0))
        return run(batch)

    runner.run = checked
    return longest


def test_no_request_holds_more_than_its_window(hf):
    """Requests several windows long (window 8 = one canvas: ring of 2 pages) in batches of 1..4."""
    llm = engine_llm()
    manager = llm.engine.block_manager
    assert manager.ring_size == sliding_ring_size(llm.engine.model.sliding_window, L) == 2
    longest = watch_rings(llm)
    try:
        check(llm, hf, cases(llm.engine.model_config.vocab_size, max_new=(20, 13)))
    finally:
        del llm.engine.runner.run
    assert max(longest) > 2 * manager.ring_size  # the bound was tested on requests past the window
    assert manager.num_free_sliding_pages == manager.num_sliding_pages


def test_rings_come_back_under_preemption(hf):
    llm = engine_llm("scheduler.num_device_pages=6")
    manager = llm.engine.block_manager
    watch_rings(llm)
    try:
        results = check(llm, hf, cases(llm.engine.model_config.vocab_size, max_new=(20, 13)))
    finally:
        del llm.engine.runner.run
    assert sum(r.stats.preemptions for r in results) > 0
    assert manager.num_free_sliding_pages == manager.num_sliding_pages


def test_chunked_prefill_reuses_ring_slots_and_a_failed_step_puts_them_back(hf, monkeypatch):
    """A long prompt prefilled in 2-canvas chunks beside a decoding request (dynamic policy, 3 canvases
    a forward; ring of 2): a chunk overwrites the
    ring slot of the block its first queries read (read first, then written). One such step fails
    after its forward; the slots it clobbered are restored, so the retried rows' tokens still equal
    transformers'."""
    llm = engine_llm("scheduler=dynamic", "scheduler.max_num_seqs=2", "scheduler.max_scheduled_tokens=24")
    runner = llm.engine.runner
    real_step, real_save, failed, saves = canvas_runner.canvas_step, runner.cache.save_sliding, [], []

    def recording_save(slots):
        saves.append(slots.numel())
        return real_save(slots)

    def failing_once(logits, current, states, knobs, **kwargs):
        result = real_step(logits, current, states, knobs, **kwargs)
        if runner._sliding_backup is not None and not failed:
            failed.append(True)
            raise RuntimeError("injected")
        return result

    monkeypatch.setattr(runner.cache, "save_sliding", recording_save)
    monkeypatch.setattr(canvas_runner, "canvas_step", failing_once)
    vocab = llm.engine.model_config.vocab_size
    check(llm, hf, [(prompt_ids(5, 3, vocab), 3, 20), (prompt_ids(61, 4, vocab), 4, 9)])
    assert saves and failed


def test_pools_are_sized_per_layer_type():
    engine = engine_llm().engine
    manager, cache = engine.block_manager, engine.runner.cache
    assert manager.num_sliding_pages == engine.cfg.scheduler.max_num_seqs * manager.ring_size
    for sliding, k, v in zip(engine.model.layer_is_sliding, cache.k, cache.v):
        pages = manager.num_sliding_pages if sliding else manager.num_pages
        assert k.shape[0] == v.shape[0] == (pages + 1) * L  # + the commit graph's scratch page


def test_documented_memory_of_an_8k_request_at_26b_a4b():
    """docs/diffusion_gemma.md: 1.72 GiB before (every layer a page per canvas), 0.40 GiB after."""
    from fluxlab.models.diffusion_gemma import presets as presets

    config = presets.preset_text_config("diffusion_gemma_26b_a4b")
    shapes, sliding = kv_shapes(config), [t == "sliding_attention" for t in config.layer_types]
    canvas, pages = 256, 8192 // 256
    full = CanvasKVCache.bytes_per_page(shapes, sliding, False, canvas, torch.bfloat16)
    ring = sliding_ring_size(config.sliding_window, canvas) * CanvasKVCache.bytes_per_page(
        shapes, sliding, True, canvas, torch.bfloat16)
    assert (full, ring) == (5 * 2**20, 5 * 50 * 2**20)
    assert math.isclose(pages * (full + ring // 5) / 2**30, 1.71875)
    assert math.isclose((pages * full + ring) / 2**30, 0.400390625)


def test_prefix_cache_is_refused_for_diffusion_gemma():
    from fluxlab.llm import LLM

    with pytest.raises(Exception, match="scheduler.enable_prefix_cache=true"):
        LLM(overrides=["model=tiny_diffusion_gemma", "engine.device=cpu", "scheduler.enable_prefix_cache=true"])
