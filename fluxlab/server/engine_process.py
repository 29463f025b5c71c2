"""The engine loop in its own process, behind AsyncEngine's interface.

In one process the engine thread shares the GIL with uvicorn's event loop and the detokenizing
threads, and every streamed chunk they handle delays the engine's host work between two forwards
(docs/benchmarks.md §14: a served FDFO step spent 1.1-1.45 ms on the host against ~0.6 ms alone).
Here the child process runs AsyncEngine's own loop (the same commands, failure isolation and
shutdown) over a pipe: the server sends add / abort / stop, the child sends back batches of events
(a request accepted or refused, an output or an error for its stream) with the counters snapshot,
once per step. vLLM's engine core and SGLang's scheduler process are the same split.
"""
from __future__ import annotations

import asyncio
import cProfile
import logging
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from typing import Any, Callable, Optional

from fluxlab.config.compose import resolved
from fluxlab.engine.request import RequestOutput, SamplingParams
from fluxlab.server.async_engine import AsyncEngine, EngineDead, _Stream, accepted_queue, check_room
from fluxlab.server.shutdown import start_blind_to_stop_signals

log = logging.getLogger("fluxlab.server")

_STOP_GRACE_S = 30.0


class EngineStartError(RuntimeError):
    """The engine process could not build the engine; the message is its error."""


