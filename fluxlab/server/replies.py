"""A generation's outputs as the HTTP answer: server-sent events, one chunk per committed block,
or one JSON body once the request has finished."""
from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fluxlab.engine.request import SamplingParams
from fluxlab.server.generation import Generation
from fluxlab.server.output_text import StreamText, final_text
from fluxlab.server.protocol import error_body
from fluxlab.server.response_shapes import ReplyShape
from fluxlab.server.served_model import ServedModel

_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def reply(served: ServedModel, request: Request, prompt_ids: list[int], params: SamplingParams,
                stream: bool, shape: ReplyShape) -> Response:
    """The request is queued first, so a rejected one is a plain JSON error even when it asked for a stream."""
    generation = await Generation.start(served, request, shape.request_id, prompt_ids, params)
    if stream:
        return StreamingResponse(_events(served, generation, params, shape), media_type="text/event-stream",
                                 headers=_STREAM_HEADERS)
    return await _json_reply(served, generation, shape)


async def _events(served: ServedModel, generation: Generation, params: SamplingParams,
                  shape: ReplyShape) -> AsyncIterator[str]:
    text = StreamText(served.tokenizer, params.stop)
    try:
        first = shape.first_chunk()
        if first is not None:
            yield _sse(first)
        while True:
            item = await generation.next_output()
            if item is None:
                return  # client gone: `finally` aborts
            if isinstance(item, BaseException):
                generation.fail()
                yield _sse(_engine_error(item))
                break
            delta = await served.prompts.run(text.delta, item)
            # A client that asked for token ids gets every committed block, also one whose
            # text is still empty (a partial character, or special tokens).
            if delta or item.finished or (shape.return_token_ids and item.new_token_ids):
                chunk = shape.chunk(delta, item)
                if chunk is not None:
                    yield _sse(chunk)
            if item.finished:
                usage = generation.finish(item)
                if shape.include_usage:
                    yield _sse(shape.usage_chunk(usage))
                break
        yield "data: [DONE]\n\n"
    finally:
        generation.close()


async def _json_reply(served: ServedModel, generation: Generation, shape: ReplyShape) -> Response:
    try:
        while True:
            item = await generation.next_output()
            if item is None:
                return Response(status_code=499)  # nobody reads it; `finally` aborts
            if isinstance(item, BaseException):
                generation.fail()
                return JSONResponse(_engine_error(item), status_code=500)
            if item.finished:
                usage = generation.finish(item)
                text = item.text if item.text is not None else await served.prompts.run(final_text, served.tokenizer,
                                                                                        item)
                return JSONResponse(shape.response(text, item, usage))
    finally:
        generation.close()  # also when this handler is cancelled


def _engine_error(err: BaseException) -> dict:
    return error_body(str(err), "server_error", None, "engine_error")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
