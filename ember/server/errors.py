"""OpenAI-style errors: every failure answers `{"error": {message, type, param, code}}`.

A 400 from the request schema names the field in `param` as a dotted path (`messages.0.role`;
the union forms pydantic puts in its paths, such as `list[int]`, are left out) and says
the allowed range, in the words SamplingParams uses for the same parameter.

The Anthropic Messages API (`/v1/messages`) answers in Anthropic's shape instead,
`{"type": "error", "error": {"type", "message"}}` (the field named in the message), with
the same status codes; `error_body_for(path, ...)` picks the shape by path, for the
middleware and the router, which answer before any handler. An Anthropic-shaped error
carries its ember code (`engine_not_running`, ...) in the `x-ember-error-code` header.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember.sampling_params import BOUNDS

logger = logging.getLogger("ember.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


# the code of a 503 that refused a request before starting it (a router may retry it)
ENGINE_NOT_RUNNING = "engine_not_running"
# the code of a stream's error event when its engine stopped mid-way (died, or the server
# is shutting down): a router moves the stream to another worker
ENGINE_STOPPED = "engine_stopped"
# a connection over --max-connections (its 503): the process is busy, not down
TOO_MANY_CONNECTIONS = "too_many_connections"

MESSAGES_PATH = "/v1/messages"  # the Anthropic Messages API: errors in Anthropic's shape
RESPONSES_PATH = "/v1/responses"
ERROR_CODE_HEADER = "x-ember-error-code"  # an Anthropic-shaped error's ember code

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    @classmethod
    def bad_request(cls, exc: ValueError) -> APIError:
        """A 400 from an engine ValueError, whose message starts with the parameter."""
        message = str(exc)
        match = re.match(r"([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*)\b", message)
        return cls(400, message, match.group(1) if match else None, "invalid_value")

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_code_of(content: bytes, headers=None) -> str | None:
    """The ember code of an error answer: in ERROR_CODE_HEADER (an Anthropic-shaped body
    has no place for it), else the `error.code` of its OpenAI error body."""
    if headers is not None and (code := headers.get(ERROR_CODE_HEADER)) is not None:
        return code
    try:
        code = json.loads(content)["error"]["code"]
    except (ValueError, TypeError, KeyError):
        return None
    return code if isinstance(code, str) else None


def error_body_for(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    """The error body in the shape of the API that `path` belongs to."""
    if path == MESSAGES_PATH:
        return anthropic_error_body(status, message)
    return error_body(status, message, param, code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(400, "malformed JSON body", None, "invalid_json"), 400)
        param, message = describe(first)
        return JSONResponse(error_body(400, message, param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        body = error_body_for(request.url.path, exc.status_code, str(exc.detail))
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError):
        return JSONResponse(error_body(400, f"malformed JSON body: {exc}"), status_code=400)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body_for(request.url.path, 500, "internal error"), 500)


_NAME = re.compile(r"[a-z_][a-z0-9_]*|[0-9]+")  # field names, dict keys of token ids
_FORMS = {"str", "int", "float", "bool", "none"}  # union members pydantic names in paths
_OPS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def describe(error: dict) -> tuple[str | None, str]:
    """(param, message) for one pydantic error of a request body."""
    loc = [part for part in error.get("loc", ()) if part != "body"]
    path = [
        str(part)
        for part in loc
        if isinstance(part, int) or (_NAME.fullmatch(part) and part not in _FORMS)
    ]
    param = ".".join(path) or None
    kind, value = error.get("type", ""), error.get("input")
    shown = _short(value)
    if kind in _OPS and param in BOUNDS:
        return param, f"{param} must be in {BOUNDS[param]}, got {shown}"
    if kind in _OPS:
        bound = next(iter(error.get("ctx", {}).values()), "?")
        return param, f"{param} must be {_OPS[kind]} {bound}, got {shown}"
    if kind == "finite_number":
        return param, f"{param} must be a finite number, got {shown}"
    text = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return param, f"{param or 'body'}: {text}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
