"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, and the
mapping from structgen's exceptions to HTTP statuses.

A user mistake (bad schema, bad regex, prompt too long, unknown model) is a 4xx naming the
problem; only our own bugs are 5xx. Either way the error belongs to one request: the server
and the other requests in its batch carry on.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from structgen.errors import (
    InvalidConstraintError,
    InvalidParameterError,
    ModelNotFoundError,
    OutputValidationError,
    PromptTooLongError,
    RequestCancelledError,
    StructgenError,
    UnsupportedSchemaError,
    UnsupportedTypeError,
)
from structgen_server.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An error response: status, OpenAI error `type`, the offending `param`, a short `code`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


# structgen exception -> (status, code); the first matching class wins
_MAPPING: list[tuple[type[StructgenError], int, str]] = [
    (UnsupportedSchemaError, 400, "unsupported_schema"),
    (InvalidConstraintError, 400, "invalid_constraint"),
    (UnsupportedTypeError, 400, "unsupported_type"),
    (InvalidParameterError, 400, "invalid_parameter"),
    (PromptTooLongError, 400, "context_length_exceeded"),
    (ModelNotFoundError, 404, "model_not_found"),
    (RequestCancelledError, 499, "request_cancelled"),
    (OutputValidationError, 500, "output_validation_failed"),
]


def to_api_error(exc: BaseException, param: str | None = None) -> APIError:
    """The API error for any exception raised while serving a request. `param` names the
    request field the exception is about (e.g. "response_format"), where the caller knows."""
    if isinstance(exc, APIError):
        return exc
    for cls, status, code in _MAPPING:
        if isinstance(exc, cls):
            if isinstance(exc, UnsupportedSchemaError) and exc.path:
                message = f"{exc} (at {exc.path})" if exc.path not in str(exc) else str(exc)
            else:
                message = str(exc)
            error_type = "invalid_request_error" if status < 500 else "server_error"
            if status == 404:
                param = "model"
            elif isinstance(exc, PromptTooLongError):
                param = "messages"
            return APIError(status, message, type=error_type, param=param, code=code)
    if isinstance(exc, StructgenError):
        return APIError(500, str(exc), type="server_error", code="engine_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")
