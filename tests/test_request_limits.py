"""Bounded work per request (issue 35, items 1, 2 and 9): each knob that multiplies a request's work has
a ceiling (decoding.<knob>_limit, by default the run's own value), a request holds a seat at most
server.request_timeout_s, schema-valid extremes are served or refused but never fail a step, and
wrong-typed or negative inputs get messages naming the field."""
from __future__ import annotations

import asyncio
import functools

import httpx
import pytest

from fluxlab.config import ConfigError, compose, validate_config
from fluxlab.engine.decoding.knobs import INT32_MAX
from fluxlab.engine.request import InvalidRequest, SamplingParams
from fluxlab.llm import LLM
from test_engine import prompts

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model=tiny_llada2", "engine.dtype=float32", "engine.device=cpu", "decoding.block_length=16",
        "model.max_model_len=256", "scheduler.max_num_seqs=2", "scheduler.max_scheduled_tokens=64"]
# Requests that never finish a block on their own: every forward edits (editing_threshold 0 and a hot
# temperature), so only max_post_steps would end the block (the denial of service).
HEAVY = SamplingParams(max_new_tokens=64, decoder="joint_threshold", editing_threshold=0.0, temperature=3.0,
                       max_post_steps=10**9, ignore_eos=True, seed=1)


@functools.lru_cache(maxsize=None)
def engine_llm(*overrides: str) -> LLM:
    return LLM(overrides=TINY + list(overrides))


def run(engine, step_limit: int = 20000) -> dict:
    """Step until nothing is left; {request id: finished output}. A step limit fails, not hangs, a test."""
    done = {}
    for _ in range(step_limit):
        if not engine.has_unfinished():
            return done
        done.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError(f"requests still running after {step_limit} steps")


# ---------------------------------------------------------------- ceilings

def test_a_knob_above_its_ceiling_is_refused_naming_it_and_the_key():
    engine = engine_llm().engine
    assert engine.ceilings == {"max_post_steps": 16, "max_steps_per_block": 1000}  # the run's own defaults
    for name, value, ceiling in (("max_post_steps", 10**9, 16), ("max_post_steps", 17, 16),
                                 ("max_steps_per_block", 1001, 1000)):
        with pytest.raises(InvalidRequest) as err:
            engine.add_request([5, 6, 7], SamplingParams(**{name: value}))
        assert err.value.param == name
        assert str(err.value) == f"{name}={value} is above its ceiling {ceiling} (decoding.{name}_limit)"
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, max_post_steps=16, max_steps_per_block=1000))
    run(engine)
    assert not engine.has_unfinished()


def test_the_ceiling_key_raises_and_checks_its_value():
    llm = engine_llm("decoding.max_post_steps_limit=64")
    assert llm.engine.ceilings["max_post_steps"] == 64
    for overrides, message in (
            (["decoding.max_post_steps_limit=8"], "decoding.max_post_steps_limit=8 is below decoding.max_post_steps=16"),
            (["decoding.max_steps_per_block_limit=1"], "decoding.max_steps_per_block_limit=1 must be in [2, "),
            (["decoding.max_denoising_steps_limit=4"], "decoding.max_denoising_steps_limit=4: "),
            (["model=tiny_diffusion_gemma", "decoding=canvas", "decoding.max_post_steps_limit=32"],
             "decoding.max_post_steps_limit=32: ")):
        with pytest.raises(ConfigError) as err:
            validate_config(compose("generate", overrides), cuda_available=False)
        assert str(err.value).startswith(message), str(err.value)


def test_canvas_max_denoising_steps_ceiling_is_the_checkpoints_value():
    llm = LLM(overrides=["model=tiny_diffusion_gemma", "engine.dtype=float32", "engine.device=cpu",
                         "scheduler.max_num_seqs=2", "scheduler.max_scheduled_tokens=64"])
    engine = llm.engine
    own = engine.generation_defaults["max_denoising_steps"]  # the tiny checkpoint's generation_config.json: 8
    assert engine.ceilings == {"max_denoising_steps": own}
    with pytest.raises(InvalidRequest) as err:
        engine.add_request([5, 6, 7], SamplingParams(max_denoising_steps=own + 1))
    assert err.value.param == "max_denoising_steps" and f"ceiling {own} " in str(err.value)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, max_denoising_steps=own))
    assert len(run(engine)) == 1
    with pytest.raises(ValueError, match=f"decoding.max_denoising_steps_limit=4 is below the checkpoint's "
                                         f"max_denoising_steps \\(generation_config.json\\)={own}"):
        LLM(overrides=["model=tiny_diffusion_gemma", "engine.dtype=float32", "engine.device=cpu",
                       "decoding.max_denoising_steps_limit=4"])


# ---------------------------------------------------------------- the deadline

def test_requests_past_the_deadline_end_with_their_tokens_and_free_their_seats():
    """The issue's reproduction on two seats: two requests that would edit for ~10**9 forwards end at
    server.request_timeout_s with finish_reason length, and the request queued behind them runs."""
    timeout = 1.5
    llm = engine_llm(f"decoding.max_post_steps_limit={INT32_MAX}", f"server.request_timeout_s={timeout}")
    engine = llm.engine
    batch = prompts(llm, [9, 20, 12], seed=3)
    normal = SamplingParams(max_new_tokens=16, ignore_eos=True)
    heavy = [engine.add_request(p, HEAVY) for p in batch[:2]]
    queued = engine.add_request(batch[2], normal)
    done = run(engine)
    for request_id in heavy:
        out = done[request_id]
        assert out.finish_reason == "length" and out.stats.timed_out
        assert len(out.token_ids) < HEAVY.max_new_tokens  # it ended early: the tokens it had committed
        assert out.stats.finish_time - out.stats.admitted_time >= timeout
    assert done[queued].finish_reason == "length" and not done[queued].stats.timed_out
    assert done[queued].token_ids == llm.generate([batch[2]], normal)[0].token_ids
    assert engine.kv_free_pages == engine.kv_total_pages
    assert sorted(engine.scheduler.free_slots) == [0, 1]
    engine.check_pages()


