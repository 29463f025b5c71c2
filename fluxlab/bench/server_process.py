"""A `python -m fluxlab serve` subprocess that online bench starts from its own config, reuses, and stops.

The basic Hydra launcher runs a sweep's jobs one after another in this process, so the server of
job 1 stays in a module-level slot and serves job 2 when the two differ only in per-request keys
(those travel in each request's body); any other server-affecting key restarts it. The server gets
the job's fully resolved engine/model/... values as overrides, so a recipe or a group choice of the
bench command reaches it exactly, and its output goes to a log file that bench attaches per job.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import httpx
from omegaconf import DictConfig, OmegaConf

from fluxlab.engine.decoding.knobs import KNOBS

log = logging.getLogger("fluxlab.bench")

# Keys a request body carries (DESIGN §3), so changing them needs no restart: every decoding knob.
PER_REQUEST_KEYS = tuple(KNOBS)
SERVER_GROUPS = ("engine", "model", "scheduler", "attention", "decoding", "parallel", "server")
_READY = re.compile(r"fluxlab ready: (http://\S+)")


def _hydra_value(value: Any) -> str:
    """`value` in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    escaped = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


def server_overrides(cfg: DictConfig) -> list[str]:
    """The resolved server-affecting keys of a bench config as `key=value` overrides for `serve`.

    Two jobs whose lists are equal can share one server. The host is bench's own (loopback); the
    port is server.port (bench's default 0: the OS picks a free one).
    """
    resolved = OmegaConf.to_container(cfg, resolve=True)
    overrides = []
    for group in SERVER_GROUPS:
        for key, value in resolved[group].items():
            if (group == "decoding" and key in PER_REQUEST_KEYS) or (group == "server" and key == "host"):
                continue
            overrides.append(f"{group}.{key}={_hydra_value(value)}")
    overrides.append(f"recipe_name={_hydra_value(resolved.get('recipe_name'))}")
    return overrides


class ServerProcess:
    """One started server: its process, URL and log file."""

    def __init__(self, overrides: list[str], log_path: Path, timeout_s: float):
        self.overrides = overrides
        self.log_path = log_path
        self.url = ""  # from the ready line: server.port=0 lets the OS pick a free port with no race
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(log_path, "ab")
        command = [sys.executable, "-m", "fluxlab", "serve", *overrides, "server.host=127.0.0.1",
                   f"hydra.run.dir={_hydra_value(str(log_path.parent / 'serve'))}"]
        log.info("starting server: %s", " ".join(re.sub(r"(api_key=)(?!null$).+", r"\1***", c) for c in command))
        # Its own session, so stop() can end the server's workers too (TP ranks, router) by group id.
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def _wait_ready(self, timeout_s: float) -> None:
        """Until the ready line is printed and /health answers 200; fails fast if the server exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"server exited with code {self.process.returncode} before it was ready; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            if not self.url:
                found = _READY.search(self.log_path.read_text(errors="replace"))
                self.url = found.group(1).rstrip("/") if found else ""
            if self.url:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        log.info("server ready at %s (pid %d)", self.url, self.pid)
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout_s:.0f} s (server.health_timeout_s); "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server alone (it stops its TP workers, replicas and router itself), then
        SIGKILL to whatever of its process group is left after grace_s."""
        if self.alive():
            log.info("stopping server pid %d", self.pid)
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("server pid %d did not stop within %.0f s of SIGTERM; killing it", self.pid, grace_s)
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        self._log_file.close()


_current: Optional[ServerProcess] = None


def acquire_server(cfg: DictConfig, log_path: Path) -> tuple[ServerProcess, bool]:
    """A ready server for `cfg`: (the running one if its server keys are the same, reused=True) or a new one."""
    global _current
    overrides = server_overrides(cfg)
    if _current is not None and _current.alive() and _current.overrides == overrides:
        return _current, True
    stop_server()
    _current = ServerProcess(overrides, log_path, cfg.server.health_timeout_s)
    return _current, False


def stop_server() -> None:
    """Stop the server bench started, if any (multirun end, process exit)."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None


atexit.register(stop_server)
