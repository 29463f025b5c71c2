"""`fluxlab serve` runs the engine loop in a child process: its death and the server's are both handled."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from fluxlab.bench.soak import descendants
from server_helpers import MODEL, TINY, ServerProcess, assert_server_goes_down, wait_until


def _engine_process(server_pid: int) -> int:
    [engine] = [p for p in descendants(server_pid)
                if "multiprocessing.spawn" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
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
        assert_server_goes_down(server, BODY, "the engine process exited (exit code -9)")
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


def test_sigterm_stops_the_engine_process_with_the_server_and_it_writes_its_profile(tmp_path):
    """(FLUXLAB_ENGINE_PROFILE: the child's loop under cProfile, written when it stops.)"""
    import pstats

    server = ServerProcess(TINY, tmp_path, env={"FLUXLAB_ENGINE_PROFILE": str(tmp_path / "prof")})
    engine = _engine_process(server.proc.pid)
    assert server.post("/v1/completions", json=BODY).status_code == 200
    assert server.stop(signal.SIGTERM) == 0
    assert wait_until(lambda: _gone(engine), timeout_s=30)
    stats = pstats.Stats(str(tmp_path / "prof" / f"engine_{engine}.prof")).stats
    steps = [calls for (path, _, name), (_, calls, *_) in stats.items() if name == "step" and path.endswith("llm_engine.py")]
    assert steps and steps[0] >= 2  # 16 tokens at block 32: at least a prefill and a decode step
