"""Prefix cache: requests reuse cached blocks' K/V and still give the reference's tokens (fp32,
temperature 0) in any arrival order; pages stay accounted after every step; a block a request
holds is never evicted; unreferenced blocks are evicted before anyone is preempted."""
from __future__ import annotations

import random

import pytest

from fluxlab.engine.request import SamplingParams
from fluxlab.llm import LLM
from test_engine import BASE, BL, engine_llm, prompts, reference


def fresh(*overrides: str) -> LLM:
    """An engine with an empty cache and zero counters."""
    return LLM(overrides=BASE + list(overrides))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return engine_llm()


def run_checked(llm: LLM, arrivals: list[tuple[int, list[int], SamplingParams]]) -> list:
    """Add each (step, prompt, params) before that step, run to the end, check the page accounting
    after every step and every output against the reference; outputs in arrival order."""
    engine = llm.engine
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    ids: dict[int, str] = {}
    done = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]][0] <= step:
            i = pending.pop(0)
            ids[i] = engine.add_request(arrivals[i][1], arrivals[i][2])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_pages()
        step += 1
    outs = [done[ids[i]] for i in range(len(arrivals))]
    for (_, prompt, params), out in zip(arrivals, outs):
        want = reference(llm, prompt, params)
        assert out.token_ids == want.token_ids, (len(prompt), out.stats)
        assert out.finish_reason == want.finish_reason
    assert engine.kv_free_pages == engine.kv_total_pages
    return outs


def family(llm: LLM) -> dict[str, list[int]]:
    """Prompts that share 0, some or all of their full blocks with `base` (3 full blocks + 5)."""
    base = prompts(llm, [3 * BL + 5], seed=31)[0]
    other = prompts(llm, [40], seed=32)[0]
    return {"base": base, "two_blocks": base[:2 * BL] + other[:9], "same": list(base),
            "aligned": base[:3 * BL], "longer": base + other[:BL], "none": other}


@pytest.mark.parametrize("policy", ["paged", "dynamic", "static"])
def test_shared_blocks_are_reused_and_tokens_are_unchanged(policy):
    llm = fresh(f"scheduler={policy}")
    p = family(llm)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    [first] = run_checked(llm, [(0, p["base"], params)])
    assert first.stats.cached_tokens == 0
    names = ["two_blocks", "same", "aligned", "longer", "none"]
    outs = run_checked(llm, [(0, p[name], params) for name in names])
    cached = {name: out.stats.cached_tokens for name, out in zip(names, outs)}
    # `aligned` is all prompt blocks: the scheduler still runs its active block (the first output block).
    assert cached == {"two_blocks": 2 * BL, "same": 3 * BL, "aligned": 3 * BL, "longer": 3 * BL, "none": 0}
    engine = llm.engine
    assert engine.prefix_cache_hit_blocks == 11
    assert engine.prefix_cache_queried_blocks == 3 + 2 + 3 + 3 + 4 + 2
    assert engine.kv_cached_pages > 0 and 0 < engine.prefix_cache_hit_rate < 1


def test_any_arrival_order_gives_the_same_tokens(llm):
    p = family(llm)
    names = list(p)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 33, 17, 40, 25, 30)]
    rng = random.Random(5)
    results = []
    for trial in range(2):
        order = list(range(len(names)))
        rng.shuffle(order)
        outs = run_checked(llm, [(rng.randrange(0, 6), p[names[i]], params[i]) for i in order])
        results.append({names[i]: out.token_ids for i, out in zip(order, outs)})
    assert results[0] == results[1]


def test_identical_prompts_in_one_forward_end_up_sharing_pages():
    llm = fresh()
    prompt = prompts(llm, [3 * BL + 2], seed=41)[0]
    engine = llm.engine
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for _ in range(3)]
    engine.step()  # all three prefill the same 3 blocks in this forward
    engine.check_pages()
    tables = [r.page_table[:3] for r in engine.scheduler.running]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2]
    assert engine.kv_total_pages - engine.kv_free_pages == 3 + 3  # 3 shared pages + 3 active blocks
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.check_pages()
    want = reference(llm, prompt, params).token_ids
    assert [done[i].token_ids for i in ids] == [want] * 3
    [again] = run_checked(llm, [(0, prompt, params)])
    assert again.stats.cached_tokens == 3 * BL


def test_a_multi_turn_follow_up_reuses_its_history(llm):
    engine = llm.engine
    turn1 = prompts(llm, [20], seed=51)[0]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    [answer] = run_checked(llm, [(0, turn1, params)])
    history = turn1 + answer.token_ids  # 60 tokens: blocks 0-2 committed and written, block 3 was the last
    follow_up = history + prompts(llm, [11], seed=52)[0]
    [second] = run_checked(llm, [(0, follow_up, params)])
    assert second.stats.cached_tokens == 3 * BL
    # The follow-up's own committed output is cached in turn: a third turn reuses more.
    third = follow_up + second.token_ids + prompts(llm, [7], seed=53)[0]
    [out] = run_checked(llm, [(0, third, params)])
    assert out.stats.cached_tokens == BL * (-(-(len(follow_up) + 40) // BL) - 1)
    assert engine.kv_free_pages == engine.kv_total_pages


def test_a_held_block_is_never_evicted_and_eviction_comes_before_preemption():
    llm = fresh("scheduler.num_device_pages=12", "scheduler=dynamic")
    engine = llm.engine
    p = family(llm)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    run_checked(llm, [(0, p["base"], params)])  # 6 blocks; blocks 0-4 stay cached, unreferenced
    assert engine.kv_cached_pages == 5 and engine.kv_free_pages == 12
    # `same` (6 blocks) holds the three shared prompt blocks while an unrelated request (6 blocks)
    # needs pages: 7 are free, so base's two unshared cached blocks give way (LRU) rather than a
    # running request, and the three held ones never do (check_pages after every step).
    [unrelated] = prompts(llm, [4 * BL + 5], seed=61)
    outs = run_checked(llm, [(0, p["same"], params), (1, unrelated, SamplingParams(max_new_tokens=20, ignore_eos=True))])
    assert [o.stats.cached_tokens for o in outs] == [3 * BL, 0]
    assert engine.block_manager.num_evicted_pages >= 1
    assert sum(o.stats.preemptions for o in outs) == 0


def test_preemption_and_abort_with_shared_prefixes():
    llm = fresh("scheduler.num_device_pages=8", "scheduler=dynamic")
    engine = llm.engine
    p = family(llm)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    outs = run_checked(llm, [(0, p["base"], params), (0, p["two_blocks"], params), (1, p["same"], params),
                             (3, p["none"], params)])
    assert sum(o.stats.preemptions for o in outs) > 0
    # abort mid-run: the shared pages lose one holder each, nothing leaks
    ids = [engine.add_request(p[name], params) for name in ("same", "two_blocks")]
    for _ in range(3):
        engine.step()
        engine.check_pages()
    engine.abort_request(ids[0])
    engine.check_pages()
    while engine.has_unfinished():
        engine.step()
        engine.check_pages()
    assert engine.kv_free_pages == engine.kv_total_pages


def test_the_cache_off_switch_is_honoured():
    llm = engine_llm("scheduler.enable_prefix_cache=false")
    p = family(llm)
    params = SamplingParams(max_new_tokens=20)
    outs = run_checked(llm, [(0, p["base"], params), (4, p["same"], params)])
    engine = llm.engine
    assert [o.stats.cached_tokens for o in outs] == [0, 0]
    assert engine.kv_cached_pages == 0 and engine.prefix_cache_queried_blocks == 0
