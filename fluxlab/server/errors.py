"""Every error answer in OpenAI's shape: {"error": {message, type, param, code}}.

A validation failure is a 400 naming the body field (not FastAPI's 422); routing's 404/405 and the
guards' 408/413 come through the HTTP handler. Each refusal is counted in the metrics.
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fluxlab.server.protocol import ServerError, error_body
from fluxlab.server.served_model import served_model

_HTTP_CODES = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout"}


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServerError, _server_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


async def _server_error(request: Request, err: ServerError) -> JSONResponse:
    served_model(request).metrics.observe_rejected(err.status)
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status)


async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    message, param = _describe_validation(err)
    served_model(request).metrics.observe_rejected(400)
    return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)


async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if err.status_code < 500 else "server_error"
    served_model(request).metrics.observe_rejected(err.status_code)
    # err.headers carries a 405's `Allow`, a 408's `Connection: close`
    return JSONResponse(error_body(str(err.detail), kind, None, _HTTP_CODES.get(err.status_code)),
                        status_code=err.status_code, headers=err.headers)


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
