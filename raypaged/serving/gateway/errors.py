"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and on the routes of Anthropic's
Messages API in its shape, ``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from raypaged.inputs.limits import InputError
from raypaged.serving.channel import PARAM_METADATA_KEY

logger = logging.getLogger("raypaged")

_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("requests", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "engine_unavailable"),
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
# Anthropic's Messages API (anthropic.py): errors on its routes take its shape
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
_ANTHROPIC_PATHS = (MESSAGES_PATH, COUNT_TOKENS_PATH)
_GRPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
    grpc.StatusCode.CANCELLED: 503,
}
_MESSAGE_TOO_LARGE = "larger than max"  # gRPC's RESOURCE_EXHAUSTED details for a message over the size limit


RETRY_AFTER_S = "1"


class APIError(Exception):
    """An error answered as ``status`` with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code  # None: the status's usual code

    def body(self) -> dict:
        error_type, code = _TYPES.get(self.status, ("invalid_request_error", None))
        code = self.code or code
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": code}}

    def anthropic_body(self) -> dict:
        error_type = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error")
        return {"type": "error", "error": {"type": error_type, "message": self.message}}

    def body_at(self, path: str) -> dict:
        """The body as the route at ``path`` (``route_path``'s) answers: Anthropic's shape on the Messages API's
        routes, OpenAI's on the others."""
        return self.anthropic_body() if path in _ANTHROPIC_PATHS else self.body()

    def response(self, path: str = "") -> JSONResponse:
        """The error as the route at ``path`` answers it (``body_at``); 429 and 503 tell the client when to retry
        (``Retry-After``, seconds)."""
        headers = {"Retry-After": RETRY_AFTER_S} if self.status in (429, 503) else None
        return JSONResponse(self.body_at(path), status_code=self.status, headers=headers)


def route_path(scope: Scope) -> str:
    """The path a route matches: ``scope["path"]`` less the app's ``root_path`` when it starts with it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def from_grpc(exc: grpc.aio.AioRpcError) -> APIError:
    """The HTTP error for a failed engine call, keeping the engine's message.

    Bad input is 400 (``param`` from the ``raypaged-param`` trailing metadata), a
    refused key 401, a tenant limit 429 (a message over gRPC's size limit 413), a
    request the engine failed on 500, a lost engine 503.
    """
    code, details = exc.code(), exc.details() or ""
    status = _GRPC_STATUS.get(code)
    if status is None:
        logger.error("engine call failed: %s %s", code, details)
        return APIError(500, "the engine failed on this request")
    if status == 503:
        return APIError(503, f"the engine is unavailable: {details}")
    if status == 429 and _MESSAGE_TOO_LARGE in details:
        return APIError(413, f"the request is too large for the engine: {details}")
    if status == 500:  # the engine has logged why
        return APIError(500, details or "the engine failed on this request")
    param = "model" if status == 404 else _param(exc) if status == 400 else None
    return APIError(status, details or "bad request", param)


def from_input_error(exc: InputError) -> APIError:
    return APIError(400, str(exc), exc.param)


def _param(exc: grpc.aio.AioRpcError) -> str | None:
    for key, value in exc.trailing_metadata() or ():
        if key == PARAM_METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def install_handlers(app: FastAPI, log_error_stack: bool = False) -> None:
    """JSON for every error, shaped as its route answers (``APIError.body_at``); ``log_error_stack`` (vLLM's
    ``--log-error-stack``): each error response is logged with the stack of the exception behind it."""

    def respond(request: Request, exc: Exception, error: APIError) -> JSONResponse:
        if log_error_stack:
            logger.error("error response %d on %s: %s", error.status, request.url.path, error.message, exc_info=exc)
        return error.response(route_path(request.scope))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc, exc)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError) -> JSONResponse:
        return respond(request, exc, from_input_error(exc))

    @app.exception_handler(grpc.aio.AioRpcError)
    async def _rpc_error(request: Request, exc: grpc.aio.AioRpcError) -> JSONResponse:
        return respond(request, exc, from_grpc(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return respond(request, exc, APIError(400, f"{param}: {first.get('msg', 'invalid request')}", param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(request, exc, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return APIError(500, "internal server error").response(route_path(request.scope))
