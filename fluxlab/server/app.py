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

No `from __future__ import annotations` here: the request bodies' models are built per served model
inside build_app, and FastAPI resolves a string annotation in the module's globals only.
"""
import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from omegaconf import DictConfig, OmegaConf
from starlette.exceptions import HTTPException as StarletteHTTPException

from fluxlab.engine.request import InvalidRequest, RequestOutput, SamplingParams
from fluxlab.server.async_engine import AsyncEngine, EngineDead, Overloaded
from fluxlab.server.auth import ApiKeyGuard
from fluxlab.server.body_limit import BodySizeLimit
from fluxlab.server.client_timeouts import BodyReadTimeout
from fluxlab.server.metrics import ServerMetrics
from fluxlab.server.openapi import error_responses, install_openapi
from fluxlab.server.output_text import StreamText, final_text
from fluxlab.server.prompts import PromptEncoder
from fluxlab.server.protocol import (ChatCompletionResponse, CompletionResponse, ModelList, ServerError, error_body,
                                     request_models, served_fields)
from fluxlab.server.shutdown import RefuseWhileStopping, Shutdown

log = logging.getLogger("fluxlab.server")

# What sglang-router puts in `model` when a chat request has none.
_ROUTER_NO_MODEL = "unknown"

# One server-sent event (OpenAPI 3.1: the schema of text/event-stream describes each event):
# `data` is a JSON chunk, an error object, or the terminator `[DONE]`.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE]"}, "event": {"type": "string"},
                   "id": {"type": "string"}, "retry": {"type": "integer"}}}}}

# How often a handler waiting on the engine checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25


def build_app(cfg: DictConfig, async_engine: AsyncEngine) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it. `app.state.shutdown` is what
    serve's SIGTERM handling drives (503 for new requests, then the drain and abort)."""
    served_name: str = cfg.server.served_model_name or cfg.model.name
    model_names = {served_name, cfg.model.name} | ({cfg.model.path} if cfg.model.path else set())
    metrics = ServerMetrics(async_engine, served_name)
    tokenizer = async_engine.tokenizer
    prompts = PromptEncoder(tokenizer, async_engine.max_model_len, cfg.server.parse_special_tokens_in_chat)
    created = int(time.time())
    root = _model_root(cfg)
    # The served model's decoder and knobs only: its OpenAPI document lists what it accepts.
    CompletionRequest, ChatCompletionRequest = request_models(served_fields(cfg, vocab_size=len(tokenizer)))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        prompts.shutdown()

    app = FastAPI(title="fluxlab", lifespan=lifespan)
    shutdown = Shutdown(cfg.server.drain_timeout_s, async_engine.abort_all, async_engine.abort)
    app.state.async_engine, app.state.metrics, app.state.shutdown = async_engine, metrics, shutdown
    # Pure ASGI guards, innermost first: each answers before the body is parsed (the last added
    # runs first). Not dependencies: those run after FastAPI has read and parsed the body.
    rejected = metrics.observe_rejected
    app.add_middleware(BodySizeLimit, max_bytes=cfg.server.max_request_body_bytes, on_reject=rejected)
    app.add_middleware(ApiKeyGuard, api_key=cfg.server.api_key, on_reject=rejected)
    app.add_middleware(RefuseWhileStopping, shutdown=shutdown, on_reject=rejected)
    app.add_middleware(BodyReadTimeout, timeout_s=cfg.server.client_read_timeout_s, on_reject=rejected)
    install_openapi(app)

    # ------------------------------------------------------------------ errors (OpenAI shape)

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, err: ServerError) -> JSONResponse:
        metrics.observe_rejected(err.status)
        return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(err)
        metrics.observe_rejected(400)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed",
                408: "request_timeout"}.get(err.status_code)
        metrics.observe_rejected(err.status_code)
        # err.headers carries a 405's `Allow`, a 408's `Connection: close`
        return JSONResponse(error_body(str(err.detail), kind, None, code), status_code=err.status_code,
                            headers=err.headers)

    api_errors = error_responses(400, 401, 404, 413, 503)

    # ------------------------------------------------------------------ helpers

    def check_model(model: Optional[str]) -> None:
        if model == _ROUTER_NO_MODEL and cfg.server.behind_router:
            return  # sglang-router fills a chat request without `model` with this name
        if model is not None and model not in model_names:
            raise ServerError(404, f"the model {model!r} does not exist; this server serves {served_name!r}",
                              param="model", code="model_not_found")

    async def submit(request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        try:
            out_queue = await async_engine.add(request_id, prompt_ids, params)
        except InvalidRequest as err:
            raise ServerError(400, str(err), param=err.param)
        except Overloaded as err:
            raise ServerError(503, str(err), type="server_error", code="overloaded")
        except EngineDead as err:
            raise ServerError(503, str(err), type="server_error", code="engine_unavailable")
        shutdown.abort_if_stopped(request_id)
        return out_queue

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
            if last.finish_reason == "abort":  # the server shut down under it
                metrics.observe_aborted("shutdown")
            else:
                metrics.observe_finished(first_time - arrival, time.perf_counter() - arrival,
                                         last.stats.tokens_per_forward, last.finish_reason, len(prompt_ids))
            return _usage(len(prompt_ids), last)

        def client_gone() -> None:
            async_engine.abort(request_id)
            metrics.observe_aborted("client_disconnected")

        async def stream() -> AsyncIterator[str]:
            text, first_time, done = StreamText(tokenizer, params.stop), None, False
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
                        metrics.observe_failed()
                        yield _sse(error_body(str(item), "server_error", None, "engine_error"))
                        break
                    first_time = first_time or time.perf_counter()
                    delta = await prompts.run(text.delta, item)
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
                    client_gone()

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
                    metrics.observe_failed()
                    return JSONResponse(error_body(str(item), "server_error", None, "engine_error"), status_code=500)
                first_time = first_time or time.perf_counter()
                if item.finished:
                    done = True
                    usage = finish(item, first_time)
                    text = item.text if item.text is not None else await prompts.run(final_text, tokenizer, item)
                    return JSONResponse(make_response(text, item, usage))
        finally:
            if not done:  # also when this handler is cancelled
                client_gone()

    def _max_tokens(asked: Optional[int], prompt_ids: list[int]) -> Optional[int]:
        # Unset max_tokens means "the default, or whatever room is left" (as vLLM does), not a 400
        # for a long prompt; an explicit value too large for the context stays the client's error.
        if asked is not None:
            return asked
        room = async_engine.max_model_len - len(prompt_ids)
        return min(cfg.model.max_new_tokens, room) if room >= 1 else None

    # ------------------------------------------------------------------ OpenAI endpoints

    @app.post("/v1/completions", responses={
        200: {"model": CompletionResponse, "description": "A completion, or with `stream: true` its chunks as SSE",
              "content": _SSE}, **api_errors})
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt_ids = await prompts.completion_ids(body.prompt)
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

    @app.post("/v1/chat/completions", responses={
        200: {"model": ChatCompletionResponse, "description": "A chat completion, or with `stream: true` its chunks "
              "as SSE", "content": _SSE}, **api_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        prompt_ids = await prompts.chat_ids(body)
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

    @app.get("/v1/models", response_model=None,
             responses={200: {"model": ModelList}, **error_responses(401)})
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": served_name, "object": "model", "created": created, "owned_by": "fluxlab",
            "root": root, "max_model_len": async_engine.max_model_len}]}

    # ------------------------------------------------------------------ operations

    @app.get("/health", responses={200: {"content": {"application/json": {"schema": {"type": "object"}}}},
                                   503: {"description": "The engine stopped",
                                         "content": {"application/json": {"schema": {"type": "object"}}}}})
    async def health() -> JSONResponse:
        if async_engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "error": async_engine.error}, status_code=503)

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text exposition format",
              "content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(401)})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/get_load", responses=error_responses(401))
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

    @app.get("/model_info", responses=error_responses(401))
    @app.get("/get_model_info", responses=error_responses(401))
    async def model_info() -> dict:
        # sglang-router asks for this when it registers a worker. No model_path on purpose: the
        # router would try to load a tokenizer from it, which HTTP routing does not need.
        return {"served_model_name": served_name, "is_generation": True, "max_model_len": async_engine.max_model_len}

    @app.get("/server_info", responses=error_responses(401))
    async def server_info() -> dict:
        config = OmegaConf.to_container(cfg, resolve=True)
        if config.get("server", {}).get("api_key"):
            config["server"]["api_key"] = "***"  # the resolved config is public; the key is not
        return {"served_model_name": served_name, "max_model_len": async_engine.max_model_len,
                "kv_total_pages": async_engine.snapshot.kv_total_pages, "config": config}

    return app


