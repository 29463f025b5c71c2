"""The engine gives token-for-token what the reference generate gives (fp32, temperature 0), in any
batch, under every policy and layout, and every page comes back."""
from __future__ import annotations

import functools
import random

import pytest

from fluxlab.models.llada2.reference import reference_generate
from fluxlab.engine.request import InvalidRequest, SamplingParams
from fluxlab.llm import LLM

BL = 16  # small blocks: short generations still cross several blocks
BASE = ["model=tiny_llada2", "engine.dtype=float32", "engine.device=cpu", f"decoding.block_length={BL}", "model.max_model_len=512",
        "scheduler.max_num_seqs=6", "scheduler.max_scheduled_tokens=256"]


@functools.lru_cache(maxsize=None)
def engine_llm(*overrides: str) -> LLM:
    return LLM(overrides=BASE + list(overrides))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return engine_llm()


def prompts(llm: LLM, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompt ids of the given lengths cut from real tokenized text (so the model sees real tokens)."""
    rng = random.Random(seed)
    text = ("Janet has 16 eggs. She eats three for breakfast and bakes muffins with four. How many eggs are "
            "left to sell at two dollars each? Let us think step by step about the ducks and the market. ") * 8
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    out = []
    for n in lengths:
        start = rng.randrange(0, len(ids) - n)
        out.append(ids[start:start + n])
    return out


def reference(llm: LLM, prompt: list[int], params: SamplingParams):
    engine = llm.engine
    p = params.resolve(engine.cfg.decoding, engine.cfg.model.max_new_tokens)
    return reference_generate(engine.model, prompt, mask_id=engine.mask_id, eos_id=engine.eos_id,
                              decoder=p.decoder, block_length=BL, steps=p.steps, max_new_tokens=p.max_new_tokens,
                              threshold=p.threshold, editing_threshold=p.editing_threshold,
                              max_post_steps=p.max_post_steps, ignore_eos=p.ignore_eos)


def check_parity(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list:
    results = llm.generate(batch, params)
    for prompt, p, got in zip(batch, params, results):
        want = reference(llm, prompt, p)
        assert got.token_ids == want.token_ids, (len(prompt), p)
        assert got.finish_reason == want.finish_reason
        assert got.stats.forwards == want.forwards
        assert got.stats.tokens_edited == want.edits  # token -> token edits, counted as the reference does
    assert llm.engine.kv_free_pages == llm.engine.kv_total_pages
    assert not llm.engine.has_unfinished()
    return results


@pytest.mark.parametrize("length", [5, BL, BL + 7, 2 * BL, 3 * BL + 1])
def test_single_prompt_matches_reference(llm, length):
    check_parity(llm, prompts(llm, [length]), [SamplingParams(max_new_tokens=40)])


def test_multi_token_acceptance_happens(llm):
    [result] = check_parity(llm, prompts(llm, [9]), [SamplingParams(max_new_tokens=48, ignore_eos=True)])
    assert len(result.token_ids) == 48
    assert result.stats.forwards < 48  # several tokens per forward at threshold 0.9


@pytest.mark.parametrize("policy", [["scheduler=paged"], ["scheduler=dynamic"],
                                    ["scheduler=static", "engine.kv_cache_layout=dense", "scheduler.enable_prefix_cache=false"],
                                    ["scheduler=static"]])
def test_mixed_batch_matches_reference_under_each_policy_and_layout(policy):
    llm = engine_llm(*policy)
    batch = prompts(llm, [3, 16, 21, 40, 7, 33], seed=1)
    params = [SamplingParams(max_new_tokens=n) for n in (20, 33, 16, 45, 8, 30)]
    check_parity(llm, batch, params)


@pytest.mark.parametrize("batch_size", [1, 2, 4, 6])
def test_batches_up_to_max_num_seqs(llm, batch_size):
    batch = prompts(llm, [4 + 9 * i for i in range(batch_size)], seed=batch_size)
    check_parity(llm, batch, [SamplingParams(max_new_tokens=24, ignore_eos=True)] * batch_size)


def test_more_requests_than_seats_queue_in_order(llm):
    batch = prompts(llm, [6, 12, 18, 24, 30, 36, 10, 20, 5], seed=7)
    check_parity(llm, batch, [SamplingParams(max_new_tokens=20)] * len(batch))


@pytest.mark.parametrize("policy", ["paged", "dynamic"])
def test_requests_arriving_while_others_run(policy):
    llm = engine_llm(f"scheduler={policy}")
    engine = llm.engine
    batch = prompts(llm, [8, 19, 30, 12], seed=3)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ids = [engine.add_request(batch[0], params)]
    done = {}
    steps = 0
    while engine.has_unfinished() or len(ids) < len(batch):
        steps += 1
        if steps in (2, 5, 9) and len(ids) < len(batch):
            ids.append(engine.add_request(batch[len(ids)], params))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for prompt, rid in zip(batch, ids):
        assert done[rid].token_ids == reference(llm, prompt, params).token_ids
    assert engine.kv_free_pages == engine.kv_total_pages


@pytest.mark.parametrize("steps,threshold", [(BL, 0.9), (4, 0.9), (8, 0.7), (2, 1.0), (5, 0.5)])
def test_threshold_steps_and_values(llm, steps, threshold):
    batch = prompts(llm, [11, 26], seed=steps)
    check_parity(llm, batch, [SamplingParams(max_new_tokens=36, steps=steps, threshold=threshold)] * 2)


def test_steps_are_capped_by_max_new_tokens(llm):
    check_parity(llm, prompts(llm, [10]), [SamplingParams(max_new_tokens=3, steps=BL, threshold=1.0)])


@pytest.mark.parametrize("threshold,editing", [(0.7, 0.5), (0.5, 0.0)], ids=["quality", "speed"])
def test_joint_threshold_presets(llm, threshold, editing):
    batch = prompts(llm, [7, 20, 35], seed=11)
    params = SamplingParams(max_new_tokens=40, decoder="joint_threshold", threshold=threshold,
                            editing_threshold=editing, max_post_steps=4)
    check_parity(llm, batch, [params] * 3)


def test_hierarchy_matches_reference(llm):
    batch = prompts(llm, [7, 20, 35], seed=12)
    check_parity(llm, batch, [SamplingParams(max_new_tokens=40, decoder="hierarchy", threshold=0.9,
                                             low_threshold=0.3)] * 3)


def test_per_row_parameters_each_match_their_own_reference(llm):
    batch = prompts(llm, [14, 14], seed=5)
    params = [SamplingParams(max_new_tokens=40, threshold=0.5, ignore_eos=True),
              SamplingParams(max_new_tokens=40, threshold=1.0, steps=BL, ignore_eos=True)]
    low, high = check_parity(llm, batch, params)
    assert low.stats.forwards < high.stats.forwards


def test_preemption_under_a_tiny_page_budget():
    llm = engine_llm("scheduler.num_device_pages=8", "scheduler=dynamic")
    batch = prompts(llm, [20, 30, 25, 12], seed=9)
    params = [SamplingParams(max_new_tokens=60, ignore_eos=True)] * 4
    results = check_parity(llm, batch, params)
    assert sum(r.stats.preemptions for r in results) > 0


def test_abort_frees_every_page(llm):
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=60)) for p in prompts(llm, [30, 40, 10])]
    engine.step()
    engine.step()
    assert engine.kv_free_pages < engine.kv_total_pages
    for rid in ids:
        engine.abort_request(rid)
    assert engine.kv_free_pages == engine.kv_total_pages
    outs = engine.step()
    assert sorted(o.finish_reason for o in outs) == ["abort"] * 3
    assert not engine.has_unfinished()


@pytest.mark.parametrize("decoder", ["threshold", "joint_threshold"])
def test_literal_mask_token_in_prompt_is_prompt_text(llm, decoder):
    """A mask id inside the prompt (a prefilled block and the decoded tail block) is prompt text:
    never decoded over, and the output equals the reference's."""
    engine = llm.engine
    prompt = prompts(llm, [12])[0]
    prompt[5] = prompt[-1] = engine.mask_id
    prompt = prompt + [engine.mask_id]
    [result] = check_parity(llm, [prompt], [SamplingParams(max_new_tokens=20, decoder=decoder, ignore_eos=True)])
    assert len(result.token_ids) == 20 and engine.mask_id not in result.token_ids


def test_bad_requests_are_refused_and_engine_keeps_working(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequest) as err:
        engine.add_request([], SamplingParams())
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequest) as err:
        engine.add_request([1] * 500, SamplingParams(max_new_tokens=100))
    assert "max_model_len=512" in str(err.value)
    with pytest.raises(InvalidRequest):
        engine.add_request([10**9], SamplingParams())
    with pytest.raises(InvalidRequest) as err:
        engine.add_request([1, 2], SamplingParams(threshold=1.5))
    assert err.value.param == "threshold"
    check_parity(llm, prompts(llm, [9]), [SamplingParams(max_new_tokens=16)])


