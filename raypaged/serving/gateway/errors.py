"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("raypaged")

_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("requests", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "engine_unavailable"),
}
_GRPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 413,
}


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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def from_grpc(exc: grpc.aio.AioRpcError) -> APIError:
    """The HTTP error for a failed engine call: bad input stays 400/404, a lost engine is 503."""
    status = _GRPC_STATUS.get(exc.code(), 500)
    if status == 500:
        logger.error("engine call failed: %s %s", exc.code(), exc.details())
        return APIError(500, "the engine failed on this request")
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return APIError(503, f"the engine is unavailable: {exc.details()}")
    if status == 413:
        return APIError(413, f"the request is too large for the engine: {exc.details()}")
    return APIError(status, exc.details() or "bad request", "model" if status == 404 else None)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(grpc.aio.AioRpcError)
    async def _rpc_error(request: Request, exc: grpc.aio.AioRpcError) -> JSONResponse:
        return from_grpc(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return APIError(400, f"{param}: {first.get('msg', 'invalid request')}", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return APIError(500, "internal server error").response()
