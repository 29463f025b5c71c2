"""Diffusion-Gemma canvas decoding is token-identical to transformers' own generate() (CPU, fp32):
for each request with seed s, what `torch.manual_seed(s); model.generate(ids, max_new_tokens=N)`
gives for that request alone, whatever batch, policy or page budget the engine runs it in; every
page comes back."""
from __future__ import annotations

import functools

import pytest
import torch

from fluxlab.models.diffusion_gemma.checkpoint import CANVAS_LENGTH as L
from fluxlab.models.diffusion_gemma.decoding import CanvasKnobs, read_generation_defaults
from fluxlab.models.diffusion_gemma.reference import generate_canvases
from fluxlab.engine.request import InvalidRequest, SamplingParams
from fluxlab.llm import LLM

BASE = ["model=tiny_diffusion_gemma", "engine.dtype=float32", "engine.device=cpu", "scheduler.max_num_seqs=4",
        "scheduler.max_scheduled_tokens=64"]
# shorter than, equal to and longer than a canvas (and than the sliding window, 8)
PROMPT_LENGTHS = [1, 3, 7, 8, 9, 13, 16, 21]


@functools.lru_cache(maxsize=None)
def engine_llm(*overrides: str) -> LLM:
    return LLM(overrides=BASE + list(overrides))


@pytest.fixture(scope="module")
def llm(one_thread) -> LLM:
    return engine_llm()


@pytest.fixture(scope="module")
def hf(llm):
    from transformers import DiffusionGemmaForBlockDiffusion

    from fluxlab.models.diffusion_gemma.engine import canvas_model_dir

    path = canvas_model_dir(llm.engine.cfg.model)
    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=torch.float32).eval()


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1000 * n + seed)).tolist()


_reference_cache: dict = {}


def transformers_generate(hf, prompt: list[int], seed: int, max_new_tokens: int, **kwargs):
    """(tokens as fluxlab returns them, finish_reason, decoder forwards) of transformers' generate
    for this request alone: cut at max_new_tokens and before the first EOS."""
    key = (tuple(prompt), seed, max_new_tokens, tuple(sorted(kwargs.items())))
    if key not in _reference_cache:
        forwards = 0
        forward = hf.forward

        def counted(*a, **k):
            nonlocal forwards
            forwards += 1
            return forward(*a, **k)

        hf.forward = counted
        try:
            hf_kwargs = dict(kwargs)
            if "entropy_bound" in hf_kwargs:  # transformers keeps it in the sampler's config
                from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

                hf_kwargs["sampler_config"] = EntropyBoundSamplerConfig(float(hf_kwargs.pop("entropy_bound")))
            torch.manual_seed(seed)
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, **hf_kwargs)
        finally:
            del hf.forward
        new = out.sequences[0, len(prompt):len(prompt) + max_new_tokens].tolist()
        eos = hf.generation_config.eos_token_id
        reason = "length"
        if eos in new:
            new, reason = new[:new.index(eos)], "stop"
        _reference_cache[key] = (new, reason, forwards)
    return _reference_cache[key]


def check(llm: LLM, hf, cases: list[tuple[list[int], int, int]], **knobs) -> list:
    params = [SamplingParams(max_new_tokens=n, seed=s, **knobs) for _, s, n in cases]
    results = llm.generate([p for p, _, _ in cases], params)
    for (prompt, seed, n), got in zip(cases, results):
        want, reason, forwards = transformers_generate(hf, prompt, seed, n, **knobs)
        assert got.token_ids == want, (len(prompt), seed, n)
        assert got.finish_reason == reason
        assert got.stats.forwards == forwards  # denoiser forwards: early stops are the same steps
    assert llm.engine.kv_free_pages == llm.engine.kv_total_pages
    llm.engine.check_pages()
    assert not llm.engine.has_unfinished()
    return results


def cases(vocab: int, seeds=(0, 1), max_new=(5, 8, 20)) -> list[tuple[list[int], int, int]]:
    out = []
    for i, n in enumerate(PROMPT_LENGTHS):
        seed = seeds[i % len(seeds)]
        out.append((prompt_ids(n, seed, vocab), seed, max_new[i % len(max_new)]))
    return out


