"""The engine loop on a background thread, fed by HTTP handlers on the event loop.

The engine is not thread-safe, so exactly one thread (ours) calls it. Handlers talk to it through a
command queue (add, abort, stop); the thread hands each request's outputs back on that request's
asyncio.Queue via loop.call_soon_threadsafe. Counters the HTTP side reads (/metrics, /get_load)
come from a snapshot the thread refreshes after every step, so a scrape never touches the engine.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from fluxlab.engine.request import EngineFatalError, InvalidRequest, RequestOutput, SamplingParams
from fluxlab.server.shutdown import start_blind_to_stop_signals

log = logging.getLogger("fluxlab.server")

# How long the idle loop sleeps on the command queue; bounds shutdown latency, costs nothing busy.
_IDLE_WAIT_S = 0.05


class Overloaded(Exception):
    """More requests are waiting than server.max_waiting_requests allows (HTTP 503)."""


class RequestFailed(Exception):
    """The engine failed one request (a step raised for its row alone); the others go on (HTTP 500)."""


class EngineDead(Exception):
    """The engine loop stopped (a crash or shutdown); the request cannot be served."""


@dataclass
class EngineSnapshot:
    num_waiting: int = 0
    num_running: int = 0
    kv_free_pages: int = 0
    kv_total_pages: int = 0
    total_forwards: int = 0
    total_generated_tokens: int = 0
    total_step_seconds: float = 0.0
    total_host_seconds: float = 0.0  # of those, host work the GPU waited for
    graph_forwards: int = 0  # forwards that replayed a CUDA graph
    forwards_launched_ahead: int = 0  # forwards launched before the last step's postprocess (async scheduling)
    kv_cached_pages: int = 0  # pages holding prefix-cache blocks (the unreferenced ones count as free)
    prefix_cache_queried_blocks: int = 0
    prefix_cache_hit_blocks: int = 0


class _Stream:
    """Where one request's outputs go: the handler's queue on the handler's loop, and the future
    its handler awaits until the engine took (or refused) the request."""

    __slots__ = ("loop", "queue", "accepted")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()

    def put(self, item: Any) -> None:
        self._call(self.queue.put_nowait, item)

    def accept(self, err: Optional[BaseException]) -> None:
        """Settle the handler's wait: None when the engine queued the request, else its error."""
        self._call(_settle, self.accepted, err)

    def _call(self, fn: Callable, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed (shutdown); nobody is listening anymore
            pass


class AsyncEngine:
    def __init__(self, engine: Any, max_waiting_requests: int):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.snapshot = EngineSnapshot()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0  # enqueued, not yet seen by the engine: they count as waiting
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fluxlab-engine", daemon=True)
        self._stopped = threading.Event()
        self.error: Optional[str] = None
        self.on_fatal: Optional[Callable[[str], None]] = None  # the server stops itself when the engine cannot go on
        self._refresh_snapshot()

    # ------------------------------------------------------------------ called from the event loop

    def start(self) -> None:
        start_blind_to_stop_signals(self._thread)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    @property
    def num_waiting(self) -> int:
        return self.snapshot.num_waiting + self._pending_adds

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request; returns its output queue once the engine accepted it.

        Raises InvalidRequest (400), Overloaded (503) or EngineDead (503).
        """
        check_room(self)
        stream = _Stream(asyncio.get_running_loop())
        with self._pending_lock:
            self._pending_adds += 1
        self._commands.put(("add", request_id, prompt_ids, params, stream))
        return await accepted_queue(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        self._commands.put(("abort_all",))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort everything in flight, stop the loop and release the engine."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout_s)

    @staticmethod
    async def outputs(out_queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """A request's outputs until (and including) the finished one; EngineDead if the loop died."""
        while True:
            item = await out_queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                if not self._drain_commands(block=not busy):
                    break
                if self.engine.has_unfinished():
                    try:
                        self._step()
                    except EngineFatalError as err:
                        # No later step can succeed (a tensor-parallel rank is gone): stop serving.
                        self.error = f"engine stopped: {err}"
                        log.critical("%s", self.error)
                        self._fail_all(EngineDead(self.error))
                        if self.on_fatal is not None:
                            self.on_fatal(self.error)
                        break
                    except Exception as err:  # noqa: BLE001
                        self._recover(err)
        except BaseException as err:  # noqa: BLE001 - the loop must report, not vanish
            log.exception("engine loop crashed")
            self.error = f"engine loop crashed: {type(err).__name__}: {err}"
            self._fail_all(EngineDead(self.error))
        finally:
            self._stopped.set()
            self._drain_after_stop()
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001
                log.exception("engine shutdown failed")

    def _drain_commands(self, block: bool) -> bool:
        """Apply every queued command; False once asked to stop."""
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                if command[1] in self._streams:
                    self.engine.abort_request(command[1])
            elif kind == "abort_all":
                for request_id in list(self._streams):
                    self.engine.abort_request(request_id)
            elif kind == "stop":
                self._abort_and_finish()
                return False
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._refresh_snapshot()
                return True

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stream: _Stream) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except Exception as err:  # noqa: BLE001 - any add failure belongs to this request only
            if not isinstance(err, InvalidRequest):
                log.exception("add_request failed")
            stream.accept(err)
        else:
            self._streams[request_id] = stream
            stream.accept(None)
        finally:
            with self._pending_lock:
                self._pending_adds -= 1

    def _step(self) -> None:
        for output in self.engine.step():
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            if output.finish_reason == "error":  # the engine failed this request alone (its step raised)
                stream.put(RequestFailed(f"the engine could not run this request: {output.error}"))
            else:
                stream.put(output)
        self._refresh_snapshot()

    def _recover(self, err: Exception) -> None:
        """A step failed: fail the requests in flight (500), free them, keep serving new ones."""
        log.exception("engine step failed; aborting %d in-flight requests", len(self._streams))
        failed = list(self._streams)
        self._fail_all(EngineDead(f"engine step failed: {type(err).__name__}: {err}"))
        for request_id in failed:
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort after a failed step failed")

    def _abort_and_finish(self) -> None:
        """Shutdown: every in-flight request ends with finish_reason "abort" and frees its pages."""
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        deadline = time.monotonic() + 10.0
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            self._step()
        self._fail_all(EngineDead("the server is shutting down"))

    def _drain_after_stop(self) -> None:
        # Adds that raced with stop: tell their handlers instead of leaving them waiting forever.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                with self._pending_lock:
                    self._pending_adds -= 1
                command[4].accept(EngineDead("the server is shutting down"))

    def _fail_all(self, err: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put(err)
        self._streams.clear()

    def _refresh_snapshot(self) -> None:
        e = self.engine
        self.snapshot = EngineSnapshot(
            num_waiting=e.num_waiting, num_running=e.num_running, kv_free_pages=e.kv_free_pages,
            kv_total_pages=e.kv_total_pages, total_forwards=e.total_forwards,
            total_generated_tokens=e.total_generated_tokens, total_step_seconds=e.total_step_seconds,
            total_host_seconds=getattr(e, "total_host_seconds", 0.0),
            graph_forwards=getattr(e, "graph_forwards", 0),
            forwards_launched_ahead=getattr(e, "total_launched_ahead", 0), kv_cached_pages=getattr(e, "kv_cached_pages", 0),
            prefix_cache_queried_blocks=getattr(e, "prefix_cache_queried_blocks", 0),
            prefix_cache_hit_blocks=getattr(e, "prefix_cache_hit_blocks", 0))


def check_room(engine: Any) -> None:
    """Refuse a new request to a stopped engine (EngineDead) or a full queue (Overloaded)."""
    if not engine.alive:
        raise EngineDead(engine.error or "the engine is not running")
    if engine.num_waiting >= engine.max_waiting_requests:
        raise Overloaded(f"server overloaded: {engine.num_waiting} requests waiting "
                         f"(server.max_waiting_requests={engine.max_waiting_requests}); retry later")


async def accepted_queue(engine: Any, request_id: str, stream: _Stream) -> asyncio.Queue:
    """The stream's queue once the engine took its add (raises what add_request raised)."""
    try:
        await stream.accepted
    except asyncio.CancelledError:
        engine.abort(request_id)  # the client left while we queued; commands are FIFO: after the add
        raise
    return stream.queue


def _settle(future: asyncio.Future, err: Optional[BaseException]) -> None:
    if future.done():  # the handler went away (client disconnected while queued)
        return
    if err is None:
        future.set_result(None)
    else:
        future.set_exception(err)
