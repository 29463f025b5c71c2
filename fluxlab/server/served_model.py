"""What every route reads: the served model, its engine, prompt encoder, metrics and shutdown state.

One `ServedModel` per app, on `app.state.served`; a route asks for it with the `Served` dependency
rather than closing over build_app's locals, so the routes live in modules of their own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from omegaconf import DictConfig

from fluxlab.server.async_engine import AsyncEngine
from fluxlab.server.metrics import ServerMetrics
from fluxlab.server.prompts import PromptEncoder
from fluxlab.server.shutdown import Shutdown


@dataclass
class ServedModel:
    cfg: DictConfig
    async_engine: AsyncEngine
    name: str  # what /v1/models lists and every answer's `model` says
    known_names: set[str]  # what a request's `model` may say
    created: int  # /v1/models' `created`: when the server started
    root: str
    prompts: PromptEncoder
    metrics: ServerMetrics
    shutdown: Shutdown  # what serve's SIGTERM handling drives (503 for new requests, then the drain and abort)

    @classmethod
    def build(cls, cfg: DictConfig, async_engine: AsyncEngine) -> "ServedModel":
        name: str = cfg.server.served_model_name or cfg.model.name
        known_names = {name, cfg.model.name} | ({cfg.model.path} if cfg.model.path else set())
        metrics = ServerMetrics(async_engine, name)
        prompts = PromptEncoder(async_engine.tokenizer, async_engine.max_model_len,
                                cfg.server.parse_special_tokens_in_chat)
        created = int(time.time())
        shutdown = Shutdown(cfg.server.drain_timeout_s, async_engine.abort_all, async_engine.abort)
        return cls(cfg, async_engine, name, known_names, created, _model_root(cfg), prompts, metrics, shutdown)

    @property
    def tokenizer(self) -> Any:
        return self.async_engine.tokenizer


def served_model(request: Request) -> ServedModel:
    return request.app.state.served


# A route's parameter `served: Served` is the app's ServedModel.
Served = Annotated[ServedModel, Depends(served_model)]


def _model_root(cfg: DictConfig) -> str:
    """vLLM's `root`: the local folder the weights and tokenizer came from (the embedded model's
    cache folder too); the configured path or name for random weights without files."""
    from fluxlab.engine.loading import resolve_model_dir

    try:
        model_dir = resolve_model_dir(cfg.model)
    except ValueError:
        model_dir = None
    return str(model_dir.resolve()) if model_dir is not None else (cfg.model.path or cfg.model.name)
