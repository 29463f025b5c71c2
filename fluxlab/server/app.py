"""The OpenAI-compatible FastAPI app around an AsyncEngine (DESIGN §9).

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /server_info,
/get_load. Streaming sends one SSE chunk per committed block.

fluxlab extensions, all optional:
- body fields overriding the decoding keys for one request: decoder, threshold, editing_threshold,
  low_threshold, steps, max_post_steps, top_k, ignore_eos (temperature, top_p, seed, stop as in OpenAI);
- `return_token_ids: true` adds `token_ids` (output ids) to each choice;
- `usage.fluxlab` = {forwards, tokens_per_forward, blocks, preemptions}: `forwards` counts the
  model forwards that computed this request's blocks, the number a decoding knob (threshold,
  steps) moves. With the openai client: `response.usage.model_extra["fluxlab"]["forwards"]`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from omegaconf import DictConfig, OmegaConf
from starlette.exceptions import HTTPException as StarletteHTTPException

from fluxlab.engine.chat import encode_chat, encode_text
from fluxlab.engine.request import InvalidRequest, RequestOutput, SamplingParams
from fluxlab.server.async_engine import AsyncEngine, EngineDead, Overloaded
from fluxlab.server.metrics import ServerMetrics
from fluxlab.server.protocol import ChatCompletionRequest, CompletionRequest, ServerError, error_body

log = logging.getLogger("fluxlab.server")

# How often a handler waiting on the engine checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25


def build_app(cfg: DictConfig, async_engine: AsyncEngine) -> FastAPI:
    """The app; its lifespan starts the engine thread and, on shutdown, aborts what is in flight."""
    served_name: str = cfg.server.served_model_name or cfg.model.name
    model_names = {served_name, cfg.model.name} | ({cfg.model.path} if cfg.model.path else set())
    api_key: Optional[str] = cfg.server.api_key
    metrics = ServerMetrics(async_engine, served_name)
    tokenizer = async_engine.tokenizer
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    app = FastAPI(title="fluxlab", lifespan=lifespan)
    app.state.async_engine, app.state.metrics = async_engine, metrics

    # ------------------------------------------------------------------ errors (OpenAI shape)

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, err: ServerError) -> JSONResponse:
        return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(err)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(err.detail), kind), status_code=err.status_code)

    async def require_key(request: Request) -> None:
        # A dependency, not a BaseHTTPMiddleware: that wrapper hides client disconnects from the
        # handler. Only the API is guarded: routers and Prometheus probe /health and /metrics keyless.
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ServerError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")

    guarded = [Depends(require_key)]

    # ------------------------------------------------------------------ helpers

    def check_model(model: Optional[str]) -> None:
        if model is not None and model not in model_names:
            raise ServerError(404, f"the model {model!r} does not exist; this server serves {served_name!r}",
                              param="model", code="model_not_found")

    async def submit(request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        try:
            return await async_engine.add(request_id, prompt_ids, params)
        except InvalidRequest as err:
            raise ServerError(400, str(err), param=err.param)
        except Overloaded as err:
            raise ServerError(503, str(err), type="server_error", code="overloaded")
        except EngineDead as err:
            raise ServerError(503, str(err), type="server_error", code="engine_unavailable")

    async def next_output(out_queue: asyncio.Queue, watch: "_ClientWatch") -> Optional[RequestOutput | BaseException]:
        """The next output, or None once the client has gone away (checked even while outputs flow)."""
        while not await watch.gone():
            try:
                return await asyncio.wait_for(out_queue.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
        return None

    async def run(request_id: str, prompt_ids: list[int], params: SamplingParams, body: Any, request: Request,
                  make_chunk, make_response) -> Response:
        """Common path of both endpoints. The request is queued first, so a rejected one is a plain
        JSON error even when it asked for a stream."""
        arrival = time.perf_counter()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        out_queue = await submit(request_id, prompt_ids, params)
        watch = _ClientWatch(request)

        def finish(last: RequestOutput, first_time: float) -> dict:
            metrics.observe_finished(first_time - arrival, time.perf_counter() - arrival,
                                     last.stats.tokens_per_forward, last.finish_reason or "abort", len(prompt_ids))
            return _usage(len(prompt_ids), last)

        async def stream() -> AsyncIterator[str]:
            detok, first_time, done = _Detokenizer(tokenizer), None, False
            try:
                first = make_chunk(None, None, None, include_usage, first=True)
                if first is not None:
                    yield _sse(first)
                while True:
                    item = await next_output(out_queue, watch)
                    if item is None:
                        return  # client gone: `finally` aborts
                    if isinstance(item, BaseException):
                        done = True
                        yield _sse(error_body(str(item), "server_error", None, "engine_error"))
                        break
                    first_time = first_time or time.perf_counter()
                    delta = detok.delta(item)
                    # A client that asked for token ids gets every committed block, also one whose
                    # text is still empty (a partial character, or special tokens).
                    if delta or item.finished or (body.return_token_ids and item.new_token_ids):
                        ids = item.new_token_ids if body.return_token_ids else None
                        yield _sse(make_chunk(delta, item.finish_reason, ids, include_usage))
                    if item.finished:
                        done = True
                        usage = finish(item, first_time)
                        if include_usage:
                            yield _sse(make_chunk(None, None, None, include_usage, usage=usage))
                        break
                yield "data: [DONE]\n\n"
            finally:
                if not done:
                    async_engine.abort(request_id)

        if body.stream:
            return StreamingResponse(stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        first_time, done = None, False
        try:
            while True:
                item = await next_output(out_queue, watch)
                if item is None:
                    return Response(status_code=499)  # nobody reads it; `finally` aborts
                if isinstance(item, BaseException):
                    done = True
                    raise ServerError(500, str(item), type="server_error", code="engine_error")
                first_time = first_time or time.perf_counter()
                if item.finished:
                    done = True
                    usage = finish(item, first_time)
                    text = _Detokenizer(tokenizer).delta(item)
                    return JSONResponse(make_response(text, item, usage))
        finally:
            if not done:  # also when this handler is cancelled
                async_engine.abort(request_id)

    def _max_tokens(asked: Optional[int], prompt_ids: list[int]) -> Optional[int]:
        # Unset max_tokens means "the default, or whatever room is left" (as vLLM does), not a 400
        # for a long prompt; an explicit value too large for the context stays the client's error.
        if asked is not None:
            return asked
        room = async_engine.max_model_len - len(prompt_ids)
        return min(cfg.model.max_new_tokens, room) if room >= 1 else None

    # ------------------------------------------------------------------ OpenAI endpoints

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt_ids = _prompt_ids(tokenizer, body.prompt)
        params = body.sampling_params(_max_tokens(body.max_tokens, prompt_ids))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())

        def chunk(text, finish_reason, ids, include_usage, first=False, usage=None) -> Optional[dict]:
            if first:
                return None  # completions have no role chunk
            choices = [] if usage is not None else [_choice({"text": text or "", "logprobs": None}, finish_reason, ids)]
            out = {"id": request_id, "object": "text_completion", "created": now, "model": served_name,
                   "choices": choices}
            if include_usage:
                out["usage"] = usage
            return out

        def response(text: str, last: RequestOutput, usage: dict) -> dict:
            ids = last.token_ids if body.return_token_ids else None
            return {"id": request_id, "object": "text_completion", "created": now, "model": served_name,
                    "choices": [_choice({"text": text, "logprobs": None}, last.finish_reason, ids)],
                    "usage": usage}

        return await run(request_id, prompt_ids, params, body, request, chunk, response)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        prompt_ids = _chat_prompt_ids(tokenizer, body)
        params = body.sampling_params(_max_tokens(body.max_completion_tokens or body.max_tokens, prompt_ids))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())

        def chunk(text, finish_reason, ids, include_usage, first=False, usage=None) -> dict:
            if usage is not None:
                choices = []
            elif first:  # OpenAI's first chunk carries the role and no content
                choices = [_choice({"delta": {"role": "assistant", "content": ""}, "logprobs": None}, None, None)]
            else:
                choices = [_choice({"delta": {"content": text or ""}, "logprobs": None}, finish_reason, ids)]
            out = {"id": request_id, "object": "chat.completion.chunk", "created": now, "model": served_name,
                   "choices": choices}
            if include_usage:
                out["usage"] = usage
            return out

        def response(text: str, last: RequestOutput, usage: dict) -> dict:
            ids = last.token_ids if body.return_token_ids else None
            message = {"role": "assistant", "content": text}
            return {"id": request_id, "object": "chat.completion", "created": now, "model": served_name,
                    "choices": [_choice({"message": message, "logprobs": None}, last.finish_reason, ids)],
                    "usage": usage}

        return await run(request_id, prompt_ids, params, body, request, chunk, response)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": served_name, "object": "model", "created": created, "owned_by": "fluxlab",
            "root": cfg.model.path or cfg.model.name, "max_model_len": async_engine.max_model_len}]}

    # ------------------------------------------------------------------ operations

    @app.get("/health")
    async def health() -> JSONResponse:
        if async_engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "error": async_engine.error}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/get_load")
    async def get_load() -> list[dict]:
        snap, waiting = async_engine.snapshot, async_engine.num_waiting
        page_size = cfg.engine.page_size or cfg.decoding.block_length
        # sglang's shape (one entry per DP rank), which sglang-router reads for power_of_two routing;
        # the KV and counter fields are fluxlab's.
        return [{"dp_rank": 0, "num_reqs": snap.num_running + waiting, "num_waiting_reqs": waiting,
                 "num_running_reqs": snap.num_running,
                 "num_tokens": (snap.kv_total_pages - snap.kv_free_pages) * page_size,
                 "kv_free_pages": snap.kv_free_pages, "kv_total_pages": snap.kv_total_pages,
                 "total_forwards": snap.total_forwards, "total_generated_tokens": snap.total_generated_tokens,
                 "kv_cached_pages": snap.kv_cached_pages,
                 "prefix_cache_hit_rate": (snap.prefix_cache_hit_blocks / snap.prefix_cache_queried_blocks
                                           if snap.prefix_cache_queried_blocks else 0.0)}]

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        # sglang-router asks for this when it registers a worker. No model_path on purpose: the
        # router would try to load a tokenizer from it, which HTTP routing does not need.
        return {"served_model_name": served_name, "is_generation": True, "max_model_len": async_engine.max_model_len}

    @app.get("/server_info")
    async def server_info() -> dict:
        config = OmegaConf.to_container(cfg, resolve=True)
        if config.get("server", {}).get("api_key"):
            config["server"]["api_key"] = "***"  # the resolved config is public; the key is not
        return {"served_model_name": served_name, "max_model_len": async_engine.max_model_len,
                "kv_total_pages": async_engine.snapshot.kv_total_pages, "config": config}

    return app


# ---------------------------------------------------------------------- tokenization

def _check_text(text: str, param: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ServerError(400, f"{param} is not valid UTF-8 (lone surrogate)", param=param)
    return text


def _prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        # Special tokens are parsed (a pre-templated prompt keeps its role markers); a literal
        # `<|mask|>` becomes a prompt token, which the engine never decodes over (prompt is fixed).
        ids = encode_text(tokenizer, _check_text(prompt, "prompt"))
    else:
        vocab = len(tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ServerError(400, f"prompt token ids {bad[:5]} outside the vocabulary [0, {vocab})", param="prompt")
        ids = list(prompt)
    if not ids:
        raise ServerError(400, "prompt is empty", param="prompt")
    return ids


def _chat_prompt_ids(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": _check_text(m.text(), "messages")} for m in body.messages]
    try:
        ids = encode_chat(tokenizer, messages)
    except Exception as err:  # noqa: BLE001 - a template refusing these messages is a client error
        raise ServerError(400, f"the chat template rejected these messages: {err}", param="messages")
    if not ids:
        raise ServerError(400, "messages give an empty prompt", param="messages")
    return ids


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


class _Detokenizer:
    """Text deltas for streaming: decode everything so far, hold back an unfinished UTF-8 character."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.sent = tokenizer, ""

    def delta(self, output: RequestOutput) -> str:
        if output.finished and output.text is not None:
            full = output.text  # the engine's own cut (stop strings)
        else:
            full = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
            if not output.finished:
                full = full.rstrip("\ufffd")  # a byte-level BPE token split a character across blocks
        if full.startswith(self.sent):
            delta = full[len(self.sent):]
        else:  # cannot happen with prefix-stable decoding; send the unseen tail
            common = 0
            while common < min(len(full), len(self.sent)) and full[common] == self.sent[common]:
                common += 1
            delta = full[common:]
        self.sent = full
        return delta


# ---------------------------------------------------------------------- response pieces

def _usage(prompt_tokens: int, last: RequestOutput) -> dict:
    stats = last.stats
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(last.token_ids),
            "total_tokens": prompt_tokens + len(last.token_ids),
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "fluxlab": {"forwards": stats.forwards, "tokens_accepted": stats.tokens_accepted,
                        "tokens_per_forward": round(stats.tokens_per_forward, 4),
                        "blocks": stats.blocks_committed, "preemptions": stats.preemptions}}


def _choice(fields: dict, finish_reason: Optional[str], token_ids: Optional[list[int]]) -> dict:
    choice = {"index": 0, **fields, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _describe_validation(err: RequestValidationError) -> tuple[str, Optional[str]]:
    """First pydantic error as `param: message`, param being the body field it is about."""
    errors = err.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid" or first.get("type") == "model_attributes_type":
        return f"the body is not a valid JSON object: {first.get('msg')}", None
    if first.get("type") == "missing" and not loc:
        return "the request needs a JSON body", None
    param = loc[0] if loc else None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = ".".join(loc)
    return (f"{where}: {msg}" if where and not msg.startswith(where) else msg), param
