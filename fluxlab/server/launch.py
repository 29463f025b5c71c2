"""`serve(cfg)`: one engine behind uvicorn, or (dp_size > 1) replicas behind sglang-router.

Both modes print exactly one line `fluxlab ready: http://HOST:PORT` on stdout once the socket
answers, and exit 0 on SIGINT/SIGTERM after stopping everything they started.

Data parallel (DESIGN §7): each replica is `python -m fluxlab serve <the same overrides>
parallel.dp_size=1 server.port=0` on 127.0.0.1, pinned to its own tp_size GPUs on CUDA. Port 0
lets the OS pick a free port with no race; the worker's ready line says which. Once every worker
answers /health, sglang-router fronts them (plus server.worker_urls, replicas on other hosts).
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:
    from fluxlab.server.shutdown import Shutdown

log = logging.getLogger("fluxlab.server")

READY_PREFIX = "fluxlab ready: "
_STOP_GRACE_S = 15.0
# sglang-router colours its console log and has no option against it; serve's log stays plain text.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def serve(cfg: DictConfig) -> None:
    """Serve until SIGINT/SIGTERM; exits non-zero when a replica or the router dies."""
    # Under parallel.enable_dp_attention, dp_size counts the attention ranks of the one engine.
    replicas = cfg.parallel.dp_size > 1 and not cfg.parallel.enable_dp_attention
    if replicas or cfg.server.worker_urls:
        code = _serve_router(cfg)
        if code:
            sys.exit(code)
        return
    _serve_single(cfg)


def _announce(host: str, port: int) -> None:
    print(f"{READY_PREFIX}http://{host}:{port}", flush=True)


# -------------------------------------------------------------------------------- one engine

def _serve_single(cfg: DictConfig) -> None:
    import uvicorn

    from fluxlab.server.app import build_app
    from fluxlab.server.client_timeouts import header_deadline_protocol
    from fluxlab.server.engine_process import EngineProcess, EngineStartError
    from fluxlab.server.shutdown import ABORT_GRACE_S

    try:  # the engine loads (in its own process) before the socket opens: the ready line means ready
        async_engine = EngineProcess(cfg, cfg.server.max_waiting_requests)
    except EngineStartError as err:
        print(f"fluxlab serve: the engine did not start: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    app = build_app(cfg, async_engine)
    http: Any = "auto"
    if cfg.server.client_read_timeout_s > 0:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        http = header_deadline_protocol(AutoHTTPProtocol, cfg.server.client_read_timeout_s)
    shutdown = app.state.shutdown
    # uvicorn cancels the responses still open after this (a plain-text 500): by then the drain ran
    # out and every request was aborted, which ends each within an engine step.
    config = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level=cfg.server.log_level,
                            access_log=cfg.server.log_level == "debug", http=http,
                            timeout_graceful_shutdown=shutdown.drain_timeout_s + ABORT_GRACE_S)
    server = _Server(config, shutdown)
    fatal: list[str] = []

    def stop_on_fatal(message: str) -> None:  # engine thread: ask uvicorn to stop, exit non-zero after
        fatal.append(message)
        server.should_exit = True

    async_engine.on_fatal = stop_on_fatal
    asyncio.run(_run_uvicorn(server, cfg.server.host))
    if fatal:
        print(f"fluxlab serve: {fatal[0]}", file=sys.stderr, flush=True)
        raise SystemExit(1)


class _Server:
    """uvicorn.Server whose signal handler starts the app's Shutdown (new requests get 503 from
    now on), whose shutdown drains and then aborts what is in flight, and which does not re-raise
    the signal after shutdown (uvicorn re-raises it, which would make the exit code -15, not 0)."""

    def __new__(cls, config: Any, stopping: Shutdown):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                    return
                self.should_exit = True
                stopping.begin()  # a flag only: this runs inside the signal handler

            async def shutdown(self, sockets: Any = None) -> None:
                await stopping.run(super().shutdown(sockets))

        return Server(config)


async def _run_uvicorn(server: Any, host: str) -> None:
    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]  # the real one when server.port=0
        _announce(host, port)

    watcher = asyncio.create_task(announce())
    try:
        await server.serve()
    except SystemExit as err:  # uvicorn exits like this when it cannot bind; it logged why
        print(f"fluxlab serve: could not listen on {host}:{server.config.port} (see the error above)",
              file=sys.stderr, flush=True)
        raise SystemExit(err.code or 1) from None
    finally:
        watcher.cancel()


# -------------------------------------------------------------------------------- replicas + router

class _Child:
    """A child process whose merged stdout/stderr we forward to our stderr with a prefix."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]):
        self.name = name
        self.ready_url: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1)
        threading.Thread(target=self._forward, daemon=True).start()

    def _forward(self) -> None:
        for line in self.proc.stdout:
            line = _ANSI_ESCAPE.sub("", line)
            if line.startswith(READY_PREFIX):
                self.ready_url.put(line[len(READY_PREFIX):].strip())
            sys.stderr.write(f"[{self.name}] {line}")
            sys.stderr.flush()

    def died(self) -> Optional[int]:
        return self.proc.poll()


