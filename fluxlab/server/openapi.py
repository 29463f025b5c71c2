"""The OpenAPI document as the server behaves: 400 (not FastAPI's 422) with the OpenAI error shape.

FastAPI documents a 422 with its own validation body for every route with a body; our handler
answers those with 400 in the OpenAI shape, so the document is rewritten to say so, and the
error statuses each route can answer are listed with the error schema.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from fluxlab.server.response_models import ErrorResponse

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_DESCRIPTIONS = {"400": "Bad request (the OpenAI error shape; `param` names the field)", "401": "Missing or wrong API key",
                 "404": "Unknown model", "413": "Request body too large",
                 "503": "Overloaded, engine unavailable, or shutting down"}


def error_responses(*statuses: int) -> dict[int, dict]:
    """`responses=` entries for the error statuses a route can answer."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[str(s)]} for s in statuses}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses.setdefault("400", {"description": _DESCRIPTIONS["400"],
                                                     "content": {"application/json": {"schema": _ERROR_REF}}})
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
