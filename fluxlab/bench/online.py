"""Online load: an httpx async client streaming OpenAI requests at a Poisson (or gamma) arrival rate.

As in sglang's bench_serving: arrivals are gaps drawn from a gamma distribution of shape
`burstiness` and mean 1/request_rate (shape 1 = Poisson, smaller = burstier; rate inf = all at
once); `max_concurrency` caps requests in flight, and a request's clock starts when it is sent,
not when it arrives. Warm-up requests run first and are left out of every number.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, AsyncIterator, Optional, Sequence

import logging

import httpx
import numpy as np
from tqdm.auto import tqdm

from fluxlab.bench.metrics import EngineSteps, RequestRecord
from fluxlab.bench.workload import BenchPrompt

logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the progress bar



def arrival_gaps(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before sending each request (the first is sent at once)."""
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"bench.request_rate={request_rate} and bench.burstiness={burstiness} must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    gaps[0] = 0.0
    return gaps.tolist()


def request_body(prompt: BenchPrompt, model: str, knobs: dict[str, Any], stream: bool = True
                 ) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one request; `knobs` are the per-request decoding fields."""
    # return_token_ids (fluxlab's, ignored elsewhere) makes fluxlab stream every block, so TTFT and
    # ITL time blocks even when their text is empty (random weights decode mostly to nothing).
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.max_tokens, "stream": stream,
                            "return_token_ids": True, **knobs}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if prompt.ignore_eos:
        body["ignore_eos"] = True
    if prompt.response_format is not None:
        body["response_format"] = prompt.response_format
    if prompt.messages is not None:
        return "/v1/chat/completions", {**body, "messages": prompt.messages}
    return "/v1/completions", {**body, "prompt": prompt.token_ids}


def _decoder_counts(usage: dict[str, Any]) -> tuple[Optional[int], Optional[int]]:
    """(forwards, tokens accepted) from the server's `usage.fluxlab` extension, when present."""
    extra = usage.get("fluxlab") or {}
    forwards, accepted = extra.get("forwards"), extra.get("tokens_accepted")
    return (None if forwards is None else int(forwards)), (None if accepted is None else int(accepted))


