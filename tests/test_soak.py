"""The soak at CI size: three phases of a fixed number of mixed requests against `fluxlab serve`, then
a SIGTERM that lands while requests are in flight and more arrive (issue 35's done-when).

Correctness only (no error, no page, no memory left behind, no seat past its deadline): a phase runs
its requests to the end however long that takes on a loaded machine. Throughput is the soak
benchmark's to report (`python -m fluxlab.bench.soak`, docs/server.md § Soak), never a test's to
assert.

The mix holds good requests, bad inputs (malformed, past every knob's bound, past the server's work
ceilings), disconnects and abandoned requests, greedy, seeded and temperature=1e-300 requests compared
to their solo runs, and heavy requests (the most work the ceilings allow) that must end within the
request deadline. How a deadline cuts a request that would run longer is tests/test_request_limits.py's.
"""
from __future__ import annotations

import asyncio
import json
import math
import signal
import time
from collections import Counter

import httpx

from fluxlab.bench.soak import KINDS, Heavy, soak
from server_helpers import MODEL, TINY, ServerProcess

REQUESTS_PER_PHASE = 40
DEADLINE_S = 60.0
SERVER = TINY + [f"server.request_timeout_s={DEADLINE_S}"]
# The most work the server's ceilings let a request ask for: joint_threshold editing at temperature 3
# for the full decoding.max_post_steps_limit (null: decoding.max_post_steps, 16) after every block.
CEILING = 16
HEAVY = Heavy({"decoder": "joint_threshold", "editing_threshold": 0.0, "temperature": 3.0,
               "max_post_steps": CEILING}, deadline_s=DEADLINE_S)


def test_a_mixed_hostile_load_leaves_no_error_no_page_and_no_memory_behind(tmp_path):
    server = ServerProcess(SERVER, tmp_path)
    try:
        report = soak(server.url, MODEL, phases=3, phase_seconds=math.inf, max_requests=REQUESTS_PER_PHASE,
                      concurrency=6, max_tokens=32, seed=0, pid=server.proc.pid, heavy=HEAVY)
        # Past the ceiling is a 400 naming the knob and the key that sets the ceiling.
        over = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "x", "decoder": "joint_threshold", "max_post_steps": CEILING + 1})
        late = asyncio.run(_sigterm_while_busy(server))
    finally:
        server.stop()
    print("\n" + report.table())
    assert report.failures == []
    assert report.server_errors == 0
    for phase in report.phases:
        assert phase.requests == REQUESTS_PER_PHASE, phase
        assert sum(phase.by_kind.values()) == REQUESTS_PER_PHASE, phase.by_kind
        assert phase.kv_free_pages == phase.kv_total_pages
        assert set(phase.statuses) <= {"200", "400", "404", "abandoned"}, phase.statuses
    assert set(sum((Counter(p.by_kind) for p in report.phases), Counter())) == set(KINDS)
    # memory is flat after the first phase (which pays for warm-up allocations)
    rss = [p.rss_mib for p in report.phases]
    assert rss[-1] - rss[0] < max(64.0, 0.15 * rss[0]), rss

    assert over.status_code == 400 and "decoding.max_post_steps_limit" in over.json()["error"]["message"], over.text

    in_flight, refused, exit_code, exit_s = late
    # In flight at the signal (drain_timeout_s=0): each ends with its last chunk, finish_reason abort, [DONE].
    assert in_flight == ["abort"] * len(in_flight), in_flight
    # After it: a 503 in the OpenAI shape while the socket still takes requests, then connection refused.
    assert refused and set(refused) <= {"503 shutting_down", "refused"}, refused
    assert exit_code == 0 and exit_s < 30, (exit_code, exit_s)


async def _sigterm_while_busy(server: ServerProcess) -> tuple[list, list, int, float]:
    """Three long streams, SIGTERM once each has a chunk,
    then new requests on a kept-alive connection: how the streams ended, what the new ones got,
    the exit code and the seconds from the signal to the exit."""
    # Blocks that finish (so chunks flow) but slowly: 16 editing forwards after each of 14 blocks.
    body = {"model": MODEL, "prompt": "late", "max_tokens": 224, "stream": True, "ignore_eos": True,
            **HEAVY.knobs}
    started = [asyncio.Event() for _ in range(3)]

    async def stream(http: httpx.AsyncClient, first_chunk: asyncio.Event) -> str:
        finish, done = None, False
        async with http.stream("POST", "/v1/completions", json=body) as raw:
            assert raw.status_code == 200, await raw.aread()
            async for line in raw.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    first_chunk.set()
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return finish if done else f"no [DONE] after {finish}"

    async def knock(http: httpx.AsyncClient) -> str:
        try:
            response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        except httpx.TransportError:
            return "refused"
        return f"{response.status_code} {response.json()['error']['code']}"

    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, \
            httpx.AsyncClient(base_url=server.url, timeout=60) as keep_alive:
        assert (await keep_alive.get("/health")).status_code == 200  # the connection the late requests reuse
        streams = [asyncio.create_task(stream(http, event)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        refused = [await knock(keep_alive) for _ in range(3)]
        in_flight = await asyncio.gather(*streams)
    exit_code = await asyncio.get_running_loop().run_in_executor(None, server.proc.wait, 60)
    return in_flight, refused, exit_code, time.monotonic() - signalled
