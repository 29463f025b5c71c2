"""levenshtein_joint in the engine (tiny_llada22, fp32, CPU, temperature 0): token for token the
LLaDA2.2 reference in any batch, both policies, next to other decoders, across preemption and seat
rebuilds from the host mirror, with literal edit ids in prompts; no edit token in any response."""
from __future__ import annotations

import functools

import pytest

import fluxlab.engine.decoding.levenshtein_joint as lj
from fluxlab.models.llada2.reference import reference_generate
from fluxlab.engine.request import InvalidRequest, SamplingParams
from fluxlab.llm import LLM
from test_engine import prompts

pytestmark = pytest.mark.usefixtures("one_thread")

BL = 16
SEATS = 4
BASE = ["engine.dtype=float32", "engine.device=cpu", "decoding=levenshtein_joint", f"decoding.block_length={BL}",
        "model.max_model_len=256", f"scheduler.max_num_seqs={SEATS}", "scheduler.max_scheduled_tokens=128"]
LEV = SamplingParams(max_new_tokens=40, ignore_eos=True)  # long enough for the anti-loop to fire


@functools.lru_cache(maxsize=None)
def llada22(*overrides: str) -> LLM:
    return LLM(model="tiny_llada22", overrides=BASE + list(overrides))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return llada22("scheduler=dynamic")