class EngineProcess:
    """AsyncEngine's interface (add, abort, outputs, snapshot, alive, shutdown) over a child process
    that owns the engine. Construction blocks until the engine is loaded, like make_engine."""

    outputs = staticmethod(AsyncEngine.outputs)

    def __init__(self, cfg: Any, max_waiting_requests: int):
        self.max_waiting_requests = max_waiting_requests
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=run_engine_process, name="fluxlab-engine", daemon=False,
                                        args=(resolved(cfg), child_conn, max_waiting_requests, cfg.server.log_level))
        self._process.start()
        child_conn.close()
        from transformers.dynamic_module_utils import init_hf_modules

        init_hf_modules()  # a remote-code tokenizer class unpickles from transformers_modules
        try:
            ready = self._conn.recv()  # the tokenizer comes pickled: the engine's own, whatever loaded it
        except EOFError:
            self._process.join(5)
            raise EngineStartError(f"the engine process exited while loading (exit code {self._process.exitcode})")
        except BaseException:
            self._process.kill()
            raise
        if ready[0] == "failed":
            self._process.join(_STOP_GRACE_S)
            _, user_error, message = ready
            # a bad path or a model that does not fit: the CLI prints the message (exit 2), as in process
            raise (ValueError if user_error else EngineStartError)(message)
        _, self.max_model_len, self.tokenizer, self.snapshot = ready
        self.error: Optional[str] = None
        self.on_fatal: Optional[Callable[[str], None]] = None
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # _streams, _pending_adds and the pipe's send side
        self._pending_adds = 0
        self._stopping = False
        self._stopped = threading.Event()
        self._reader = threading.Thread(target=self._read, name="fluxlab-engine-events", daemon=True)

    # ------------------------------------------------------------------ called from the event loop

    def start(self) -> None:
        start_blind_to_stop_signals(self._reader)

    @property
    def alive(self) -> bool:
        return not self._stopped.is_set() and self._process.is_alive()

    @property
    def num_waiting(self) -> int:
        return self.snapshot.num_waiting + self._pending_adds

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """As AsyncEngine.add: the output queue once the engine took the request; raises
        InvalidRequest (400), Overloaded (503) or EngineDead (503)."""
        check_room(self)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            self._streams[request_id] = stream
            self._pending_adds += 1
        self._send(("add", request_id, prompt_ids, params))
        return await accepted_queue(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        self._send(("abort_all",))

    def shutdown(self, timeout_s: float = _STOP_GRACE_S) -> None:
        """Abort everything in flight, stop the child's loop and wait for it to release the engine."""
        self._stopping = True
        self._send(("stop",))
        self._process.join(timeout_s)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s; killing it", timeout_s)
            self._process.kill()  # it ignores SIGTERM
            self._process.join(5)
        if self._reader.is_alive():
            self._reader.join(5)
        self._conn.close()

    def _send(self, command: tuple) -> None:
        with self._lock:
            try:
                self._conn.send(command)
            except (OSError, ValueError):  # the child is gone; _read reports it
                pass

    # ------------------------------------------------------------------ the event reader thread

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "events":
                    self._dispatch(message[1])
                    self.snapshot = message[2]
                elif message[0] == "fatal":
                    self._die(message[1], fatal=True)
                elif message[0] == "stopped":
                    break
        except (EOFError, OSError):
            pass
        if not self._stopped.is_set():
            unexpected = not self._stopping
            self._process.join(5)  # the pipe closes before the child is reaped: wait for its exit code
            self._die(self.error or f"the engine process exited (exit code {self._process.exitcode})",
                      fatal=unexpected)

    def _dispatch(self, events: list[tuple[str, str, Any]]) -> None:
        with self._lock:
            for kind, request_id, payload in events:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                if kind == "accept":
                    self._pending_adds -= 1
                    stream.accept(payload)
                    if payload is not None:
                        del self._streams[request_id]
                    continue
                stream.put(payload)
                if not isinstance(payload, RequestOutput) or payload.finished:
                    del self._streams[request_id]

    def _die(self, error: str, fatal: bool) -> None:
        """No later request can be served: fail every stream and, when nobody asked for it, the server."""
        self.error = error
        self._stopped.set()
        with self._lock:
            streams, self._streams = self._streams, {}
            self._pending_adds = 0
        dead = EngineDead(error)
        for stream in streams.values():
            stream.accept(dead)  # a handler still waiting for its add
            stream.put(dead)
        if fatal:
            log.critical("%s", error)
            if self.on_fatal is not None:
                self.on_fatal(error)


# ---------------------------------------------------------------------- the child process

class _RemoteStream:
    """A request's stream in the child: what the loop puts on it becomes an event for the server."""

    __slots__ = ("request_id", "events")

    def __init__(self, request_id: str, events: list):
        self.request_id, self.events = request_id, events

    def put(self, item: Any) -> None:
        self.events.append(("put", self.request_id, item))

    def accept(self, err: Optional[BaseException]) -> None:
        self.events.append(("accept", self.request_id, err))


class _PipeCommands:
    """The loop's command queue (get / get_nowait, queue.Empty when none) read off the pipe."""

    def __init__(self, conn: Any, events: list):
        self.conn, self.events = conn, events
        self.server_gone = False

    def get(self, timeout: Optional[float] = None) -> tuple:
        if self.server_gone:  # after the one stop it became: nothing more will come
            raise queue.Empty
        try:
            if not self.conn.poll(timeout):
                raise queue.Empty
            command = self.conn.recv()
        except (EOFError, OSError):  # the server process is gone: stop
            self.server_gone = True
            return ("stop",)
        if command[0] == "add":
            return (*command, _RemoteStream(command[1], self.events))
        return command

    def get_nowait(self) -> tuple:
        return self.get(0)


class _ChildLoop(AsyncEngine):
    """AsyncEngine's loop, run on the child's main thread, with its streams on the pipe."""

    def __init__(self, engine: Any, max_waiting_requests: int, conn: Any):
        self._conn = None
        self._events: list = []
        super().__init__(engine, max_waiting_requests)
        self._conn = conn
        self._commands = _PipeCommands(conn, self._events)
        self.on_fatal = lambda message: self._conn.send(("fatal", message))

    def _refresh_snapshot(self) -> None:  # after every step and command batch: ship what happened
        super()._refresh_snapshot()
        self.flush()

    def flush(self) -> None:
        if self._conn is None:
            return
        events, self._events[:] = list(self._events), []
        self._conn.send(("events", events, self.snapshot))


def run_engine_process(cfg: Any, conn: Any, max_waiting_requests: int, log_level: str = "info") -> None:
    """The child's main: build the engine, report ready (or why not), run the loop until stopped."""
    from fluxlab.engine.factory import make_engine

    # Ctrl-C reaches the whole process group, and so does systemd's stop (KillMode=control-group):
    # the server stops us through the pipe (in-flight requests end cleanly), and a server that is
    # gone closes the pipe, which stops us as well.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = make_engine(cfg)
    except BaseException as err:  # noqa: BLE001 - the server reports it and exits non-zero
        user_error = isinstance(err, (ValueError, FileNotFoundError)) and not os.environ.get("FLUXLAB_DEBUG")
        if not user_error:
            traceback.print_exc()
        conn.send(("failed", user_error, str(err) if user_error else f"{type(err).__name__}: {err}"))
        conn.close()
        return
    loop = _ChildLoop(engine, max_waiting_requests, conn)
    conn.send(("ready", engine.max_model_len, engine.tokenizer, loop.snapshot))
    # FLUXLAB_ENGINE_PROFILE=dir: a cProfile of the whole engine loop, written at stop to
    # dir/engine_<pid>.prof: the served engine's host time is spent in this process, where a
    # profiler of the server process does not see it.
    profile_dir = os.environ.get("FLUXLAB_ENGINE_PROFILE")
    profiler = cProfile.Profile() if profile_dir else None
    try:
        if profiler is not None:
            profiler.enable()
        loop._run()  # returns once stopped; it shut the engine down
        if profiler is not None:
            profiler.disable()
            os.makedirs(profile_dir, exist_ok=True)
            profiler.dump_stats(os.path.join(profile_dir, f"engine_{os.getpid()}.prof"))
        loop.flush()
        conn.send(("stopped",))
    except (OSError, EOFError):  # the server process is gone
        pass
    finally:
        conn.close()
