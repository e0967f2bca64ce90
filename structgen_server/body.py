"""A request body -> its pydantic model, or a 4xx naming what is wrong and how to fix it.

The server reads request bodies itself rather than through FastAPI's body parameters, whose
errors say only "There was an error parsing the body" (bad UTF-8, JSON nested too deeply, an
integer of thousands of digits) or "Input should be a valid dictionary" (a body sent as a form,
as `curl -d` does). Here the Content-Type, the encoding, the JSON and the fields are checked
in that order, each failure a 4xx in OpenAI's error shape with a `code` and, for a field, its
plain path as `param` (`tool_choice`, not pydantic's `tool_choice.literal['none','auto']`).
"""

from __future__ import annotations

import email.message
import functools
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from structgen_server.errors import APIError

M = TypeVar("M", bound=BaseModel)

_SEND_JSON = "send the body as a JSON object with the header Content-Type: application/json"
# pydantic errors that say what type was wanted: the message adds what was sent
_TYPE_ERRORS = {"bool_type", "int_type", "float_type", "string_type", "int_from_float", "literal_error"}
# the type tags pydantic puts in an error's location for union members ("dict[str,any]",
# "literal['none','auto']", "NamedToolChoice", "str"): not fields, so not part of `param`
_UNION_TAG = re.compile(r"^[A-Z]|[\[\]\-]|^(str|int|float|bool|none|any|bytes)$")


def parse_body(content_type: str | None, body: bytes, model: type[M]) -> M:
    """The request `model` the body holds; APIError (415 or 400) when it holds none."""
    _check_content_type(content_type)
    if not body.strip():
        raise APIError(400, f"request body is missing; {_SEND_JSON}", code="invalid_json")
    data = _loads(body)
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {_json_type(data)}; {_SEND_JSON}",
                       code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False), model) from e


def _check_content_type(content_type: str | None) -> None:
    """Refuse a body not declared as JSON: a form-encoded body (`curl -d`) would otherwise be
    guessed at, and a browser cannot send application/json cross-site without CORS consent."""
    if content_type:
        message = email.message.Message()
        message["content-type"] = content_type
        subtype = message.get_content_subtype()
        if message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json")):
            return
    sent = f"Content-Type {content_type[:100]!r}" if content_type else "no Content-Type"
    raise APIError(415, f"request body sent with {sent}; {_SEND_JSON} (curl: -H 'Content-Type: application/json')",
                   code="unsupported_media_type")


def _loads(body: bytes) -> Any:
    """The body's JSON value (UTF-8, a leading BOM tolerated); a 400 naming the problem."""
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not UTF-8 (invalid byte at position {e.start}); JSON must be "
                       "sent as UTF-8", code="invalid_json") from e
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except _NotJSON as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg} at position {e.pos} (line {e.lineno} "
                       f"column {e.colno})", code="invalid_json") from e
    except RecursionError as e:
        raise APIError(400, f"request body is JSON nested too deeply (past about {sys.getrecursionlimit()} "
                       "levels of arrays and objects); flatten it", code="invalid_json") from e
    except ValueError as e:  # int(): more digits than Python converts (sys.get_int_max_str_digits)
        digits = re.search(r"value has (\d+) digits", str(e))
        raise APIError(400, f"request body holds an integer of {digits.group(1) if digits else 'too many'} "
                       f"digits, more than the {sys.get_int_max_str_digits()} this server reads; no field takes "
                       "such a number", code="invalid_json") from e


class _NotJSON(ValueError):
    """A value Python's json module reads but JSON has not (NaN, Infinity)."""


def _refuse_constant(name: str) -> Any:
    raise _NotJSON(f"{name} is not a JSON number; send a number or null")


def _json_type(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _json_preview(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_error(errors: Sequence[Mapping[str, Any]], model: type[BaseModel] | None = None) -> APIError:
    """A 400 naming the first invalid field (its plain path as `param`) and what it takes."""
    fields = _field_names(model)
    # of a union's members, the one that got deepest is the shape the client meant
    first = max(errors, key=lambda e: len(field_path(e.get("loc", ()), fields)), default=None)
    first = first or {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":  # FastAPI's own parse of a body (routes without parse_body)
        ctx = first.get("ctx") or {}
        return APIError(400, f"request body is not valid JSON: {ctx.get('error', first['msg'])}", code="invalid_json")
    loc = field_path(first.get("loc", ()), fields)
    if not loc and first.get("type") == "missing":
        return APIError(400, f"request body is missing; {_SEND_JSON}", code="invalid_json")
    param = ".".join(loc) or None
    message = _field_message(param, first)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return APIError(400, message, param=param, code="invalid_request")


def _field_message(param: str | None, error: Mapping[str, Any]) -> str:
    ctx = error.get("ctx") or {}
    if param and error.get("type") == "too_short" and ctx.get("min_length") == 1:
        return f"{param} must not be empty"
    message = f"{param}: {error['msg']}" if param else str(error["msg"])
    if param and error.get("type") in _TYPE_ERRORS:  # say what was sent: "yes" is no boolean
        message += f", got {_json_preview(error.get('input'))}"
    return message


def field_path(loc: tuple[Any, ...] | list[Any], fields: frozenset[str] = frozenset()) -> list[str]:
    """An error location as field names and list indices: FastAPI's "body" and pydantic's
    union-member tags dropped (a name in `fields` is always kept)."""
    return [str(p) for p in loc
            if p != "body" and (not isinstance(p, str) or p in fields or not _UNION_TAG.search(p))]


@functools.cache
def _field_names(model: type[BaseModel] | None) -> frozenset[str]:
    return frozenset(_names(model, set())) if model is not None else frozenset()


def _names(model: type[BaseModel], seen: set[type]) -> Iterator[str]:
    """Every field name and alias of `model` and of the models its fields hold."""
    seen.add(model)
    for name, info in model.model_fields.items():
        yield name
        if info.alias:
            yield info.alias
        for sub in _models_in(info.annotation):
            if sub not in seen:
                yield from _names(sub, seen)


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from _models_in(arg)