def _serve_router(cfg: DictConfig) -> int:
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    children: list[_Child] = []
    try:
        base = _worker_overrides(cfg)
        gpu_sets = _gpu_sets(cfg)
        for i in range(cfg.parallel.dp_size):
            env = dict(os.environ)
            if gpu_sets is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu_sets[i]
            else:  # replicas on CPU share the cores instead of each oversubscribing all of them
                env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.parallel.dp_size)))
            argv = [sys.executable, "-m", "fluxlab", "serve", *base, *_run_dir_override(i)]
            children.append(_Child(f"dp{i}", argv, env))
            log.info("started replica dp%d (pid %d)", i, children[-1].proc.pid)
        urls = []
        for i, child in enumerate(children):
            url = _wait_worker(child, cfg.server.health_timeout_s, stopping)
            if url is None:
                return 0 if stopping.is_set() else 1
            print(f"fluxlab: replica dp{i} ready at {url} (pid {child.proc.pid})", file=sys.stderr, flush=True)
            urls.append(url)
        urls += list(cfg.server.worker_urls)

        port = cfg.server.port or _free_port()
        children.append(_Child("router", _router_argv(cfg, urls, port), dict(os.environ)))
        print(f"fluxlab: started sglang-router (pid {children[-1].proc.pid}) on port {port}", file=sys.stderr, flush=True)
        router_url = f"http://{_connect_host(cfg.server.host)}:{port}"
        if not _wait_router(children[-1], router_url, len(children) - 1, cfg.server.health_timeout_s, stopping):
            return 0 if stopping.is_set() else 1
        _announce(cfg.server.host, port)

        while not stopping.wait(0.5):
            for child in children:
                code = child.died()
                if code is not None:
                    print(f"fluxlab serve: {child.name} (pid {child.proc.pid}) exited with code {code}; "
                          "stopping the router and every replica", file=sys.stderr, flush=True)
                    return 1
        return 0
    finally:
        _stop_all(children, _STOP_GRACE_S + max(0.0, cfg.server.drain_timeout_s))


def _router_argv(cfg: DictConfig, worker_urls: list[str], port: int) -> list[str]:
    """sglang-router with the server keys it has options for."""
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--policy", cfg.server.router_policy, "--host", cfg.server.host, "--port", str(port),
            "--log-level", "info" if cfg.server.log_level == "debug" else "warn",
            # The router's own Prometheus endpoint (its default is 0.0.0.0:29000, which two
            # routers on one host would share); the replicas' fluxlab metrics are at /engine_metrics.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
    if cfg.server.max_request_body_bytes > 0:
        argv += ["--max-payload-size", str(cfg.server.max_request_body_bytes)]
    if cfg.server.api_key:
        argv += ["--api-key", cfg.server.api_key]  # the replicas need it on every route but /health
    return argv


