"""One request in flight, as its handler sees it: handed to the engine, its outputs awaited while
the client is watched, its end recorded in the metrics, aborted when nobody waits for it any more."""
from __future__ import annotations

import asyncio
import time
from typing import Optional

from fastapi import Request

from fluxlab.engine.request import InvalidRequest, RequestOutput, SamplingParams
from fluxlab.server.async_engine import EngineDead, Overloaded
from fluxlab.server.protocol import ServerError
from fluxlab.server.response_shapes import usage
from fluxlab.server.served_model import ServedModel

# How often a handler waiting on the engine checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25


class Generation:
    def __init__(self, served: ServedModel, request: Request, request_id: str, prompt_ids: list[int],
                 out_queue: asyncio.Queue, arrival: float):
        self.served, self.request_id, self.prompt_ids = served, request_id, prompt_ids
        self.out_queue, self.arrival = out_queue, arrival
        self.first_output_time: Optional[float] = None
        self.ended = False  # finished or failed: nothing left to abort
        self.watch = _ClientWatch(request)

    @classmethod
    async def start(cls, served: ServedModel, request: Request, request_id: str, prompt_ids: list[int],
                    params: SamplingParams) -> "Generation":
        """Queues the request; a refusal raises the ServerError its answer is."""
        arrival = time.perf_counter()
        out_queue = await _submit(served, request_id, prompt_ids, params)
        return cls(served, request, request_id, prompt_ids, out_queue, arrival)

    async def next_output(self) -> Optional[RequestOutput | BaseException]:
        """The next output, or None once the client has gone away (checked even while outputs flow)."""
        while not await self.watch.gone():
            try:
                item = await asyncio.wait_for(self.out_queue.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
            if self.first_output_time is None and not isinstance(item, BaseException):
                self.first_output_time = time.perf_counter()
            return item
        return None

    def finish(self, last: RequestOutput) -> dict:
        """Records the end of a finished request; returns the usage its answer reports."""
        self.ended = True
        if last.finish_reason == "abort":  # the server shut down under it
            self.served.metrics.observe_aborted("shutdown")
        else:
            self.served.metrics.observe_finished(self.first_output_time - self.arrival,
                                                 time.perf_counter() - self.arrival,
                                                 last.stats.tokens_per_forward, last.finish_reason,
                                                 len(self.prompt_ids))
        return usage(len(self.prompt_ids), last)

    def fail(self) -> None:
        self.ended = True
        self.served.metrics.observe_failed()

    def close(self) -> None:
        """Once the answer is over, however it ended: a request that has not ended lost its client
        (or its handler was cancelled), so the engine stops working on it."""
        if not self.ended:
            self.served.async_engine.abort(self.request_id)
            self.served.metrics.observe_aborted("client_disconnected")


async def _submit(served: ServedModel, request_id: str, prompt_ids: list[int],
                  params: SamplingParams) -> asyncio.Queue:
    try:
        out_queue = await served.async_engine.add(request_id, prompt_ids, params)
    except InvalidRequest as err:
        raise ServerError(400, str(err), param=err.param)
    except Overloaded as err:
        raise ServerError(503, str(err), type="server_error", code="overloaded")
    except EngineDead as err:
        raise ServerError(503, str(err), type="server_error", code="engine_unavailable")
    served.shutdown.abort_if_stopped(request_id)
    return out_queue


class _ClientWatch:
    """Asks the server whether the client is still connected, at most every _DISCONNECT_POLL_S."""

    def __init__(self, request: Request):
        self.request, self.last_check = request, time.monotonic()

    async def gone(self) -> bool:
        now = time.monotonic()
        if now - self.last_check < _DISCONNECT_POLL_S:
            return False
        self.last_check = now
        return await self.request.is_disconnected()
