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
        self.proc = subprocess.Popen(argv, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})})
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