def test_the_deadline_counts_from_the_first_seat_not_from_arrival():
    """Queue time is not seat time: an offline run that queues many requests cuts none of them short."""
    llm = engine_llm("server.request_timeout_s=30")
    engine = llm.engine
    request_id = engine.add_request(prompts(llm, [9])[0], SamplingParams(max_new_tokens=16, ignore_eos=True))
    request = engine.requests[request_id]
    request.stats.arrival_time -= 3600  # an hour in the queue
    out = run(engine)[request_id]
    assert out.finish_reason == "length" and not out.stats.timed_out and len(out.token_ids) == 16
    assert out.stats.admitted_time - out.stats.arrival_time >= 3600


def test_no_deadline_when_request_timeout_s_is_not_positive():
    llm = engine_llm("server.request_timeout_s=0")
    engine = llm.engine
    request_id = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    out = run(engine)[request_id]
    assert out.stats.admitted_time is None and not out.stats.timed_out
    assert engine.scheduler.end_overdue() == []


# ---------------------------------------------------------------- extreme values

def test_a_tiny_temperature_samples_the_argmax_instead_of_failing_the_step():
    """temperature=1e-300 made softmax NaN and failed its step; its limit is the argmax, drawn with
    probability 1. The seeded request beside it gives its solo tokens."""
    llm = engine_llm()
    batch = prompts(llm, [9, 20], seed=5)
    tiny = SamplingParams(max_new_tokens=32, temperature=1e-300, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=32, temperature=0.8, seed=123, ignore_eos=True)
    outs = llm.generate(batch, [tiny, seeded])
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[1].token_ids == llm.generate([batch[1]], seeded)[0].token_ids
    # argmax draws have confidence 1.0, so threshold accepts every mask of a block in its first forward
    assert outs[0].stats.forwards == outs[0].stats.blocks_committed == 3 and len(outs[0].token_ids) == 32


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-30])
def test_filtered_probs_stay_finite_for_every_positive_temperature(temperature):
    import torch

    from fluxlab.engine.decoding.sampling import filtered_probs

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 20
    for top_k, top_p in ((0, 1.0), (5, 0.9)):
        probs = filtered_probs(logits, temperature, top_k, top_p)
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 40).float())


# ---------------------------------------------------------------- the server's bodies

def post_all(app, bodies: list[dict]) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return [await http.post("/v1/completions", json=body) for body in bodies]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def fake_server():
    from server_helpers import fake_app

    app, async_engine = fake_app()
    async_engine.start()
    yield app
    async_engine.shutdown()


def test_bodies_above_a_ceiling_are_a_400_and_the_document_shows_it(fake_server):
    from server_helpers import MODEL

    base = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    cases = [("max_post_steps", 10**9, "is above its ceiling 16 (decoding.max_post_steps_limit)"),
             ("max_post_steps", 2**70, "is above its ceiling 16 (decoding.max_post_steps_limit)"),
             ("max_steps_per_block", 2**70, "is above its ceiling 1000 (decoding.max_steps_per_block_limit)"),
             ("top_k", 2**70, "top_k")]
    responses = post_all(fake_server, [{**base, name: value} for name, value, _ in cases])
    for (name, _, message), response in zip(cases, responses):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == name and message in error["message"], error
    [ok] = post_all(fake_server, [{**base, "max_post_steps": 16, "temperature": 1e-300}])
    assert ok.status_code == 200, ok.text

    async def document():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fake_server), base_url="http://test") as http:
            return (await http.get("/openapi.json")).json()

    schema = asyncio.run(document())["components"]["schemas"]["CompletionRequest"]["properties"]
    bounds = {name: next(s for s in schema[name]["anyOf"] if s.get("type") == "integer")["maximum"]
              for name in ("max_post_steps", "max_steps_per_block")}
    assert bounds == {"max_post_steps": 16, "max_steps_per_block": 1000}


@pytest.mark.parametrize("value,kind", [("yes", "a string"), (5, "a number"), ([1], "an array"), (True, "a boolean")])
def test_a_wrong_typed_stream_options_names_the_field(fake_server, value, kind):
    from server_helpers import MODEL

    [response] = post_all(fake_server, [{"model": MODEL, "prompt": "hi", "stream_options": value}])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stream_options"
    assert error["message"] == f'stream_options must be an object such as {{"include_usage": true}}, not {kind}'


@pytest.mark.parametrize("prompt", [[-1, 5], [[7, -3]]])
def test_negative_token_ids_say_they_must_be_non_negative(fake_server, prompt):
    from server_helpers import MODEL

    [response] = post_all(fake_server, [{"model": MODEL, "prompt": prompt}])
    assert response.status_code == 400
    error = response.json()["error"]
    bad = [t for t in (prompt[0] if isinstance(prompt[0], list) else prompt) if t < 0]
    assert error["param"] == "prompt" and error["message"] == f"prompt: token ids must be >= 0; got {bad}"


def test_the_engine_says_the_same_for_negative_token_ids():
    engine = engine_llm().engine
    with pytest.raises(InvalidRequest) as err:
        engine.add_request([5, -2, 7], SamplingParams(max_new_tokens=4))
    assert err.value.param == "prompt" and str(err.value) == "token ids must be >= 0; got [-2]"
    assert not engine.has_unfinished()