def _wait_worker(child: _Child, timeout_s: float, stopping: threading.Event) -> Optional[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopping.is_set():
        try:
            url = child.ready_url.get(timeout=0.2)
        except queue.Empty:
            if child.died() is not None:
                print(f"fluxlab serve: replica {child.name} exited with code {child.died()} before it was ready; "
                      "see its log above", file=sys.stderr, flush=True)
                return None
            continue
        return url if _wait_healthy(child, url, deadline - time.monotonic(), stopping) else None
    if not stopping.is_set():
        print(f"fluxlab serve: replica {child.name} not ready within server.health_timeout_s={timeout_s}",
              file=sys.stderr, flush=True)
    return None


def _poll_until(child: _Child, probe: Callable[[], bool], timeout_s: float, stopping: threading.Event,
                died: str, late: str) -> bool:
    """Call probe() every 0.2 s until it is true; False (with the matching message) if the child
    dies first or the time runs out, silently False when serve is stopping anyway."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopping.is_set():
        if child.died() is not None:
            print(f"fluxlab serve: {died.format(code=child.died())}", file=sys.stderr, flush=True)
            return False
        try:
            if probe():
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    if not stopping.is_set():
        print(f"fluxlab serve: {late}", file=sys.stderr, flush=True)
    return False


def _wait_healthy(child: _Child, url: str, timeout_s: float, stopping: threading.Event) -> bool:
    import httpx

    return _poll_until(child, lambda: httpx.get(f"{url}/health", timeout=2.0).status_code == 200, timeout_s,
                       stopping, died=f"{child.name} exited with code {{code}} before answering {url}/health",
                       late=f"{child.name} at {url} not healthy within {timeout_s:.0f}s")


def _wait_router(router: _Child, url: str, num_local: int, timeout_s: float, stopping: threading.Event) -> bool:
    """The router answers /health before it has registered any worker (that runs in the
    background); /readiness counts the healthy ones, so wait until it sees every local replica."""
    import httpx

    def ready() -> bool:
        response = httpx.get(f"{url}/readiness", timeout=2.0)
        return response.status_code == 200 and response.json().get("healthy_workers", 0) >= num_local

    return _poll_until(router, ready, timeout_s, stopping,
                       died="sglang-router exited with code {code}; see its log above",
                       late=f"sglang-router at {url} did not see {num_local} healthy replicas within {timeout_s:.0f}s")


def _stop_all(children: list[_Child], grace_s: float) -> None:
    """SIGTERM to each, then SIGKILL to whatever is left after grace_s (a replica drains first)."""
    # Router first, so nothing new reaches a replica that is shutting down.
    for child in reversed(children):
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in reversed(children):
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def _worker_overrides(cfg: DictConfig) -> list[str]:
    """The command line's overrides, minus what differs per replica, plus the replica's own."""
    owned = ("server.port", "server.host", "server.worker_urls", "parallel.dp_size", "hydra.run.dir",
             "server.behind_router")
    try:
        from hydra.core.hydra_config import HydraConfig

        given = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under @hydra.main (called from Python): pin every resolved key instead
        given = _flatten(cfg)
    kept = [o for o in given if o.lstrip("+~").split("=", 1)[0] not in owned]
    return kept + ["parallel.dp_size=1", "server.port=0", "server.host=127.0.0.1", "server.worker_urls=[]",
                   "server.behind_router=true"]


def _run_dir_override(index: int) -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return [f"hydra.run.dir={HydraConfig.get().runtime.output_dir}/dp{index}"]
    except ValueError:
        return []


def _flatten(cfg: DictConfig) -> list[str]:
    import json

    out = []

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out.append(f"{prefix}{key}={json.dumps(value)}")

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def _gpu_sets(cfg: DictConfig) -> Optional[list[str]]:
    """CUDA_VISIBLE_DEVICES per replica: tp_size consecutive visible GPUs each; None on CPU."""
    if not str(cfg.engine.device).startswith("cuda"):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        import torch

        gpus = [str(i) for i in range(torch.cuda.device_count())]
    per, dp = cfg.parallel.tp_size, cfg.parallel.dp_size
    if per * dp > len(gpus):
        raise SystemExit(f"parallel.dp_size={dp} x parallel.tp_size={per} needs {per * dp} GPUs; {len(gpus)} visible")
    return [",".join(gpus[i * per:(i + 1) * per]) for i in range(dp)]


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
