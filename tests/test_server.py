"""The OpenAI-compatible server end to end: the official openai client against `fluxlab serve`
(tiny model, fp32, CPU) in a subprocess, over loopback."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading

import httpx
import openai
import pytest

from server_helpers import MODEL, TINY, ServerProcess, metric_value, wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(TINY, tmp_path_factory.mktemp("serve"))
    yield proc
    proc.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def fluxlab_usage(usage) -> dict:
    return usage.model_extra["fluxlab"]


# ------------------------------------------------------------------------------------ happy paths

def test_completion_usage_equals_the_tokens_returned(client):
    response = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=24,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == len(choice.model_extra["token_ids"]) == 24
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24
    assert response.usage.prompt_tokens > 0
    assert fluxlab_usage(response.usage)["forwards"] >= 2  # two blocks of 16, at least one forward each
    assert fluxlab_usage(response.usage)["tokens_edited"] == 0  # the threshold decoder never edits


def test_editing_decoders_report_their_edits_in_usage(client):
    response = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=40,
                                         extra_body={"ignore_eos": True, "decoder": "joint_threshold",
                                                     "threshold": 0.5, "editing_threshold": 0.0,
                                                     "max_post_steps": 4})
    usage = fluxlab_usage(response.usage)
    # the speed preset on the tiny random model rewrites committed tokens (the engine tests check
    # the count equals the reference's)
    assert usage["tokens_edited"] > 0 and usage["tokens_accepted"] >= 40


def test_streaming_completion_sends_a_chunk_per_block_then_usage_then_done(client, server):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=32,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    # Blocks of 16 are aligned to position 0: the first one holds the prompt's tail, so each chunk
    # carries the output tokens of one block, ending on a block boundary.
    prompt_len, block = whole.usage.prompt_tokens, 16
    ends = list(range((prompt_len // block + 1) * block, prompt_len + 32, block)) + [prompt_len + 32]
    sizes = [len(c.choices[0].model_extra["token_ids"]) for c in content]
    assert sizes == [b - a for a, b in zip([prompt_len] + ends[:-1], ends)]
    assert sum(sizes) == 32
    assert content[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # the raw stream ends with the SSE terminator
    with httpx.stream("POST", server.url + "/v1/completions", json={**kwargs.pop("extra_body"), **kwargs,
                                                                     "stream": True}, timeout=60) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_chat_completion_streaming_and_not_agree(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=20, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 20 and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    streamed_finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert streamed_finish == ["length"]


def test_chat_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=8, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_lower_threshold_needs_fewer_forwards(client):
    def forwards(threshold: float) -> tuple[int, int]:
        r = client.completions.create(model=MODEL, prompt="Count: one two three", max_tokens=32,
                                      extra_body={"threshold": threshold, "ignore_eos": True})
        return fluxlab_usage(r.usage)["forwards"], r.usage.completion_tokens

    strict, n_strict = forwards(1.0)  # nothing is ever more than 100% sure: the steps schedule rules
    loose, n_loose = forwards(0.0)  # every masked position qualifies at once
    assert n_strict == n_loose == 32
    assert loose < strict
    assert strict >= 32  # 16 steps per block, two blocks


def test_per_request_steps_bound_the_forwards(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=16,
                                  extra_body={"threshold": 1.0, "steps": 4, "ignore_eos": True})
    p = r.usage.prompt_tokens
    blocks = (p + 16 + 15) // 16 - p // 16  # blocks holding output tokens
    # 4 transfer steps per block (+ at most one commit forward each), far below the default 16
    assert 4 * blocks <= fluxlab_usage(r.usage)["forwards"] <= 5 * blocks


def test_stop_strings_cut_the_text(client):
    kwargs = dict(model=MODEL, prompt="Tell me something", max_tokens=32, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert len(stop.strip()) >= 2, f"no usable stop string in {full!r}"
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[:full.index(stop)]


def test_literal_mask_text_in_a_prompt_is_served(client):
    r = client.completions.create(model=MODEL, prompt="fill <|mask|> in <|mask|>", max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_models_health_server_info(server):
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == [MODEL]
    from fluxlab.checkpoint import ensure_tiny_checkpoint

    card = models.data[0].model_extra
    assert card["max_model_len"] == 256
    assert card["root"] == str(ensure_tiny_checkpoint().resolve())  # the folder the weights came from
    assert server.get("/health").status_code == 200
    info = server.get("/server_info").json()
    assert info["config"]["engine"]["dtype"] == "float32"
    assert info["config"]["decoding"]["block_length"] == 16
    load = server.get("/get_load").json()
    assert load[0]["kv_total_pages"] > 0


def test_metrics_use_the_fluxlab_prefix_and_count(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=16, extra_body={"ignore_eos": True})
    text = server.get("/metrics").text
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count", "num_requests_running",
                 "num_requests_waiting", "generation_tokens_total", "forwards_total", "tokens_per_forward_count",
                 "kv_free_pages"):
        assert f"fluxlab:{name}" in text, name
    assert metric_value(text, "fluxlab:generation_tokens_total") >= 16
    assert metric_value(text, "fluxlab:forwards_total") >= 1
    assert metric_value(text, "fluxlab:engine_step_seconds_total") > 0
    assert 0 < metric_value(text, "fluxlab:engine_host_seconds_total") <= metric_value(text, "fluxlab:engine_step_seconds_total")
    assert 0 <= metric_value(text, "fluxlab:forwards_launched_ahead_total") <= metric_value(text, "fluxlab:forwards_total")
    assert metric_value(text, "fluxlab:e2e_request_latency_seconds_count") >= 1



def test_a_repeated_prompt_reports_cached_tokens_load_and_metrics(server):
    body = {"model": MODEL, "prompt": "Cached prefix: " + "one two three four five six seven eight " * 6,
            "max_tokens": 16, "ignore_eos": True}
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["usage"]
    again = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"] >= 32
    # every full prompt block (16 tokens) of the second request came from the cache
    assert again["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] // 16 * 16
    assert first["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens_details"]["cached_tokens"]
    load = server.get("/get_load").json()[0]
    assert load["kv_cached_pages"] >= first["prompt_tokens"] // 16 and 0 < load["prefix_cache_hit_rate"] <= 1
    text = server.get("/metrics").text
    assert metric_value(text, "fluxlab:prefix_cache_hits_total") >= first["prompt_tokens"] // 16
    assert metric_value(text, "fluxlab:prefix_cache_queries_total") >= metric_value(text, "fluxlab:prefix_cache_hits_total")
    assert metric_value(text, "fluxlab:kv_cached_pages") == load["kv_cached_pages"]

# ------------------------------------------------------------------------------------ bad input

GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

BAD_COMPLETIONS = [
    ({"model": MODEL, "max_tokens": 8}, "prompt"),  # missing prompt
    ({**GOOD, "prompt": ""}, "prompt"),
    ({**GOOD, "prompt": []}, "prompt"),
    ({**GOOD, "prompt": 42}, "prompt"),
    ({**GOOD, "prompt": [1, -5]}, "prompt"),
    ({**GOOD, "prompt": ["a", "b"]}, "prompt"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": -3}, "max_tokens"),
    ({**GOOD, "max_tokens": "ten"}, "max_tokens"),
    ({**GOOD, "max_tokens": 100000}, "max_tokens"),  # prompt + max_tokens > max_model_len
    ({**GOOD, "n": 3}, "n"),
    ({**GOOD, "n": 10**9}, "n"),
    ({**GOOD, "threshold": 1.5}, "threshold"),
    ({**GOOD, "threshold": -0.1}, "threshold"),
    ({**GOOD, "threshold": "high"}, "threshold"),
    ({**GOOD, "editing_threshold": 2}, "editing_threshold"),
    ({**GOOD, "low_threshold": -1}, "low_threshold"),
    ({**GOOD, "decoder": "beam"}, "decoder"),
    ({**GOOD, "steps": 1000}, "steps"),
    ({**GOOD, "steps": 0}, "steps"),
    ({**GOOD, "temperature": -1}, "temperature"),
    ({**GOOD, "top_p": 0}, "top_p"),
    ({**GOOD, "top_k": -2}, "top_k"),
    ({**GOOD, "max_post_steps": -1}, "max_post_steps"),
    ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**GOOD, "ignore_eos": "maybe"}, "ignore_eos"),
    ({**GOOD, "stream": "yes"}, "stream"),
    ({**GOOD, "logprobs": 5}, "logprobs"),
]
BAD_CHATS = [
    ({"model": MODEL, "max_tokens": 8}, "messages"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({**CHAT, "messages": "hi"}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "threshold": 7}, "threshold"),
]


def assert_openai_error(response: httpx.Response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_input_is_a_400_naming_the_field(server, body, param):
    assert_openai_error(server.post("/v1/completions", json=body), 400, param)
    if param != "stream":  # a rejected request is a plain JSON error even when it asked for a stream
        assert_openai_error(server.post("/v1/completions", json={**body, "stream": True}), 400, param)


@pytest.mark.parametrize("body,param", BAD_CHATS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_CHATS)])
def test_bad_chat_input_is_a_400_naming_the_field(server, body, param):
    assert_openai_error(server.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'{"prompt": "\xff\xfe", "max_tokens": 4}',
                                 b'{"model": "tiny_llada2", "prompt": "\\ud800", "max_tokens": 4}'])
def test_unparseable_bodies_are_400(server, raw):
    response = server.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


def test_unknown_model_is_404(server, client):
    error = assert_openai_error(server.post("/v1/completions", json={**GOOD, "model": "gpt-17"}), 404, "model")
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])


def test_the_openai_client_sees_bad_input_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"threshold": 3})
    assert info.value.body["param"] == "threshold"


def test_unknown_fields_are_ignored(server):
    response = server.post("/v1/completions", json={**GOOD, "user": "me", "presence_penalty": 0.0, "frobnicate": 1})
    assert response.status_code == 200


def test_client_mistakes_leave_the_server_healthy(server, client):
    for body, _ in BAD_COMPLETIONS[:6]:
        server.post("/v1/completions", json=body)
    assert server.get("/health").status_code == 200
    r = client.completions.create(model=MODEL, prompt="still fine", max_tokens=8, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8


# ------------------------------------------------------------------------------------ load, disconnects

def test_a_disconnected_stream_is_aborted_and_returns_its_pages(server, client):
    total = server.get("/get_load").json()[0]["kv_total_pages"]
    stream = client.completions.create(model=MODEL, prompt="A long story:", max_tokens=224, stream=True,
                                       extra_body={"threshold": 1.0, "ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text is not None
    assert server.get("/get_load").json()[0]["kv_free_pages"] < total  # it holds pages now
    stream.close()
    assert wait_until(lambda: server.get("/get_load").json()[0]["num_reqs"] == 0, 30)
    load = server.get("/get_load").json()[0]
    assert load["kv_free_pages"] == load["kv_total_pages"] == total


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(server):
    before = server.get("/get_load").json()[0]["total_generated_tokens"]
    with pytest.raises(httpx.TimeoutException):  # 240 tokens at 16 forwards a block take seconds
        httpx.post(server.url + "/v1/completions", timeout=0.3,
                   json={**GOOD, "prompt": "x", "max_tokens": 240, "threshold": 1.0, "ignore_eos": True})
    assert wait_until(lambda: server.get("/get_load").json()[0]["num_reqs"] == 0, 30)
    load = server.get("/get_load").json()[0]
    assert load["kv_free_pages"] == load["kv_total_pages"]
    assert load["total_generated_tokens"] - before < 240  # stopped early, not run to the end


def test_fifty_concurrent_requests_all_complete(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)

        async def one(i: int):
            if i % 2:
                r = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"#{i}"}],
                                                          max_tokens=16, extra_body={"ignore_eos": True})
            else:
                r = await aclient.completions.create(model=MODEL, prompt=f"request {i}:", max_tokens=16,
                                                     extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(50)))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == [16] * 50
    load = server.get("/get_load").json()[0]
    assert load["kv_free_pages"] == load["kv_total_pages"]


# ------------------------------------------------------------------------------------ auth, overload, shutdown

def test_api_key_overload_and_sigterm(tmp_path):
    """One small server for the rest: Bearer key, a one-slot waiting queue, then SIGTERM mid-stream."""
    key = "s3cret"
    server = ServerProcess(TINY + [f"server.api_key={key}", "server.max_waiting_requests=1",
                                   "scheduler.max_num_seqs=1"], tmp_path)
    try:
        # 401 without (or with a wrong) key; /health stays open for routers and probes
        assert_openai_error(server.post("/v1/completions", json=GOOD), 401)
        assert_openai_error(server.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer no"}), 401)
        assert server.get("/health").status_code == 200
        # everything else needs the key too, the operations endpoints included (DESIGN §12)
        for path in ("/metrics", "/server_info", "/get_load", "/v1/models", "/get_model_info"):
            assert_openai_error(server.get(path), 401)
            assert server.get(path, headers={"Authorization": f"Bearer {key}"}).status_code == 200, path
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        r = client.completions.create(model=MODEL, prompt="hi", max_tokens=8, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8

        # 503 past the waiting bound: one runs, one waits, the rest are turned away
        async def burst():
            headers = {"Authorization": f"Bearer {key}"}
            body = {**GOOD, "max_tokens": 64, "threshold": 1.0, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(8)))

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 503 in statuses, statuses
        assert set(statuses) <= {200, 503}
        overloaded = [r for r in responses if r.status_code == 503][0]
        error = assert_openai_error(overloaded, 503)
        assert error["code"] == "overloaded" and "max_waiting_requests" in error["message"]

        # SIGTERM with a stream in flight: the stream ends, the process exits 0, the port is free
        lines: list[str] = []
        started = threading.Event()

        def read_stream():
            body = {**GOOD, "max_tokens": 224, "threshold": 1.0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {key}"}) as raw:
                for line in raw.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert started.wait(60)
        assert server.stop(signal.SIGTERM) == 0
        reader.join(30)
        assert not reader.is_alive()
        finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in lines
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        assert finish[-1] in ("abort", "length")
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=5)
        with socket.socket() as sock:  # a new server can listen there (as uvicorn does: SO_REUSEADDR)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", server.port))
            sock.listen()
    finally:
        server.kill()