def test_model_level_generate_equals_transformers(llm, hf):
    """The decoder alone (dense K/V, one request): the engine's canvas step is transformers' algorithm."""
    engine = llm.engine
    knobs = CanvasKnobs(**read_generation_defaults(None) | engine.generation_defaults)
    vocab = engine.model_config.vocab_size
    for prompt, seed, n in cases(vocab)[:4]:
        got, forwards = generate_canvases(engine.model, prompt, n, knobs, L, seed, engine.eos_ids, engine.eos_ids[0])
        want, _, want_forwards = transformers_generate(hf, prompt, seed, n)
        cut = got[:n]
        if engine.eos_ids[0] in cut:
            cut = cut[:cut.index(engine.eos_ids[0])]
        assert cut == want and forwards == want_forwards


def test_engine_batch_equals_transformers_alone(llm, hf):
    """Eight prompts in one call with max_num_seqs=4: batches of 1..4 rows, canvases and prefill
    chunks mixed, every request its own seed."""
    results = check(llm, hf, cases(llm.engine.model_config.vocab_size))
    assert any(r.finish_reason == "length" for r in results)
    # the tiny checkpoint's sampler stops early on some canvases (fewer than its 8 steps each)
    assert any(r.stats.forwards < 8 * r.stats.blocks_committed for r in results)


def test_one_request_at_a_time(hf):
    llm = engine_llm("scheduler.max_num_seqs=1")
    check(llm, hf, cases(llm.engine.model_config.vocab_size)[:3])


def test_dynamic_policy(hf):
    llm = engine_llm("scheduler=dynamic")
    check(llm, hf, cases(llm.engine.model_config.vocab_size, seeds=(2, 3)))


def test_preemption_changes_no_token(hf):
    """A page budget of 6 canvases for 4 seats (the longest request needs all 6): requests are
    preempted and recomputed; their canvas state (generator, self-conditioning) stays on the request."""
    llm = engine_llm("scheduler.num_device_pages=6", "scheduler.enable_prefix_cache=false")
    results = check(llm, hf, cases(llm.engine.model_config.vocab_size, max_new=(20, 13)))
    assert sum(r.stats.preemptions for r in results) > 0


def test_same_prompt_across_seeds(llm, hf):
    """The same prompt under different seeds in one batch: each request's tokens stay its own
    seed's (Diffusion-Gemma runs without the prefix cache: its sliding ring overwrites K/V)."""
    vocab = llm.engine.model_config.vocab_size
    prompt = prompt_ids(17, 0, vocab)
    check(llm, hf, [(prompt, s, 8) for s in (4, 5, 6)])


def test_request_knobs_reach_the_sampler(llm, hf):
    """Per-request canvas knobs (as the HTTP body passes them) are transformers' generate kwargs."""
    vocab = llm.engine.model_config.vocab_size
    knobs = dict(max_denoising_steps=3, entropy_bound=2.0, t_min=0.3, t_max=0.9, stability_threshold=1,
                 confidence_threshold=0.8)
    check(llm, hf, [(prompt_ids(5, 7, vocab), 7, 12), (prompt_ids(11, 8, vocab), 8, 12)], **knobs)


def test_bad_canvas_knobs_are_refused(llm):
    with pytest.raises(InvalidRequest, match="t_max"):
        llm.engine.add_request([1, 2], SamplingParams(t_min=0.9, t_max=0.5))
    with pytest.raises(InvalidRequest, match="temperature"):
        llm.engine.add_request([1, 2], SamplingParams(temperature=0.7))
    with pytest.raises(InvalidRequest, match="decoder=threshold"):
        llm.engine.add_request([1, 2], SamplingParams(decoder="threshold"))
    with pytest.raises(InvalidRequest, match="entropy_bound"):
        llm.engine.add_request([1, 2], SamplingParams(entropy_bound=0.0))
    assert not llm.engine.has_unfinished()


