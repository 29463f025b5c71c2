"""The OpenAI-compatible FastAPI app around an AsyncEngine (DESIGN §9).

Endpoints: /v1/completions, /v1/chat/completions, /v1/models (routes_openai.py, which also lists
fluxlab's extensions of the request and usage bodies), /health, /metrics, /server_info, /get_load,
/model_info, /get_model_info (routes_admin.py). Errors answer in OpenAI's shape (errors.py).
Routes reach the engine through the app's ServedModel (served_model.py).
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import FastAPI
from omegaconf import DictConfig

from fluxlab.server import routes_admin
from fluxlab.server.async_engine import AsyncEngine
from fluxlab.server.auth import ApiKeyGuard
from fluxlab.server.body_limit import BodySizeLimit
from fluxlab.server.client_timeouts import BodyReadTimeout
from fluxlab.server.errors import install_error_handlers
from fluxlab.server.openapi import install_openapi
from fluxlab.server.protocol import request_models
from fluxlab.server.served_fields import served_fields
from fluxlab.server.routes_openai import openai_router
from fluxlab.server.served_model import ServedModel
from fluxlab.server.shutdown import RefuseWhileStopping, Shutdown


def build_app(cfg: DictConfig, async_engine: AsyncEngine) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it. `app.state.shutdown` is what
    serve's SIGTERM handling drives (503 for new requests, then the drain and abort)."""
    served = ServedModel.build(cfg, async_engine)
    # The served model's decoder and knobs only: its OpenAPI document lists what it accepts.
    CompletionRequest, ChatCompletionRequest = request_models(served_fields(cfg, vocab_size=len(served.tokenizer)))
    app = FastAPI(title="fluxlab", lifespan=_lifespan)
    app.state.served, app.state.shutdown = served, served.shutdown
    _add_guards(app, cfg, served.shutdown, served.metrics.observe_rejected)
    install_openapi(app)
    install_error_handlers(app)
    app.include_router(openai_router(CompletionRequest, ChatCompletionRequest))
    app.include_router(routes_admin.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    served = app.state.served
    served.async_engine.start()
    yield
    await asyncio.get_running_loop().run_in_executor(None, served.async_engine.shutdown)
    served.prompts.shutdown()


def _add_guards(app: FastAPI, cfg: DictConfig, shutdown: Shutdown, rejected: Callable[[int], None]) -> None:
    # Pure ASGI guards, innermost first: each answers before the body is parsed (the last added
    # runs first). Not dependencies: those run after FastAPI has read and parsed the body.
    app.add_middleware(BodySizeLimit, max_bytes=cfg.server.max_request_body_bytes, on_reject=rejected)
    app.add_middleware(ApiKeyGuard, api_key=cfg.server.api_key, on_reject=rejected)
    app.add_middleware(RefuseWhileStopping, shutdown=shutdown, on_reject=rejected)
    app.add_middleware(BodyReadTimeout, timeout_s=cfg.server.client_read_timeout_s, on_reject=rejected)