def test_stop_strings_cut_the_output(llm):
    [full] = llm.generate(prompts(llm, [10], seed=2), SamplingParams(max_new_tokens=48, ignore_eos=True))
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    assert stop.strip()
    [cut] = llm.generate(prompts(llm, [10], seed=2), SamplingParams(max_new_tokens=48, ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)
    assert len(cut.token_ids) <= len(full.token_ids)


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm):
    batch = prompts(llm, [10, 22], seed=4)
    sampled = SamplingParams(max_new_tokens=30, temperature=3.0, top_k=50, top_p=0.95, seed=123, ignore_eos=True)
    alone = llm.generate([batch[0]], sampled)[0]
    together = llm.generate(batch, [sampled, SamplingParams(max_new_tokens=30)])[0]
    assert alone.token_ids == together.token_ids
    other_seed = llm.generate([batch[0]], SamplingParams(max_new_tokens=30, temperature=3.0, top_k=50, top_p=0.95, seed=7, ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids


@pytest.mark.parametrize("policy", ["paged", "dynamic", "static"])
def test_scheduler_honours_seats_budget_and_fifo_admission(policy):
    llm = engine_llm(f"scheduler={policy}", "scheduler.max_num_seqs=3", "scheduler.max_scheduled_tokens=64")
    engine = llm.engine
    scheduler = engine.scheduler
    admitted, batches = [], []
    original = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        before = set(id(r) for r in scheduler.running)
        batch = original(*args, **kwargs)
        admitted.extend(r.request_id for r in scheduler.running if id(r) not in before)
        batches.append((batch.num_tokens, len(scheduler.running)))
        return batch

    scheduler.schedule = recording_schedule
    try:
        batch = prompts(llm, [5, 40, 12, 30, 8, 20, 3], seed=21)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=24, ignore_eos=True)) for p in batch]
        finished = []
        while engine.has_unfinished():
            finished += [o.request_id for o in engine.step() if o.finished]
    finally:
        scheduler.schedule = original
    assert sorted(finished) == sorted(ids)  # nobody starves
    assert admitted == ids  # first come, first admitted
    assert all(tokens <= 64 and running <= 3 for tokens, running in batches)
    assert engine.kv_free_pages == engine.kv_total_pages
