"""Start `python -m fluxlab serve` in a subprocess and wait for its ready line (server tests).

server.port=0 lets the OS pick the port with no race; the ready line `fluxlab ready: URL` says
which. stderr goes to a log file, shown when a start fails.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx

from fluxlab.config import PROJECT_ROOT

# The tiny model in fp32 on CPU, small blocks so a request is a few blocks and tests stay fast.
TINY = ["model=tiny_llada2", "engine.dtype=float32", "engine.device=cpu", "decoding.block_length=16",
        "model.max_model_len=256", "server.host=127.0.0.1", "server.port=0", "server.log_level=warning"]
MODEL = "tiny_llada2"
READY = "fluxlab ready: "


class ServerProcess:
    def __init__(self, overrides: list[str], log_dir: Path, name: str = "serve", start_timeout_s: float = 180.0,
                 env: Optional[dict] = None):
        self.log_path = log_dir / f"{name}.stderr.log"
        self._stderr = open(self.log_path, "wb")
        argv = [sys.executable, "-m", "fluxlab", "serve", *overrides, f"hydra.run.dir={log_dir / name}"]
        # Its own session, so kill() also ends the replicas and router of a dp server whose test failed.
        self.proc = subprocess.Popen(argv, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})},
                                     start_new_session=True)
        self.stdout_lines: list[str] = []
        self._ready: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.url = self._wait_ready(start_timeout_s)
        self.port = int(self.url.rsplit(":", 1)[1])

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            if line.startswith(READY):
                self._ready.put(line[len(READY):].strip())

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self._ready.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
        self.kill()
        raise RuntimeError(f"server did not become ready (rc={self.proc.poll()}):\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=120, **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever it started and left behind
        except (ProcessLookupError, PermissionError):
            pass
        self._stderr.close()


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0.0 when none)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


class FakeEngine:
    """An engine stand-in for in-process app tests: commits `ids_per_step` copies of a fixed token
    per step; a prompt holding `fail_token` makes the step raise (a broken device step)."""

    def __init__(self, tokenizer, max_model_len: int = 256, ids_per_step: int = 4, fail_token: int = -1):
        from fluxlab.engine.request import RequestOutput, RequestStats  # noqa: F401

        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.ids_per_step, self.fail_token = ids_per_step, fail_token
        self.token = tokenizer.encode("a", add_special_tokens=False)[0]
        self.requests: dict[str, dict] = {}
        self.pending: list = []
        self.num_waiting = self.num_running = 0
        self.kv_free_pages = self.kv_total_pages = 8
        self.total_forwards = self.total_generated_tokens = 0
        self.total_step_seconds = 0.0

    def add_request(self, prompt_ids, params, request_id):
        self.requests[request_id] = {"prompt": prompt_ids, "out": [], "max": params.max_new_tokens or 8}

    def abort_request(self, request_id):
        from fluxlab.engine.request import RequestOutput, RequestStats

        request = self.requests.pop(request_id, None)
        if request is not None:
            self.pending.append(RequestOutput(request_id, [], request["out"], True, "abort", RequestStats()))

    def has_unfinished(self):
        return bool(self.requests or self.pending)

    def step(self):
        from fluxlab.engine.request import RequestOutput, RequestStats

        outputs, self.pending = self.pending, []
        if any(self.fail_token in r["prompt"] for r in self.requests.values()):
            raise RuntimeError("device step failed")
        for request_id, request in list(self.requests.items()):
            new = [self.token] * min(self.ids_per_step, request["max"] - len(request["out"]))
            request["out"] = request["out"] + new
            done = len(request["out"]) >= request["max"]
            if done:
                del self.requests[request_id]
            outputs.append(RequestOutput(request_id, new, list(request["out"]), done, "length" if done else None,
                                         RequestStats()))
        self.total_forwards += 1
        return outputs

    def shutdown(self):
        self.requests.clear()


def fake_app(overrides: list[str] = (), **engine_kwargs):
    """The real app around a FakeEngine, for httpx.ASGITransport (start the engine loop yourself)."""
    from fluxlab.config import compose, validate_config
    from fluxlab.engine.loading import load_tokenizer
    from fluxlab.server.app import build_app
    from fluxlab.server.async_engine import AsyncEngine

    cfg = compose("serve", TINY + list(overrides))
    validate_config(cfg, cuda_available=False)
    async_engine = AsyncEngine(FakeEngine(load_tokenizer(None), **engine_kwargs), cfg.server.max_waiting_requests)
    return build_app(cfg, async_engine), async_engine


def assert_server_goes_down(server: ServerProcess, body: dict, message: str) -> None:
    """After something killed a process the server needs: a request fails (or finds the server
    gone), the server exits 1 and its log says `message`."""
    try:
        assert server.post("/v1/completions", json=body).status_code >= 500
    except httpx.HTTPError:
        pass  # the server may already be gone
    assert wait_until(lambda: server.proc.poll() is not None, timeout_s=60)
    assert server.proc.returncode == 1
    assert message in server.log()
