"""SIGTERM (issue 35.4): new requests get a 503 at once, in-flight ones finish for up to
server.drain_timeout_s and are then aborted with a proper end, and the process exits 0."""
from __future__ import annotations

import asyncio
import ctypes
import http.client
import json
import os
import signal
import threading

import httpx

from server_helpers import MODEL, TINY, ServerProcess, fake_app


def _stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, list[str], threading.Event]:
    """Read a completion stream on a thread; `started` is set at its first chunk."""
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as raw:
            for line in raw.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, lines, started


def _signal_main_thread(pid: int, sig: int) -> None:
    """tgkill: the signal lands on the process's main thread (tid == pid), as the server arranges
    for a process signal by blocking it in its helper threads; a process signal could still land
    on a native thread (torch's, say), whose handler might run only after the main thread served
    a request that came with it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, pid, sig) != 0:
        raise OSError(ctypes.get_errno(), "tgkill failed")


def _chunks(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_requests_arriving_with_sigterm_get_a_503_and_in_flight_ones_finish_within_the_drain(tmp_path):
    server = ServerProcess(TINY + ["server.drain_timeout_s=120"], tmp_path)
    try:
        # keep-alive connections a client opened before the signal
        idle = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=60) for _ in range(3)]
        for conn in idle:
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b'{"status":"ok"}'
        # in flight: past its first block of three (16 tokens a block)
        reader, lines, started = _stream_in_thread(server.url, {"model": MODEL, "prompt": "hi", "max_tokens": 48,
                                                                "ignore_eos": True, "return_token_ids": True})
        assert started.wait(120)
        # The signal and the new requests reach the server together: stopped, it gets both, and
        # runs its signal handler before it reads the requests (its shutdown starts on its next
        # 0.1 s tick; without the stop the requests would race that tick).
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            _signal_main_thread(server.proc.pid, signal.SIGTERM)
            for i, conn in enumerate(idle):
                if i == 0:
                    conn.request("GET", "/health")
                else:
                    conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "late"}),
                                 headers={"Content-Type": "application/json"})
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        for conn in idle:
            response = conn.getresponse()
            body = json.loads(response.read())
            assert response.status == 503, body
            error = body["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "shutting_down"
            assert response.getheader("connection") == "close"
        assert server.proc.wait(120) == 0
        reader.join(30)
        chunks = _chunks(lines)
        assert lines[-1] == "data: [DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # drained, not aborted
        assert sum(len(c["choices"][0].get("token_ids", [])) for c in chunks) == 48
    finally:
        server.kill()


def test_past_the_drain_in_flight_streams_are_aborted_and_closed_properly(tmp_path):
    server = ServerProcess(TINY + ["server.drain_timeout_s=1", "model.max_model_len=2048"], tmp_path)
    try:
        # thousands of forwards at threshold 1.0: far longer than the drain
        reader, lines, started = _stream_in_thread(server.url, {"model": MODEL, "prompt": "hi", "max_tokens": 2000,
                                                                "threshold": 1.0, "ignore_eos": True})
        assert started.wait(120)
        assert server.stop(signal.SIGTERM, timeout_s=120) == 0
        reader.join(30)
        assert not reader.is_alive()
        assert lines[-1] == "data: [DONE]"
        assert _chunks(lines)[-1]["choices"][0]["finish_reason"] == "abort"
        assert "graceful shutdown exceeded" not in server.log()  # it ended; uvicorn did not cut it
    finally:
        server.kill()


def test_once_stopping_every_path_is_a_503_in_the_openai_shape():
    app, async_engine = fake_app(["server.api_key=k"])

    async def main():
        async_engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
                before = await http.get("/health")
                app.state.shutdown.begin()
                return before, [await http.get("/health"), await http.get("/v1/models"),
                                await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})]
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    before, after = asyncio.run(main())
    assert before.status_code == 200
    for response in after:
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "shutting_down"
        assert response.headers["connection"] == "close"


def test_the_servers_helper_threads_leave_the_stop_signals_to_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    from fluxlab.server.shutdown import block_stop_signals, start_blind_to_stop_signals

    masks: list[set] = []
    thread = threading.Thread(target=lambda: masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    start_blind_to_stop_signals(thread)
    thread.join()
    with ThreadPoolExecutor(1, initializer=block_stop_signals) as pool:
        masks.append(pool.submit(signal.pthread_sigmask, signal.SIG_BLOCK, []).result())
    for mask in masks:
        assert {signal.SIGTERM, signal.SIGINT} <= mask
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the caller's own mask is back