@pytest.fixture
def escapes(monkeypatch) -> list[int]:
    """Anti-loop moves the engine's decode steps made (a wrapper around the device step)."""
    seen = []
    original = lj.levenshtein_step

    def counting(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(int(out.escaped.sum()))
        return out

    monkeypatch.setattr(lj, "levenshtein_step", counting)
    return seen


_references: dict = {}


def _reference(llm: LLM, prompt: tuple[int, ...], params: SamplingParams, stop_ids: tuple[int, ...]):
    """The reference generate (cached: the tests share prompts, and it recomputes every block)."""
    key = (id(llm), prompt, repr(params), stop_ids)
    if key not in _references:
        _references[key] = _run_reference(llm, prompt, params, stop_ids)
    return _references[key]


def _run_reference(llm: LLM, prompt: tuple[int, ...], params: SamplingParams, stop_ids: tuple[int, ...]):
    engine = llm.engine
    p = params.resolve(engine.cfg.decoding, engine.cfg.model.max_new_tokens)
    special = engine.special
    return reference_generate(engine.model, list(prompt), mask_id=engine.mask_id, eos_id=engine.eos_id,
                              stop_ids=stop_ids, decoder=p.decoder, block_length=BL, steps=p.steps,
                              max_new_tokens=p.max_new_tokens, threshold=p.threshold,
                              editing_threshold=p.editing_threshold, max_post_steps=p.max_post_steps,
                              max_steps_per_block=p.max_steps_per_block, temperature=p.temperature, top_p=p.top_p,
                              top_k=p.top_k, seed=p.seed, ignore_eos=p.ignore_eos, delete_id=special.delete_id,
                              split_id=special.split_id)


def reference_ids(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """The reference's output, without the edit tokens a non-levenshtein decoder may accept (the
    engine never emits them)."""
    out = _reference(llm, tuple(prompt), params, llm.engine.eos_ids)
    hidden = set(llm.engine.hidden_ids)
    return [t for t in out.token_ids if t not in hidden]


def check(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list:
    engine = llm.engine
    results = llm.generate(batch, params)
    hidden = set(engine.hidden_ids)
    for prompt, p, got in zip(batch, params, results):
        if p.temperature:  # sampled rows: the batch-invariance test checks them
            continue
        assert got.token_ids == reference_ids(llm, prompt, p), (len(prompt), p)
        if (p.decoder or engine.cfg.decoding.decoder) == "levenshtein_joint":
            want = _reference(llm, tuple(prompt), p, engine.eos_ids)
            assert got.finish_reason == want.finish_reason and got.stats.forwards == want.forwards
        assert not hidden & set(got.token_ids) and engine.mask_id not in got.token_ids
        assert "<|delete|>" not in got.text and "<|split|>" not in got.text
    assert engine.kv_free_pages == engine.kv_total_pages
    assert not engine.has_unfinished()
    assert sorted(engine.scheduler.free_slots) == list(range(SEATS))
    return results


@pytest.mark.parametrize("policy", ["paged", "dynamic"])
@pytest.mark.parametrize("size", [1, 2, SEATS])
def test_batches_match_the_reference(policy, size, escapes):
    llm = llada22(f"scheduler={policy}")
    check(llm, prompts(llm, [5, 16, 23, 40][:size], seed=1), [LEV] * size)
    if size == SEATS:
        assert sum(escapes) > 0  # the anti-loop fired, so its history is exercised


@pytest.mark.parametrize("policy", ["paged", "dynamic"])
def test_mixed_decoders_in_one_batch(policy):
    """levenshtein rows next to threshold and joint_threshold rows (which may accept an edit token
    on an LLaDA2.2 model: it never reaches their response either)."""
    llm = llada22(f"scheduler={policy}")
    batch = prompts(llm, [7, 18, 26, 11], seed=2)
    params = [LEV, SamplingParams(max_new_tokens=40, decoder="threshold", threshold=0.9, ignore_eos=True),
              SamplingParams(max_new_tokens=32), SamplingParams(max_new_tokens=40, decoder="joint_threshold",
                                                                threshold=0.5, editing_threshold=0.0,
                                                                ignore_eos=True)]
    check(llm, batch, params)
    hidden = set(llm.engine.hidden_ids)
    raw = [_reference(llm, tuple(batch[i]), params[i], llm.engine.eos_ids).token_ids for i in (1, 3)]
    assert any(hidden & set(ids) for ids in raw)  # the reference did write some: the engine dropped them


def test_sampled_rows_beside_levenshtein_rows_are_batch_invariant(llm):
    """Sampled rows and levenshtein rows share the full-logit rows of a forward."""
    batch = prompts(llm, [10, 22, 15], seed=4)
    sampled = SamplingParams(max_new_tokens=30, decoder="threshold", temperature=2.0, top_k=50, seed=5,
                             ignore_eos=True)
    alone = llm.generate([batch[0]], sampled)[0]
    together = check(llm, batch, [sampled, LEV, LEV])[0]
    assert together.token_ids == alone.token_ids


def test_preemption_under_a_tiny_page_budget(escapes):
    llm = llada22("scheduler=dynamic", "scheduler.num_device_pages=7")
    results = check(llm, prompts(llm, [5, 16, 23, 40], seed=1), [LEV] * 4)
    assert sum(r.stats.preemptions for r in results) > 0
    assert sum(escapes) > 0


def test_every_seat_rebuilt_from_the_host_mirror_changes_no_token(llm, monkeypatch, escapes):
    """What the engine's failure retry does (invalidate_step_state), before every step: counters,
    original-mask column and written-block history all come back from the host exactly."""
    runner = llm.engine.runner
    original = runner.finish
    rebuilt = []

    def finish_on_rebuilt_seats(batch, *args, **kwargs):  # (the decode step reads the seats' device state)
        runner.invalidate_step_state()
        rebuilt.extend(bool(r.request.decoder_log) for r in batch.decode_rows)
        return original(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "finish", finish_on_rebuilt_seats)
    check(llm, prompts(llm, [5, 16, 23, 40], seed=1), [LEV] * 4)
    assert any(rebuilt) and sum(escapes) > 0


def test_a_failing_levenshtein_row_fails_alone(llm, monkeypatch):
    engine = llm.engine
    runner = engine.runner
    batch = prompts(llm, [9, 20, 31], seed=13)
    ids = [engine.add_request(p, LEV) for p in batch]
    victim = engine.requests[ids[1]]
    original = runner._decode

    def failing_decode(inputs, *args, **kwargs):
        if victim in inputs.requests and victim.forwards_in_block == 3:
            raise RuntimeError("injected step failure")
        return original(inputs, *args, **kwargs)

    monkeypatch.setattr(runner, "_decode", failing_decode)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[ids[1]].finish_reason == "error"
    for i in (0, 2):
        assert done[ids[i]].token_ids == reference_ids(llm, batch[i], LEV)
    assert engine.kv_free_pages == engine.kv_total_pages


def test_literal_edit_ids_in_the_prompt_stay_put(llm):
    engine = llm.engine
    special = engine.special
    edit_ids = [special.delete_id, special.split_id, engine.mask_id]
    prompt = prompts(llm, [21], seed=6)[0]
    prompt[3:6] = edit_ids  # in a prefilled block
    prompt[-3:] = edit_ids  # in the decoded tail block
    other = prompts(llm, [9], seed=7)[0] + [special.split_id, special.delete_id]
    ids = [engine.add_request(p, LEV) for p in (prompt, other)]
    requests = [engine.requests[i] for i in ids]
    results = {}
    while engine.has_unfinished():
        results.update({o.request_id: o for o in engine.step() if o.finished})
    for p, request in zip((prompt, other), requests):
        assert request.tokens[:len(p)].tolist() == p
        assert results[request.request_id].token_ids == reference_ids(llm, p, LEV)
        generated = request.tokens[len(p):request.active_block * BL].tolist()
        assert not set(edit_ids) & set(generated)  # every committed block is clean, exactly BL tokens
    assert engine.kv_free_pages == engine.kv_total_pages


def test_a_request_stops_on_either_stop_id(llm, monkeypatch):
    """The checkpoint's stop ids: tiny_llada22's model favours the first, so a second id is taken
    from what it writes before it; the engine and the reference stop on whichever comes first."""
    engine = llm.engine
    batch = prompts(llm, [5, 16, 23, 40], seed=1)
    full = [_reference(llm, tuple(p), LEV, engine.eos_ids).token_ids for p in batch]
    first = engine.eos_ids[0]
    second = next(t for ids in full for t in ids[:ids.index(first) if first in ids else len(ids)][3:]
                  if t not in engine.eos_ids)
    monkeypatch.setattr(engine, "eos_ids", (first, second))
    stopping = SamplingParams(max_new_tokens=40)
    results = llm.generate(batch, stopping)
    hits = set()
    for prompt, got in zip(batch, results):
        want = _reference(llm, tuple(prompt), stopping, (first, second))
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.stats.forwards == want.forwards
        if got.finish_reason == "stop":
            hits.add(full[batch.index(prompt)][len(got.token_ids)])
    assert hits == {first, second}
    assert engine.kv_free_pages == engine.kv_total_pages


def test_levenshtein_is_refused_where_it_cannot_run(llm):
    from fluxlab.config import ConfigError, compose, validate_config
    from test_engine import engine_llm

    with pytest.raises(InvalidRequest) as err:
        llm.engine.add_request([1, 2, 3], SamplingParams(temperature=0.5))
    assert err.value.param == "temperature" and "levenshtein_joint" in str(err.value)
    with pytest.raises(InvalidRequest) as err:
        llm.engine.add_request([1, 2, 3], SamplingParams(max_steps_per_block=1))
    assert err.value.param == "max_steps_per_block"
    with pytest.raises(ConfigError, match=r"decoding.temperature=0.5 must be 0 for decoding.decoder=levenshtein_joint"):
        validate_config(compose("generate", ["decoding=levenshtein_joint", "decoding.temperature=0.5"]),
                        cuda_available=False)
    plain = engine_llm()  # tiny LLaDA2.0: no DELETE/SPLIT ids
    with pytest.raises(InvalidRequest) as err:
        plain.engine.add_request([1, 2, 3], SamplingParams(decoder="levenshtein_joint"))
    assert err.value.param == "decoder" and "delete_id and split_id" in str(err.value)
    with pytest.raises(ValueError, match="decoding.decoder=levenshtein_joint needs the model's delete_id"):
        LLM(overrides=["model=tiny_llada2", "engine.dtype=float32", "engine.device=cpu",
                       "decoding=levenshtein_joint"])
    assert not llm.engine.has_unfinished()


def test_decoding_group_and_sweep_compose():
    from omegaconf import OmegaConf

    from fluxlab.config import PROJECT_ROOT, compose

    dec = compose("generate", ["decoding=levenshtein_joint"]).decoding
    assert (dec.decoder, dec.block_length, dec.threshold, dec.editing_threshold, dec.max_post_steps,
            dec.max_steps_per_block, dec.temperature) == ("levenshtein_joint", 32, 0.5, 0.0, 16, 1000, 0.0)
    cfg = compose("bench", ["sweep=levenshtein"])
    assert cfg.decoding.decoder == "levenshtein_joint" and cfg.model.name == "llada22_mini"
    sweep = OmegaConf.load(PROJECT_ROOT / "sweeps" / "levenshtein.yaml")
    assert sweep.hydra.mode == "MULTIRUN"
    assert set(sweep.hydra.sweeper.params) == {"decoding.threshold", "decoding.editing_threshold",
                                               "decoding.max_post_steps"}


def test_the_server_body_takes_max_steps_per_block():
    from pydantic import ValidationError

    from fluxlab.server.protocol import CompletionRequest

    body = CompletionRequest(prompt="hi", decoder="levenshtein_joint", max_steps_per_block=5)
    assert body.sampling_params(8).max_steps_per_block == 5
    with pytest.raises(ValidationError, match="max_steps_per_block"):
        CompletionRequest(prompt="hi", max_steps_per_block=1)