def test_sliding_layers_never_read_past_their_window(hf):
    """Before every forward, every sliding-layer K/V slot the forward does not gather is set to NaN
    (one request at a time, no prefix cache: no other request needs them). A NaN that reached a
    softmax would wreck the tokens (dropping the window from the mask fails this test); they are
    unchanged, so a sliding layer's pages older than its window (8 < prompt + canvases) are dead."""
    llm = engine_llm("scheduler.max_num_seqs=1", "scheduler.enable_prefix_cache=false")
    runner = llm.engine.runner
    sliding = [i for i, s in enumerate(runner.model.layer_is_sliding) if s]
    begin = runner.attention.begin
    poisoned = []

    def poison_then_begin(meta):
        keep = torch.cat([meta.key_slots[True].flatten(), meta.write_slots])
        for i in sliding:
            for pool in (runner.cache.k[i], runner.cache.v[i]):
                saved = pool[keep].clone()
                pool.fill_(float("nan"))
                pool[keep] = saved
        poisoned.append(len(keep))
        begin(meta)

    runner.attention.begin = poison_then_begin
    try:
        vocab = llm.engine.model_config.vocab_size
        check(llm, hf, [(prompt_ids(21, 0, vocab), 0, 20), (prompt_ids(9, 1, vocab), 1, 20)])
    finally:
        runner.attention.begin = begin
    assert poisoned


def test_a_failed_step_is_retried_with_the_same_draws(hf, monkeypatch):
    """A step that raises after the sampler drew (here: the device->host copy of one batch) is
    retried row by row; each request's generator was rewound, so tokens still equal transformers'."""
    llm = engine_llm("scheduler.max_num_seqs=3")
    import fluxlab.models.diffusion_gemma.runner as canvas_runner

    real_step, failed = canvas_runner.canvas_step, []

    def failing_once(logits, current, states, knobs, **kwargs):
        result = real_step(logits, current, states, knobs, **kwargs)
        if len(states) > 1 and min(s.forwards for s in states) >= 3 and not failed:  # mid-canvas rows
            failed.append(len(states))
            raise RuntimeError("injected")
        return result

    monkeypatch.setattr(canvas_runner, "canvas_step", failing_once)
    check(llm, hf, cases(llm.engine.model_config.vocab_size)[:3])
    assert failed


def test_dense_layout_static_policy(hf):
    llm = engine_llm("scheduler=static", "engine.kv_cache_layout=dense", "scheduler.enable_prefix_cache=false")
    check(llm, hf, cases(llm.engine.model_config.vocab_size, seeds=(0, 1))[:5])


def test_llada2_models_refuse_canvas_knobs_per_request():
    from fluxlab.engine.llm_engine import LLMEngine  # noqa: F401  (the LLaDA2 engine)

    llada = LLM(overrides=["model=tiny_llada2", "engine.dtype=float32", "engine.device=cpu", "model.max_model_len=256"])
    for knobs, param in (({"entropy_bound": 0.5}, "entropy_bound"), ({"max_denoising_steps": 4}, "max_denoising_steps"),
                         ({"decoder": "canvas"}, "decoder")):
        with pytest.raises(InvalidRequest) as err:
            llada.engine.add_request([5, 6, 7], SamplingParams(**knobs))
        assert err.value.param == param
    assert not llada.engine.has_unfinished()


def test_a_final_canvas_equal_to_its_mirror_is_still_committed(llm, hf, monkeypatch):
    """A denoising pass writes no K/V, so a final canvas is committed by its own pass even when the
    host mirror of the block already holds exactly its tokens (a canvas stable through its last
    step): the mirror is forced to the final canvas before postprocess here."""
    engine = llm.engine
    run = engine.runner.run

    def mirror_the_final_canvas(batch):
        out = run(batch)
        if out is not None:
            seats, bl = engine.scheduler.seats, engine.block_length
            rows = batch.decodes.nonzero()[0]
            for i in out.final.nonzero()[0].tolist():
                seat = int(batch.slots[rows[i]])
                start = int(seats.active_block[seat]) * bl
                seats.tokens[seat, start:start + bl] = out.blocks[i]
        return out

    monkeypatch.setattr(engine.runner, "run", mirror_the_final_canvas)
    vocab = engine.model_config.vocab_size
    check(llm, hf, [(prompt_ids(n, 3, vocab), 3, 20) for n in (3, 9, 17)])
