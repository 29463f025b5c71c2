"""`serve parallel=dp2`: two replicas behind sglang-router on CPU, over loopback."""
from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import openai
import pytest

from server_helpers import MODEL, TINY, ServerProcess, metric_value, wait_until

REPLICA = re.compile(r"fluxlab: replica dp(\d) ready at (http://\S+) \(pid (\d+)\)")


def replicas(server: ServerProcess) -> dict[int, tuple[str, int]]:
    return {int(i): (url, int(pid)) for i, url, pid in REPLICA.findall(server.log())}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited but is not reaped yet
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def router_pid(server: ServerProcess) -> int:
    return int(re.search(r"started sglang-router \(pid (\d+)\)", server.log()).group(1))


def test_dp2_behind_the_router_answers_and_both_replicas_serve(tmp_path):
    key = "k3y"
    server = ServerProcess(TINY + ["parallel=dp2", f"server.api_key={key}"], tmp_path, start_timeout_s=240)
    auth = {"Authorization": f"Bearer {key}"}
    try:
        workers = replicas(server)
        assert sorted(workers) == [0, 1]
        assert [line for line in server.stdout_lines if line.startswith("fluxlab ready: ")] == [f"fluxlab ready: {server.url}\n"]

        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 8
        # as with one replica, a chat request may leave `model` out (the router fills in a placeholder)
        no_model = server.post("/v1/chat/completions", headers=auth,
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert no_model.status_code == 200, no_model.text
        # the key reaches the replicas through the router and is required there
        assert server.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
                           ).status_code == 401
        chunks = list(client.completions.create(model=MODEL, prompt="stream me", max_tokens=16, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.completion_tokens == 16

        # Concurrent requests with distinct prefixes: cache_aware spreads them over idle replicas.
        async def burst():
            aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
            try:
                return await asyncio.gather(*(
                    aclient.completions.create(model=MODEL, prompt=f"{chr(65 + i) * 3} prompt {i}", max_tokens=32,
                                               extra_body={"ignore_eos": True, "threshold": 1.0})
                    for i in range(12)))
            finally:
                await aclient.close()

        assert [r.usage.completion_tokens for r in asyncio.run(burst())] == [32] * 12
        served = {i: metric_value(httpx.get(url + "/metrics", timeout=10, headers=auth).text,
                                  "fluxlab:request_success_total") for i, (url, _) in workers.items()}
        assert all(count > 0 for count in served.values()), served
        assert sum(served.values()) == 15
        # the router's log is forwarded without its colour codes
        assert "sglang-router" in server.log() and "\x1b[" not in server.log()

        assert server.stop(signal.SIGTERM) == 0
        pids = [pid for _, pid in workers.values()] + [router_pid(server)]
        assert wait_until(lambda: not any(pid_alive(pid) for pid in pids), 30)
        for url, _ in workers.values():
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/health", timeout=5)
    finally:
        server.kill()


def test_a_replica_that_dies_stops_serve_with_a_clear_error(tmp_path):
    server = ServerProcess(TINY + ["parallel=dp2"], tmp_path, start_timeout_s=240)
    try:
        workers = replicas(server)
        os.kill(workers[1][1], signal.SIGKILL)
        assert server.proc.wait(60) != 0
        assert re.search(r"dp1 \(pid \d+\) exited with code -9", server.log())
        assert wait_until(lambda: not pid_alive(workers[0][1]) and not pid_alive(router_pid(server)), 30)
    finally:
        server.kill()


def test_replica_overrides_outside_hydra_compose_to_the_same_run():
    """serve(cfg) called from Python (no Hydra run) pins every resolved key for its replicas."""
    from fluxlab.config import compose, validate_config
    from fluxlab.server.launch import _worker_overrides

    cfg = compose("serve", TINY + ["parallel=dp2", "decoding.threshold=0.7", "server.worker_urls=[http://h:1]"])
    validate_config(cfg, cuda_available=False)
    replica = compose("serve", _worker_overrides(cfg))
    validate_config(replica, cuda_available=False)
    assert replica.parallel.dp_size == 1 and replica.server.port == 0 and list(replica.server.worker_urls) == []
    assert replica.decoding.threshold == 0.7 and replica.engine.dtype == "float32"
    assert replica.attention.cuda_graph_capture_sizes == cfg.attention.cuda_graph_capture_sizes
