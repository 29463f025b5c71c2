"""A step that fails for one row is retried row by row (LLMEngine._run_rows_alone); every other row's
random draws are rewound first, so a seeded request beside a failing one gives its solo tokens, for
every decoder (issue 35, item 3). The failure is injected after the step's draws: the failed batch
drew from every sampling row's generator before it raised."""
from __future__ import annotations

import functools

import pytest

from fluxlab.engine.request import SamplingParams
from fluxlab.llm import LLM
from test_engine import prompts

pytestmark = pytest.mark.usefixtures("one_thread")

LLADA22 = ["model=tiny_llada22", "engine.dtype=float32", "engine.device=cpu", "decoding.block_length=16",
           "model.max_model_len=256", "scheduler.max_num_seqs=4", "scheduler.max_scheduled_tokens=128"]
CANVAS = ["model=tiny_diffusion_gemma", "engine.dtype=float32", "engine.device=cpu", "scheduler.max_num_seqs=4",
          "scheduler.max_scheduled_tokens=64"]


@functools.lru_cache(maxsize=None)
def engine_llm(*overrides: str) -> LLM:
    return LLM(overrides=list(overrides))


def run_beside_a_failing_row(llm: LLM, batch: list[list[int]], params: list[SamplingParams], victim_index: int,
                             monkeypatch) -> dict:
    """Run `batch` together; the request at `victim_index` makes every step that holds it raise once
    that step has drawn (from its second forward in a block on). {index: finished output}."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(batch, params)]
    victim = engine.requests[ids[victim_index]]
    runner, failed = engine.runner, []
    original = runner.run

    def run_then_fail(scheduled, *args, **kwargs):
        out = original(scheduled, *args, **kwargs)
        if victim in scheduled.requests and victim.forwards_in_block >= 1:
            failed.append(len(scheduled.requests))
            raise RuntimeError("injected failure after the draws")
        return out

    monkeypatch.setattr(runner, "run", run_then_fail)
    monkeypatch.setattr(engine, "async_scheduling", False)  # every step through runner.run
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    monkeypatch.undo()
    assert max(failed) > 1, "the failure never hit a batch with other rows"
    assert done[ids[victim_index]].finish_reason == "error"
    assert engine.kv_free_pages == engine.kv_total_pages
    return {i: done[rid] for i, rid in enumerate(ids)}


@pytest.mark.parametrize("decoder", ["threshold", "hierarchy", "joint_threshold", "levenshtein_joint"])
def test_seeded_rows_beside_a_failing_row_equal_their_solo_runs(decoder, monkeypatch):
    llm = engine_llm(*LLADA22)
    # levenshtein_joint is greedy only: its rows must still equal their solo runs
    temperature = 0.0 if decoder == "levenshtein_joint" else 0.8
    seeded = SamplingParams(max_new_tokens=40, ignore_eos=True, decoder=decoder, temperature=temperature, seed=123)
    other = SamplingParams(max_new_tokens=40, ignore_eos=True, decoder=decoder, temperature=temperature, seed=7)
    batch = prompts(llm, [9, 20, 31], seed=13)
    params = [seeded, other, other]
    together = run_beside_a_failing_row(llm, batch, params, victim_index=1, monkeypatch=monkeypatch)
    for i in (0, 2):
        [alone] = llm.generate([batch[i]], params[i])
        assert together[i].token_ids == alone.token_ids, (decoder, i)
        assert together[i].stats.forwards == alone.stats.forwards, (decoder, i)
        assert together[i].finish_reason == alone.finish_reason == "length"


def test_seeded_canvas_rows_beside_a_failing_row_equal_their_solo_runs(monkeypatch):
    llm = engine_llm(*CANVAS)
    vocab = llm.engine.model_config.vocab_size
    batch = [[(7 * i + 3 * n) % vocab for i in range(n)] for n in (5, 9, 13)]
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, seed=s) for s in (123, 5, 6)]
    together = run_beside_a_failing_row(llm, batch, params, victim_index=1, monkeypatch=monkeypatch)
    for i in (0, 2):
        [alone] = llm.generate([batch[i]], params[i])
        assert together[i].token_ids == alone.token_ids, i
        # (the tiny checkpoint's canvases often settle on the same argmax whatever the draws: a canvas
        # state left one step ahead shows in its forwards)
        assert together[i].stats.forwards == alone.stats.forwards, i
