"""`fluxlab serve` runs the engine loop in a child process: its death and the server's are both handled."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from server_helpers import MODEL, TINY, ServerProcess, wait_until


def _engine_process(server_pid: int) -> int:
    children = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    [engine] = [c for c in children if "multiprocessing.spawn" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]
    return engine


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (exited, not yet reaped by its dead parent's init) counts as gone
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


BODY = {"model": MODEL, "prompt": "Hello there", "max_tokens": 16, "ignore_eos": True}


def test_a_dead_engine_process_takes_the_server_down_with_a_clear_message(tmp_path):
    server = ServerProcess(TINY, tmp_path)
    try:
        assert server.post("/v1/completions", json=BODY).status_code == 200
        os.kill(_engine_process(server.proc.pid), signal.SIGKILL)
        try:
            assert server.post("/v1/completions", json=BODY).status_code >= 500
        except httpx.HTTPError:
            pass  # the server may already be gone
        assert wait_until(lambda: server.proc.poll() is not None, timeout_s=60)
        assert server.proc.returncode == 1
        assert "the engine process exited (exit code -9)" in server.log()
    finally:
        server.kill()


def test_the_engine_process_exits_when_the_server_is_killed(tmp_path):
    server = ServerProcess(TINY, tmp_path)
    try:
        engine = _engine_process(server.proc.pid)
        assert server.post("/v1/completions", json=BODY).status_code == 200
        os.kill(server.proc.pid, signal.SIGKILL)  # no shutdown path runs: the engine must notice alone
        assert wait_until(lambda: _gone(engine), timeout_s=60), "the engine process outlived the server"
    finally:
        server.kill()


def test_sigterm_stops_the_engine_process_with_the_server(tmp_path):
    server = ServerProcess(TINY, tmp_path)
    engine = _engine_process(server.proc.pid)
    assert server.post("/v1/completions", json=BODY).status_code == 200
    assert server.stop(signal.SIGTERM) == 0
    assert wait_until(lambda: _gone(engine), timeout_s=30)