async def _events(response: httpx.Response, stream: bool) -> AsyncIterator[dict[str, Any]]:
    """The response's JSON chunks: SSE `data:` lines, or the whole body when not streaming."""
    if not stream:
        yield response.json()
        return
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send_request(client: httpx.AsyncClient, base_url: str, prompt: BenchPrompt, model: str,
                       knobs: dict[str, Any], stream: bool = True) -> RequestRecord:
    """Send one request; times chunks as they arrive and takes token counts from the server's usage.

    Without streaming the whole answer is one chunk, so TTFT equals the e2e latency.
    """
    record = RequestRecord(index=prompt.index, answer=prompt.answer)
    path, body = request_body(prompt, model, knobs, stream)
    pieces: list[str] = []
    chunk_times: list[float] = []
    usage: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        async with client.stream("POST", base_url + path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {detail[:500]}")
            if not stream:
                await response.aread()
            async for chunk in _events(response, stream):
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    message = choice.get("delta") or choice.get("message") or {}
                    text = message.get("content") or choice.get("text") or ""
                    if text or choice.get("token_ids"):
                        chunk_times.append(time.perf_counter())
                        pieces.append(text)
                        record.token_ids.extend(choice.get("token_ids") or [])
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
        end = time.perf_counter()
    except Exception as err:  # a failed request is counted, not fatal to the run
        record.success, record.error = False, f"{type(err).__name__}: {err}"
        record.e2e_s = time.perf_counter() - start
        return record
    if not usage:
        record.success, record.error = False, "no usage in the answer (stream_options.include_usage ignored?)"
        return record
    record.success = True
    record.text = "".join(pieces)
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    record.forwards, record.tokens_accepted = _decoder_counts(usage)
    edited = (usage.get("fluxlab") or {}).get("tokens_edited")
    record.tokens_edited = None if edited is None else int(edited)
    record.e2e_s = end - start
    record.ttft_s = (chunk_times[0] if chunk_times else end) - start
    record.itl_s = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    record.chunks = len(chunk_times)
    return record


# fluxlab's engine counters on /metrics (a CounterMetricFamily's sample carries the _total suffix).
_FORWARDS, _STEP_SECONDS = "fluxlab:forwards_total", "fluxlab:engine_step_seconds_total"
_GRAPH_FORWARDS = "fluxlab:graph_forwards_total"
_HOST_SECONDS = "fluxlab:engine_host_seconds_total"


async def _engine_counters(client: httpx.AsyncClient, base_url: str) -> Optional[dict[str, Optional[float]]]:
    """{forwards, seconds, graph_forwards, host_seconds} from the server's /metrics (the last two None when
    not reported); None when it has no fluxlab counters (another engine, a router in front of several
    replicas) or cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get(base_url + "/metrics")
        response.raise_for_status()
        samples = {s.name: s.value for family in text_string_to_metric_families(response.text)
                   for s in family.samples}
    except (httpx.HTTPError, ValueError):
        return None
    if _FORWARDS not in samples or _STEP_SECONDS not in samples:
        return None
    return {"forwards": samples[_FORWARDS], "seconds": samples[_STEP_SECONDS],
            "graph_forwards": samples.get(_GRAPH_FORWARDS), "host_seconds": samples.get(_HOST_SECONDS)}


def _steps_between(before: dict[str, Optional[float]], after: dict[str, Optional[float]]) -> EngineSteps:
    def delta(key: str) -> Optional[float]:
        return None if before[key] is None or after[key] is None else after[key] - before[key]

    graphs = delta("graph_forwards")
    return EngineSteps(int(delta("forwards")), delta("seconds"), None if graphs is None else int(graphs),
                       delta("host_seconds"))


async def _run(base_url: str, prompts: Sequence[BenchPrompt], model: str, knobs: dict[str, Any], bench: Any,
               seed: int, api_key: Optional[str]) -> tuple[list[RequestRecord], float, Optional[EngineSteps]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(bench.request_timeout_s, pool=None)
    limits = httpx.Limits(max_connections=bench.max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        for i in range(bench.warmup_requests):
            warm = await send_request(client, base_url, prompts[i % len(prompts)], model, knobs, bench.stream)
            if not warm.success:
                raise RuntimeError(f"warm-up request failed against {base_url}: {warm.error}")

        gate = asyncio.Semaphore(bench.max_concurrency) if bench.max_concurrency else None
        progress = tqdm(total=len(prompts), desc="requests", unit="req", disable=bench.disable_progress)

        async def one(prompt: BenchPrompt) -> RequestRecord:
            if gate is None:
                record = await send_request(client, base_url, prompt, model, knobs, bench.stream)
            else:
                async with gate:
                    record = await send_request(client, base_url, prompt, model, knobs, bench.stream)
            progress.update(1)
            return record

        tasks = []
        before = await _engine_counters(client, base_url)
        start = time.perf_counter()
        for prompt, gap in zip(prompts, arrival_gaps(len(prompts), bench.request_rate, bench.burstiness, seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()
        after = await _engine_counters(client, base_url) if before is not None else None
    steps = _steps_between(before, after) if after is not None else None
    return list(records), duration, steps


def run_online(base_url: str, prompts: Sequence[BenchPrompt], model: str, knobs: dict[str, Any], bench: Any,
               seed: int = 0, api_key: Optional[str] = None) -> tuple[list[RequestRecord], float, Optional[EngineSteps]]:
    """Send every prompt to `base_url` under `bench`'s load shape; (records in prompt order, duration s,
    the server engine's steps during the run or None when its /metrics has no fluxlab counters)."""
    return asyncio.run(_run(base_url.rstrip("/"), prompts, model, knobs, bench, seed, api_key))
