"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, and the
mapping from structgen's exceptions to HTTP statuses.

Every `StructgenError` is a 4xx naming the problem (bad schema, bad regex, prompt too long,
unknown model...), but `EngineError` (a forward pass or grammar step failed inside the engine),
which like any exception not ours is a 500 whose body carries only a request id, the exception
itself going to the server log under that id. Either way the error belongs to one
request: the server and the other requests in its batch carry on.
"""

from __future__ import annotations

import functools
import logging
import uuid
from typing import Any

from fastapi.responses import JSONResponse

from structgen.errors import (
    CompilerBusyError,
    ConstraintTooLargeError,
    EngineBusyError,
    EngineError,
    InvalidConstraintError,
    InvalidParameterError,
    ModelNotFoundError,
    OutputValidationError,
    PromptTooLongError,
    RequestCancelledError,
    StructgenError,
    UnsatisfiableConstraintError,
    UnsupportedSchemaError,
    UnsupportedTypeError,
)
from structgen_server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("structgen.server")


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
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        # A client's lone surrogate ("\ud800") echoed in a message cannot be UTF-8: escape it.
        self.message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword arguments: pickle's default would call APIError(message) (the engine link)
        kw = {"type": self.type, "param": self.param, "code": self.code, "headers": self.headers}
        return (functools.partial(APIError, **kw), (self.status, self.message))

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


# The `structgen serve` flag of each limit a ConstraintTooLargeError names (its message names
# the library's setting, which a client of the server cannot reach).
SERVE_FLAGS = {"max_source_bytes": "--max-constraint-bytes", "max_depth": "--max-constraint-depth",
               "max_enum_values": "--max-enum-values", "compile_timeout": "--compile-timeout"}

# structgen exception -> (status, code); the first matching class wins, StructgenError last
_MAPPING: list[tuple[type[StructgenError], int, str]] = [
    (UnsupportedSchemaError, 400, "unsupported_schema"),
    (UnsatisfiableConstraintError, 400, "unsatisfiable_constraint"),
    (ConstraintTooLargeError, 400, "constraint_too_large"),
    (InvalidConstraintError, 400, "invalid_constraint"),
    (UnsupportedTypeError, 400, "unsupported_type"),
    (InvalidParameterError, 400, "invalid_parameter"),
    (PromptTooLongError, 400, "context_length_exceeded"),
    (ModelNotFoundError, 404, "model_not_found"),
    (CompilerBusyError, 503, "compiler_busy"),
    (EngineBusyError, 503, "server_busy"),
    (RequestCancelledError, 499, "request_cancelled"),
    # the request's own constraint let through text it does not accept (a keyword enforced
    # only in part): the request can be fixed, the server is fine
    (OutputValidationError, 422, "output_validation_failed"),
    (StructgenError, 400, "invalid_request"),
]


def to_api_error(exc: BaseException, param: str | None = None) -> APIError:
    """The API error for any exception raised while serving a request. `param` names the
    request field the exception is about (e.g. "response_format"), where the caller knows.
    An exception that is not ours is logged here, with the request id its 500 names."""
    if isinstance(exc, APIError):
        return exc
    for cls, status, code in _MAPPING:
        if isinstance(exc, cls) and not isinstance(exc, EngineError):
            if isinstance(exc, UnsupportedSchemaError) and exc.path:
                message = f"{exc} (at {exc.path})" if exc.path not in str(exc) else str(exc)
            elif isinstance(exc, ConstraintTooLargeError) and exc.limit in SERVE_FLAGS:
                message = (f"{exc.problem}; {exc.remedy} (the limit is this server's: "
                           f"structgen serve {SERVE_FLAGS[exc.limit]} sets it)")
            else:
                message = str(exc)
            if status == 404:
                param = "model"
            elif isinstance(exc, PromptTooLongError):
                param = "messages"
            retry = {"retry-after": "1"} if status == 503 else None  # busy: a moment frees room
            return APIError(status, message, param=param, code=code, headers=retry)
    request_id = new_request_id()
    log.error("request %s failed", request_id, exc_info=exc)
    return APIError(
        500,
        f"internal server error (request id {request_id}); the server log has the details "
        "under that id",
        type="server_error",
        code="internal_error",
    )


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:16]}"