def _model_root(cfg: DictConfig) -> str:
    """vLLM's `root`: the local folder the weights and tokenizer came from (the embedded model's
    cache folder too); the configured path or name for random weights without files."""
    from fluxlab.engine.llm_engine import resolve_model_dir

    try:
        model_dir = resolve_model_dir(cfg.model)
    except ValueError:
        model_dir = None
    return str(model_dir.resolve()) if model_dir is not None else (cfg.model.path or cfg.model.name)


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


# ---------------------------------------------------------------------- response pieces

def _usage(prompt_tokens: int, last: RequestOutput) -> dict:
    stats = last.stats
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(last.token_ids),
            "total_tokens": prompt_tokens + len(last.token_ids),
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "fluxlab": {"forwards": stats.forwards, "tokens_accepted": stats.tokens_accepted,
                        "tokens_edited": stats.tokens_edited,
                        "tokens_per_forward": round(stats.tokens_per_forward, 4),
                        "blocks": stats.blocks_committed, "preemptions": stats.preemptions,
                        "timed_out": stats.timed_out}}  # ended by server.request_timeout_s


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
    # pydantic names the union member that failed ("constrained-str", "list[int]"): not a field
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    if first.get("type") == "json_invalid" or first.get("type") == "model_attributes_type":
        return f"the body is not a valid JSON object: {first.get('msg')}", None
    if first.get("type") == "missing" and not loc:
        return "the request needs a JSON body", None
    param = loc[0] if loc else None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = ".".join(loc)
    return (f"{where}: {msg}" if where and not msg.startswith(where) else msg), param


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and any(c in part for c in "[-")
