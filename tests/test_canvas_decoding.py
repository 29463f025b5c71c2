"""The canvas decoder's pieces against transformers' own classes (CPU): temperature schedule bits,
entropy-bound acceptance, and the stable-and-confident stop (the tiny checkpoint's random weights
never repeat an argmax canvas, so the engine tests cannot reach the stability rule)."""
from __future__ import annotations

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler, EntropyBoundSamplerConfig, LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria)

from fluxlab.models.diffusion_gemma.decoding import CanvasKnobs, CanvasState, canvas_step

L, V = 6, 50


def knobs(**kw) -> CanvasKnobs:
    base = dict(max_denoising_steps=48, entropy_bound=0.7, t_min=0.4, t_max=0.8, stability_threshold=1,
                confidence_threshold=0.005)
    return CanvasKnobs(**(base | kw))


@pytest.mark.parametrize("t_min,t_max,steps", [(0.4, 0.8, 48), (0.4, 1.0, 8), (0.1, 0.7, 7), (0.33, 0.97, 13)])
def test_temperature_is_bit_exact(t_min, t_max, steps):
    scores = torch.randn(1, L, V, generator=torch.Generator().manual_seed(steps))
    ref = LinearTemperatureScheduleLogitsProcessor(t_min, t_max, steps)
    k = knobs(t_min=t_min, t_max=t_max, max_denoising_steps=steps)
    for done in range(steps):
        want = ref(None, scores, cur_step=torch.tensor(steps - done, dtype=torch.int32))
        ours = scores / torch.tensor([k.temperature(done)], dtype=torch.float32)[:, None, None]
        assert torch.equal(want, ours), done


def test_acceptance_and_renoise_match_the_sampler():
    g = torch.Generator().manual_seed(3)
    for bound in (0.3, 1.0, 4.0):
        logits = torch.randn(1, L, V, generator=g) * 3
        current = torch.randint(0, V, (1, L), generator=g)
        state = CanvasState(seed=11, device=torch.device("cpu"))
        # N = 2: the first step's temperature is t_max = 1 (logits unchanged) and the canvas is not final
        k = knobs(entropy_bound=bound, t_min=0.0, t_max=1.0, max_denoising_steps=2, stability_threshold=0,
                  confidence_threshold=1e-9)
        ours = canvas_step(logits, current, [state], [k])
        sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(bound), L, V, 2)
        torch.manual_seed(11)  # the request's generator and the global one start alike
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        denoised = torch.multinomial(probs.view(-1, V), 1).view(1, L)
        accepted = sampler.accept_canvas(current, denoised, logits, 2)
        renoised = sampler.renoise_canvas(accepted, 2)
        assert torch.equal(ours.processed, logits) and not bool(ours.final[0])
        assert int(ours.accepted[0]) == int(sampler.accepted_token_mask.sum()) >= 1
        assert torch.equal(ours.block, renoised)
        assert torch.equal(state.generator.get_state(), torch.get_rng_state())  # same draws, same order


@pytest.mark.parametrize("stability", [0, 1, 2, 3])
def test_stop_rule_matches_stable_and_confident(stability):
    """A logits sequence whose argmax canvas repeats in runs of 1..4 steps; confidence always met,
    so stopping is the stability rule alone."""
    g = torch.Generator().manual_seed(stability)
    pattern = [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4]
    distinct = [torch.randn(1, L, V, generator=g) * 2 for _ in range(5)]
    criteria = StableAndConfidentStoppingCriteria(stability, confidence_threshold=100.0)
    k = knobs(stability_threshold=stability, confidence_threshold=100.0, t_min=0.0, t_max=1.0,
              max_denoising_steps=len(pattern) + 1)
    state = CanvasState(seed=0, device=torch.device("cpu"))
    stops = []
    for i, which in enumerate(pattern):
        raw = distinct[which]
        temperature = torch.tensor([k.temperature(state.forwards)], dtype=torch.float32)
        processed = raw / temperature[:, None, None]
        want = bool(criteria(processed.argmax(-1), processed)[0])
        got = bool(canvas_step(raw, torch.zeros(1, L, dtype=torch.long), [state], [k]).final[0])
        assert got == want, (i, which)
        stops.append(got)
    assert any(stops) and (stability == 0 or not all(stops))
