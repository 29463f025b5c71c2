"""Async scheduling (scheduler.async_scheduling): the runner launches the next forward of the same
rows as soon as a step's results show that no block finished, before postprocess. Tokens, counters
and pages must be exactly those of the synchronous loop, whatever arrives or leaves meanwhile."""
from __future__ import annotations

import pytest

from fluxlab.config import ConfigError, compose, validate_config
from fluxlab.engine.request import SamplingParams
from test_engine import check_parity, engine_llm, prompts, reference


def drive(engine, on_step) -> dict:
    """Step the engine until it has nothing left, calling on_step(engine, step number) before each
    step; the finished outputs by request id."""
    done, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        on_step(engine, steps)
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


@pytest.mark.parametrize("policy", ["paged", "dynamic"])
def test_the_async_loop_launches_ahead_and_gives_the_sync_loop_tokens(policy):
    sync, eager = engine_llm(f"scheduler={policy}", "scheduler.async_scheduling=false"), engine_llm(f"scheduler={policy}")
    assert eager.engine.async_scheduling and not sync.engine.async_scheduling
    batch = prompts(eager, [7, 21, 33, 12], seed=5)
    # threshold 1.0: a block takes exactly its `steps` forwards, so rows step through blocks together
    params = [SamplingParams(max_new_tokens=48, threshold=1.0), SamplingParams(max_new_tokens=40, threshold=1.0),
              SamplingParams(max_new_tokens=33, temperature=0.8, seed=3, threshold=1.0),
              SamplingParams(max_new_tokens=48, threshold=1.0, steps=8)]
    before = eager.engine.total_launched_ahead
    got = eager.generate(batch, params)
    want = sync.generate(batch, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.stats.forwards for r in got] == [r.stats.forwards for r in want]
    assert [r.stats.tokens_accepted for r in got] == [r.stats.tokens_accepted for r in want]
    launched = eager.engine.total_launched_ahead - before
    assert launched > 0 and sync.engine.total_launched_ahead == 0
    assert eager.engine.kv_free_pages == eager.engine.kv_total_pages
    # the greedy rows are also the reference's
    for prompt, p, r in zip(batch, params, got):
        if p.temperature == 0:
            assert r.token_ids == reference(eager, prompt, p).token_ids


def test_a_forward_launched_ahead_is_dropped_when_its_rows_change_and_nothing_leaks():
    llm = engine_llm("scheduler=paged")
    engine = llm.engine
    batch = prompts(llm, [9, 26, 14], seed=11)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    dropped_before = engine.total_dropped_ahead
    ids = [engine.add_request(p, params) for p in batch]
    aborted = []

    def abort_while_in_flight(engine, steps):
        if not aborted and steps > 4 and engine.forward_in_flight:
            aborted.append(ids[1])
            engine.abort_request(ids[1])

    done = drive(engine, abort_while_in_flight)
    assert aborted and done[aborted[0]].finish_reason == "abort"
    assert engine.total_dropped_ahead == dropped_before + 1
    for i in (0, 2):
        assert done[ids[i]].token_ids == reference(llm, batch[i], params).token_ids
    assert engine.kv_free_pages == engine.kv_total_pages and not engine.forward_in_flight


def test_a_request_arriving_while_a_forward_is_in_flight_joins_a_step_later_and_wastes_none():
    """dynamic admits at any step, but not into rows already running: the arrival waits one step."""
    llm = engine_llm("scheduler=dynamic")
    engine = llm.engine
    batch = prompts(llm, [8, 19, 30], seed=3)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    dropped_before = engine.total_dropped_ahead
    ids = [engine.add_request(batch[0], params)]

    def arrive_while_in_flight(engine, steps):
        if engine.forward_in_flight and len(ids) < len(batch):
            ids.append(engine.add_request(batch[len(ids)], params))

    done = drive(engine, arrive_while_in_flight)
    assert len(ids) == len(batch) and engine.total_dropped_ahead == dropped_before
    for prompt, rid in zip(batch, ids):
        assert done[rid].token_ids == reference(llm, prompt, params).token_ids
    assert engine.kv_free_pages == engine.kv_total_pages


def test_the_host_time_of_a_step_launched_ahead_ends_at_that_launch():
    """A step whose forward the last step launched, and which launches the next: the GPU waited only
    from its results to that launch (postprocess ran while the next forward did)."""
    llm = engine_llm("scheduler=paged")
    engine, runner = llm.engine, llm.engine.runner
    engine.add_request(prompts(llm, [10], seed=2)[0], SamplingParams(max_new_tokens=48, threshold=1.0, ignore_eos=True))
    both, in_flight = 0, False
    while engine.has_unfinished():
        engine.step()
        if in_flight and engine.forward_in_flight:
            both += 1
            assert engine.last_step_host_seconds == pytest.approx(runner.launched_at - runner.results_at, abs=1e-12)
            assert 0 < engine.last_step_host_seconds
        in_flight = engine.forward_in_flight
    assert both > 10


def test_async_scheduling_is_refused_where_it_cannot_run():
    cfg = compose("generate", ["parallel.tp_size=2", "parallel.ep_size=2", "scheduler.async_scheduling=true"])
    with pytest.raises(ConfigError, match="scheduler.async_scheduling=true"):
        validate_config(cfg, cuda_available=False)
    cfg = compose("generate", ["model=tiny_diffusion_gemma", "scheduler.async_scheduling=true"])
    with pytest.raises(ConfigError, match="scheduler.async_scheduling=true"):
        validate_config(cfg, cuda_available=False)
    for overrides, want in ((["parallel.tp_size=2", "parallel.ep_size=2"], False), (["model=tiny_diffusion_gemma"], False),
                            ([], True), (["scheduler.async_scheduling=false"], False)):
        cfg = compose("generate", overrides)
        validate_config(cfg, cuda_available=False)
        assert cfg.scheduler.async_scheduling is want, overrides


def test_the_sync_loop_still_matches_the_reference():
    llm = engine_llm("scheduler=dynamic", "scheduler.async_scheduling=false")
    check_parity(llm, prompts(llm, [5, 17, 40, 9], seed=7), [SamplingParams(max_new_tokens=40)] * 4)
