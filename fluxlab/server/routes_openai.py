"""The OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models (DESIGN §9).

Streaming sends one SSE chunk per committed block. fluxlab extensions, all optional:
- body fields overriding the decoding keys for one request: decoder, threshold, editing_threshold,
  low_threshold, steps, max_post_steps, top_k, ignore_eos (temperature, top_p, seed, stop as in OpenAI);
- `return_token_ids: true` adds `token_ids` (output ids) to each choice;
- `usage.fluxlab` = {forwards, tokens_per_forward, blocks, preemptions}: `forwards` counts the
  model forwards that computed this request's blocks, the number a decoding knob (threshold,
  steps) moves. With the openai client: `response.usage.model_extra["fluxlab"]["forwards"]`.

A request's way: its body -> prompt ids and SamplingParams (`completion_input`, `chat_input`) ->
`replies.reply` (the engine, then SSE or JSON) shaped by `response_shapes`.

No `from __future__ import annotations` here: the request bodies' models are built per served model
(`openai_router`'s arguments), and FastAPI resolves a string annotation in the module's globals only.
"""
from typing import Optional

from fastapi import APIRouter, Request

from fluxlab.engine.request import SamplingParams
from fluxlab.server.openapi import error_responses
from fluxlab.server.protocol import ChatFields, CompletionFields, ServerError
from fluxlab.server.response_models import ChatCompletionResponse, CompletionResponse, ModelList
from fluxlab.server.replies import reply
from fluxlab.server.response_shapes import ChatShape, CompletionShape
from fluxlab.server.served_model import Served, ServedModel

# What sglang-router puts in `model` when a chat request has none.
_ROUTER_NO_MODEL = "unknown"

# One server-sent event (OpenAPI 3.1: the schema of text/event-stream describes each event):
# `data` is a JSON chunk, an error object, or the terminator `[DONE]`.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE]"}, "event": {"type": "string"},
                   "id": {"type": "string"}, "retry": {"type": "integer"}}}}}

_API_ERRORS = error_responses(400, 401, 404, 413, 503)


def openai_router(CompletionRequest: type[CompletionFields], ChatCompletionRequest: type[ChatFields]) -> APIRouter:
    """The routes, their bodies being the served model's request models (`protocol.request_models`)."""
    router = APIRouter()

    @router.post("/v1/completions", responses={
        200: {"model": CompletionResponse, "description": "A completion, or with `stream: true` its chunks as SSE",
              "content": _SSE}, **_API_ERRORS})
    async def completions(body: CompletionRequest, request: Request, served: Served):
        prompt_ids, params = await completion_input(served, body)
        return await reply(served, request, prompt_ids, params, body.stream, CompletionShape.of(body, served.name))

    @router.post("/v1/chat/completions", responses={
        200: {"model": ChatCompletionResponse, "description": "A chat completion, or with `stream: true` its chunks "
              "as SSE", "content": _SSE}, **_API_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request, served: Served):
        prompt_ids, params = await chat_input(served, body)
        return await reply(served, request, prompt_ids, params, body.stream, ChatShape.of(body, served.name))

    @router.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **error_responses(401)})
    async def models(served: Served) -> dict:
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": served.created, "owned_by": "fluxlab",
            "root": served.root, "max_model_len": served.async_engine.max_model_len}]}

    return router


async def completion_input(served: ServedModel, body: CompletionFields) -> tuple[list[int], SamplingParams]:
    """A completion body as the engine takes it: prompt ids and sampling parameters."""
    _check_model(served, body.model)
    prompt_ids = await served.prompts.completion_ids(body.prompt)
    return prompt_ids, body.sampling_params(_max_tokens(served, body.max_tokens, prompt_ids))


async def chat_input(served: ServedModel, body: ChatFields) -> tuple[list[int], SamplingParams]:
    """A chat body as the engine takes it: the templated conversation's ids and sampling parameters."""
    _check_model(served, body.model)
    problem = body.tool_problem()
    if problem:
        raise ServerError(400, problem[1], param=problem[0])
    prompt_ids = await served.prompts.chat_ids(body)
    return prompt_ids, body.sampling_params(_max_tokens(served, body.max_completion_tokens or body.max_tokens,
                                                        prompt_ids))


def _check_model(served: ServedModel, model: Optional[str]) -> None:
    if model == _ROUTER_NO_MODEL and served.cfg.server.behind_router:
        return  # sglang-router fills a chat request without `model` with this name
    if model is not None and model not in served.known_names:
        raise ServerError(404, f"the model {model!r} does not exist; this server serves {served.name!r}",
                          param="model", code="model_not_found")


def _max_tokens(served: ServedModel, asked: Optional[int], prompt_ids: list[int]) -> Optional[int]:
    # Unset max_tokens means "the default, or whatever room is left" (as vLLM does), not a 400
    # for a long prompt; an explicit value too large for the context stays the client's error.
    if asked is not None:
        return asked
    room = served.async_engine.max_model_len - len(prompt_ids)
    return min(served.cfg.model.max_new_tokens, room) if room >= 1 else None
