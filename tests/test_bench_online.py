"""The online client against a stub OpenAI server of the real one's shape (SSE, one chunk per block, usage)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from omegaconf import OmegaConf

from fluxlab.bench.metrics import compute_metrics
from fluxlab.bench.online import arrival_gaps, run_online
from fluxlab.bench.run import run_bench
from fluxlab.bench.workload import BenchPrompt
from fluxlab.config import compose, validate_config

BLOCK_GAP_S = 0.05  # the stub "commits a block" this often


def make_stub():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    state = {"requests": 0, "in_flight": 0, "max_in_flight": 0, "bodies": []}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    # 12 tokens whatever the text says: the client must count the server's tokens, not re-tokenise.
    usage = {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19,
             "fluxlab": {"forwards": 4, "tokens_accepted": 18, "tokens_per_forward": 4.5}}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        state["requests"] += 1
        state["bodies"].append(body)
        if body["messages"][0]["content"] == "fail":
            return JSONResponse({"error": {"message": "bad", "type": "invalid_request_error"}}, status_code=400)
        if not body["stream"]:
            await asyncio.sleep(3 * BLOCK_GAP_S)
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ababab"},
                                 "finish_reason": "length"}], "usage": usage}

        async def stream():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) + "\n\n"
                for i in range(3):
                    await asyncio.sleep(BLOCK_GAP_S)
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "ab"},
                                                              "finish_reason": "length" if i == 2 else None}]}) + "\n\n"
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app, state


@pytest.fixture(scope="module")
def stub():
    import uvicorn

    app, state = make_stub()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(5)


def bench(**overrides):
    base = dict(request_rate=float("inf"), burstiness=1.0, max_concurrency=None, warmup_requests=1, stream=True,
                disable_progress=True, request_timeout_s=30.0)
    return OmegaConf.create({**base, **overrides})


def prompts(n, content="q"):
    return [BenchPrompt(index=i, max_tokens=32, messages=[{"role": "user", "content": content}], answer="1")
            for i in range(n)]


def test_streamed_request_timing_and_server_usage(stub):
    url, state = stub
    before = state["requests"]
    records, duration, steps = run_online(url, prompts(4), "tiny", {"threshold": 0.7, "steps": 32}, bench(warmup_requests=2))
    assert state["requests"] - before == 4 + 2  # warm-up requests were sent...
    assert len(records) == 4  # ...and left out of the numbers
    r = records[0]
    assert r.success and r.text == "ababab" and r.finish_reason == "length"
    assert (r.prompt_tokens, r.output_tokens, r.chunks) == (7, 12, 3)
    assert (r.forwards, r.tokens_accepted) == (4, 18)
    assert r.ttft_s >= BLOCK_GAP_S * 0.8
    assert len(r.itl_s) == 2 and all(gap >= BLOCK_GAP_S * 0.8 for gap in r.itl_s)
    assert r.e2e_s <= duration
    assert steps is None  # the stub has no /metrics with fluxlab's engine counters
    m = compute_metrics(records, duration)
    assert m["total_output_tokens"] == 48 and m["tokens_per_forward"] == pytest.approx(4.5)
    body = state["bodies"][-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["threshold"] == 0.7 and body["steps"] == 32 and body["max_tokens"] == 32


def test_without_streaming_the_answer_is_one_chunk(stub):
    url, state = stub
    (r,), _, _ = run_online(url, prompts(1), "tiny", {}, bench(stream=False, warmup_requests=0))
    assert r.success and r.text == "ababab" and (r.output_tokens, r.chunks, r.itl_s) == (12, 1, [])
    assert r.ttft_s == pytest.approx(r.e2e_s, abs=0.01) and r.ttft_s >= 3 * BLOCK_GAP_S * 0.8
    assert "stream_options" not in state["bodies"][-1]


def test_max_concurrency_caps_requests_in_flight(stub):
    url, state = stub
    state["max_in_flight"] = 0
    records, _, _ = run_online(url, prompts(6), "tiny", {}, bench(max_concurrency=2, warmup_requests=0))
    assert all(r.success for r in records)
    assert state["max_in_flight"] == 2


def test_failed_request_is_counted_not_fatal(stub):
    url, _ = stub
    records, duration, steps = run_online(url, prompts(2) + prompts(1, content="fail"), "tiny", {}, bench(warmup_requests=0))
    assert [r.success for r in records] == [True, True, False]
    assert "HTTP 400" in records[2].error
    m = compute_metrics(records, duration)
    assert (m["completed"], m["failed"]) == (2, 1)


def test_poisson_rate_spreads_arrivals(stub):
    url, _ = stub
    records, duration, steps = run_online(url, prompts(5), "tiny", {}, bench(request_rate=20.0, warmup_requests=0))
    assert all(r.success for r in records)
    assert duration > sum(arrival_gaps(5, 20.0, 1.0, seed=0))


def test_arrival_gaps():
    assert arrival_gaps(3, float("inf"), 1.0, seed=0) == [0.0, 0.0, 0.0]
    gaps = arrival_gaps(4000, 10.0, 1.0, seed=0)
    assert gaps[0] == 0.0
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.05)  # mean 1/rate
    assert arrival_gaps(50, 10.0, 1.0, seed=3) == arrival_gaps(50, 10.0, 1.0, seed=3)

    def cv(values):
        mean = sum(values) / len(values)
        return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5 / mean

    # gamma shape k has coefficient of variation 1/sqrt(k): burstiness < 1 is burstier than Poisson.
    assert cv(arrival_gaps(4000, 10.0, 0.25, seed=0)[1:]) == pytest.approx(2.0, rel=0.1)
    assert cv(arrival_gaps(4000, 10.0, 4.0, seed=0)[1:]) == pytest.approx(0.5, rel=0.1)
    with pytest.raises(ValueError, match="bench.request_rate"):
        arrival_gaps(2, 0.0, 1.0, seed=0)


def test_bench_against_an_external_url_uses_its_served_model(stub, tmp_path, monkeypatch):
    url, state = stub
    monkeypatch.chdir(tmp_path)
    cfg = compose("bench", ["bench=online", f"bench.url={url}", "tracking=none", "workload.num_prompts=3",
                            "bench.disable_progress=true"])
    validate_config(cfg, cuda_available=False)
    result = run_bench(cfg)
    assert result["completed"] == 3 and result["total_output_tokens"] == 36 and result["accuracy"] == 0.0
    line = json.loads((tmp_path / "results.jsonl").read_text())
    assert line["served_model"] == "stub-model" and line["url"] == url and "server_pid" not in line
    assert state["bodies"][-1]["model"] == "stub-model"
    assert (tmp_path / "requests.csv").read_text().count("ababab") == 3
