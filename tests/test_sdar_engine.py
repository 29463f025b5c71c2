"""The engine on SDAR against the *published* routines (JetAstra/SDAR generate.py and huggingface_bd3.py, run on the
published modeling code: tests/sdar_oracle.py), token for token at fp32 on CPU: each request alone, a mixed batch
of prompt lengths, knobs and decoders, under preemption, with the prefix cache on and off; dense (tiny_sdar, tied)
and MoE (tiny_sdar_moe, untied). Seeded sampling: each request's generator draws what the published routine draws
from torch.manual_seed(seed), whatever batch it runs in.

generate.py writes a proposal wherever its top-k lands, prompt tail and decided tokens included, when fewer masks
than k[s] remain; fluxlab keeps huggingface_bd3.py's guard (a transfer fills masks only: low_confidence.py). The
generate.py cases are the ones where the two rules agree: steps == block_length (k = 1), or sequential.
"""
from __future__ import annotations

import functools

import pytest
import torch

import sdar_oracle
from fluxlab.engine.loading import resolve_model_dir
from fluxlab.engine.request import SamplingParams
from fluxlab.llm import LLM

pytestmark = pytest.mark.usefixtures("one_thread")

PRESETS = ["tiny_sdar", "tiny_sdar_moe"]
MAX_NEW = 24
PROMPTS = [[17, 250, 300, 12, 7], [901, 44, 2, 2, 310, 77, 120, 9], [5], [33, 60, 1000, 1500, 21, 8, 8, 90, 400, 3, 77]]
# (decoder, block, steps, threshold, temperature, top_k, top_p)
CASES = [
    ("low_confidence_dynamic", 4, 4, 0.85, 1.0, 0, 1.0),  # SDAR's generate.py defaults
    ("low_confidence_dynamic", 4, 4, 0.3, 0.7, 50, 1.0),
    ("low_confidence_static", 4, 4, 0.85, 1.3, 0, 0.9),
    ("sequential", 4, 2, 0.85, 0.8, 0, 1.0),
    ("bd3", 4, 4, 0.9, 1.0, 0, 1.0),
    ("bd3", 4, 2, 1.0, 0.6, 20, 0.95),  # threshold 1.0: the static rule
    ("low_confidence_dynamic", 8, 8, 0.5, 0.9, 0, 0.95),
    ("sequential", 8, 4, 0.85, 1.0, 0, 0.9),
    ("bd3", 8, 4, 0.5, 0.8, 20, 0.95),
]


@functools.lru_cache(maxsize=None)
def engine(preset: str, block: int, *overrides: str) -> LLM:
    return LLM(overrides=[f"model={preset}", "engine.dtype=float32", "engine.device=cpu", "model.max_model_len=256",
                          f"decoding.block_length={block}", "scheduler.max_num_seqs=6",
                          "scheduler.max_scheduled_tokens=64", *overrides])


@functools.lru_cache(maxsize=None)
def published_model(preset: str):
    return sdar_oracle.load_model(resolve_model_dir(engine(preset, 4).engine.cfg.model))


def params(case, seed: int, max_new: int = MAX_NEW) -> SamplingParams:
    decoder, _, steps, threshold, temperature, top_k, top_p = case
    return SamplingParams(max_new_tokens=max_new, decoder=decoder, steps=steps, threshold=threshold,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def published(preset: str, prompt: list[int], case, seed: int, max_new: int = MAX_NEW) -> list[int]:
    """The published routine's output: what follows the prompt, up to max_new, cut before the first stop id."""
    decoder, block, steps, threshold, temperature, top_k, top_p = case
    llm, routines = engine(preset, 4), sdar_oracle.load()
    stops = list(llm.engine.eos_ids)
    model = published_model(preset)  # before the seed: building the MoE stand-in draws initial weights
    torch.manual_seed(seed)
    if decoder == "bd3":
        x = routines.bd3.block_diffusion_generate(
            model, None, {"input_ids": torch.tensor([prompt]), "attention_mask": None},
            mask_id=llm.engine.mask_id, gen_length=max_new, block_length=block, denoising_steps=steps,
            temperature=temperature, top_k=top_k, top_p=top_p, threshold=threshold, stopping_criteria_idx=stops)
    else:
        x = routines.generate.block_diffusion_generate(
            model, {"input_ids": torch.tensor([prompt])}, mask_id=llm.engine.mask_id,
            gen_length=max_new, block_length=block, denoising_steps=steps, temperature=temperature, top_k=top_k,
            top_p=top_p, remasking_strategy=decoder, confidence_threshold=threshold, stopping_criteria_idx=stops)
    out = x[0].tolist()[len(prompt):len(prompt) + max_new]
    cut = [out.index(s) for s in stops if s in out]
    return out[:min(cut)] if cut else out


def check(llm: LLM, preset: str, runs: list[tuple[list[int], tuple, int]]) -> list:
    results = llm.generate([p for p, _, _ in runs], [params(c, s) for _, c, s in runs])
    for (prompt, case, seed), got in zip(runs, results):
        assert got.token_ids == published(preset, prompt, case, seed), (prompt, case, seed)
    assert llm.engine.kv_free_pages == llm.engine.kv_total_pages
    return results


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-b{c[1]}s{c[2]}-t{c[4]}")
def test_each_request_alone_equals_the_published_routine(preset, case):
    llm = engine(preset, case[1])
    for seed, prompt in enumerate(PROMPTS):
        check(llm, preset, [(prompt, case, seed)])


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_mixed_batch_equals_each_request_alone(preset, block, prefix_cache):
    """Every case of this block length over every prompt (and a repeated prompt, served from the prefix cache
    when it is on), one batch: different lengths, knobs, decoders and seeds."""
    llm = engine(preset, block, f"scheduler.enable_prefix_cache={str(prefix_cache).lower()}")
    cases = [c for c in CASES if c[1] == block]
    runs = [(prompt, case, 10 * i + j) for i, case in enumerate(cases) for j, prompt in enumerate(PROMPTS)]
    runs.append((PROMPTS[3], cases[0], 99))
    check(llm, preset, runs)
    [again] = check(llm, preset, [(PROMPTS[3], cases[-1], 5)])
    assert (again.stats.cached_tokens > 0) == prefix_cache  # its full prompt blocks were committed above


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_changes_no_token(preset, prefix_cache):
    llm = engine(preset, 4, "scheduler=dynamic", "scheduler.num_device_pages=12",
                 f"scheduler.enable_prefix_cache={str(prefix_cache).lower()}")
    runs = [(prompt, case, 7 * i) for i, (prompt, case) in enumerate(zip(PROMPTS * 2, CASES[:6] + CASES[:2]))]
    results = check(llm, preset, runs)
    assert sum(r.stats.preemptions for r in results) > 0


def test_temperature_zero_runs_greedy_on_every_sdar_decoder():
    """Not in the published routines (they divide by the temperature): fluxlab's greedy limit, the same tokens
    for every decoder whose rule at k = 1 with threshold 1.0 is 'the most confident mask'."""
    llm = engine("tiny_sdar", 4)
    outs = [llm.generate([PROMPTS[0]], [SamplingParams(max_new_tokens=16, decoder=d, steps=4, threshold=1.0,
                                                       temperature=0.0)])[0].token_ids
            for d in ("low_confidence_dynamic", "low_confidence_static", "bd3", "threshold")]
    assert outs[0] and all(o == outs[0] for o in outs)
