"""One request -> one structgen output type.

A request may constrain its output through OpenAI's `response_format` or through the names
other servers use (vLLM's `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar` and
`structured_outputs`, SGLang's top-level `regex`/`ebnf`/`json_schema`, and `response_format`
types `regex`/`grammar`/`choice`). At most one may be given; tools (when `tool_choice` is not
"none") replace it with the tool-call constraint from `structgen.tool_format`.

`response_format.json_schema.strict` has OpenAI's meaning: `true` closes every object that does
not say otherwise (`additionalProperties: false`), `false` lets the schema use keywords no
grammar backend enforces (generated best effort, validated afterwards); left out, the schema is
enforced exactly as written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from structgen import tool_format
from structgen.errors import StructgenError
from structgen.types import CFG, Choice, JsonSchema, Regex, close_objects
from structgen_server.errors import APIError, to_api_error
from structgen_server.protocol import ChatCompletionRequest, ResponseFormat, SamplingFields


@dataclass
class RequestConstraint:
    """What a request asked for: the output type (None: free text), the request field it came
    from (for error messages), the tool setup when the turn may call tools, and whether
    keywords no backend enforces are refused (`strict`, as `to_constraint` takes it)."""

    output_type: Any = None
    param: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: tool_format.ToolChoice | None = None
    strict: bool = True


def _json_schema(value: dict[str, Any] | str | bool, param: str) -> JsonSchema:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise APIError(400, f"{param} is not valid JSON: {e}", param=param, code="invalid_json_schema") from e
    if not isinstance(value, dict | bool):
        raise APIError(400, f"{param} must be a JSON Schema object", param=param, code="invalid_json_schema")
    return JsonSchema(value)


def _choice(options: list[str], param: str) -> Choice:
    if not options:
        raise APIError(400, f"{param} needs at least one option", param=param, code="invalid_choice")
    return Choice(list(options))


# response_format type -> the fields it reads; a field of another type would be ignored
_FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "text": (), "json_object": (), "json_schema": ("json_schema",), "regex": ("regex", "pattern"),
    "grammar": ("grammar", "syntax"), "ebnf": ("grammar", "syntax"), "lark": ("grammar", "syntax"),
    "choice": ("choices", "choice"),
}  # fmt: skip
_FORMAT_OF_FIELD = {"json_schema": "json_schema", "regex": "regex", "pattern": "regex", "grammar": "grammar",
                    "syntax": "grammar", "choices": "choice", "choice": "choice"}


def _check_format_fields(rf: ResponseFormat) -> None:
    """Refuse a response_format field its type does not read (`{"type": "json_object",
    "json_schema": ...}` would silently drop the schema)."""
    for name, meant in _FORMAT_OF_FIELD.items():
        if getattr(rf, name) is not None and name not in _FORMAT_FIELDS[rf.type]:
            raise APIError(
                400,
                f"response_format type {rf.type!r} does not read `{name}`, which would be ignored; send type "
                f"{meant!r} to use it, or drop it",
                param=f"response_format.{name}",
                code="invalid_response_format",
            )


def _from_response_format(rf: ResponseFormat) -> Any:
    """The output type of an OpenAI-style `response_format` (or one of its extension types)."""
    p = "response_format"
    _check_format_fields(rf)
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return JsonSchema({"type": "object"})
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            where = f"{p}.json_schema" + ("" if rf.json_schema is None else ".schema")
            raise APIError(400, "response_format type 'json_schema' needs json_schema.schema, a JSON Schema "
                           "object", param=where, code="invalid_response_format")
        schema = _json_schema(rf.json_schema.schema_, f"{p}.json_schema.schema")
        return JsonSchema(close_objects(schema.schema)) if rf.json_schema.strict else schema
    if rf.type == "regex":
        pattern = rf.regex if rf.regex is not None else rf.pattern
        if not pattern:
            raise APIError(400, "response_format type 'regex' needs a `regex` pattern", param=f"{p}.regex",
                           code="invalid_response_format")
        return Regex(pattern)
    if rf.type == "choice":
        return _choice(rf.choices or rf.choice or [], f"{p}.choices")
    # grammar / ebnf / lark
    if not rf.grammar:
        raise APIError(400, f"response_format type {rf.type!r} needs a `grammar`", param=f"{p}.grammar",
                       code="invalid_response_format")
    syntax = rf.syntax or {"ebnf": "ebnf", "lark": "lark"}.get(rf.type, "auto")
    return CFG(rf.grammar, syntax=syntax)


def _sources(req: SamplingFields) -> list[tuple[str, Any]]:
    """Every (field, output type) the request sets; extension fields are read as vLLM/SGLang
    document them."""
    found: list[tuple[str, Any]] = []
    if req.response_format is not None and req.response_format.type != "text":
        found.append(("response_format", _from_response_format(req.response_format)))
    if req.guided_json is not None:
        found.append(("guided_json", _json_schema(req.guided_json, "guided_json")))
    if req.json_schema is not None:
        found.append(("json_schema", _json_schema(req.json_schema, "json_schema")))
    if req.guided_regex is not None:
        found.append(("guided_regex", Regex(req.guided_regex)))
    if req.regex is not None:
        found.append(("regex", Regex(req.regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", _choice(req.guided_choice, "guided_choice")))
    if req.choice is not None:
        found.append(("choice", _choice(req.choice, "choice")))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", CFG(req.guided_grammar, syntax="auto")))
    if req.grammar is not None:
        found.append(("grammar", CFG(req.grammar, syntax="auto")))
    if req.ebnf is not None:
        found.append(("ebnf", CFG(req.ebnf, syntax="ebnf")))
    so = req.structured_outputs
    if so is not None:
        so_found = [
            (name, make())
            for name, value, make in (
                ("json", so.json_, lambda: _json_schema(so.json_, "structured_outputs.json")),
                ("regex", so.regex, lambda: Regex(so.regex)),
                ("choice", so.choice, lambda: _choice(so.choice or [], "structured_outputs.choice")),
                ("grammar", so.grammar, lambda: CFG(so.grammar, syntax="auto")),
                ("json_object", so.json_object or None, lambda: JsonSchema({"type": "object"})),
            )
            if value is not None
        ]
        found += [(f"structured_outputs.{name}", t) for name, t in so_found]
    return found


def request_constraint(req: SamplingFields) -> RequestConstraint:
    """The single constraint a request asks for; 400 when it sets more than one."""
    found = _sources(req)
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"conflicting output constraints ({names}); send only one", param=found[1][0],
                       code="conflicting_parameters")
    output_type, param = (found[0][1], found[0][0]) if found else (None, None)
    rf = req.response_format
    strict = not (param == "response_format" and rf and rf.json_schema and rf.json_schema.strict is False)
    if not isinstance(req, ChatCompletionRequest) or not req.tools:
        if isinstance(req, ChatCompletionRequest) and req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is set but `tools` is empty; send tools or drop tool_choice",
                           param="tool_choice", code="invalid_parameter")
        return RequestConstraint(output_type, param, strict=strict)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    tool_choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
    try:
        choice = tool_format.resolve_tool_choice(tool_choice, tools)
    except StructgenError as e:
        raise to_api_error(e, param="tool_choice") from e
    try:
        tool_type = tool_format.tool_output_type(tools, choice, req.parallel_tool_calls)
    except StructgenError as e:
        raise to_api_error(e, param="tools") from e
    if tool_type is None:
        return RequestConstraint(output_type, param, tools, choice, strict)
    if output_type is not None and choice.mode in ("required", "named"):
        output_type = None  # the call payload is the output; response_format applies to text
    if output_type is not None:
        raise APIError(
            400,
            "response_format together with tool_choice='auto' is not supported; use tool_choice "
            "'required' or 'none', or drop response_format",
            param=param,
            code="unsupported_parameter",
        )
    return RequestConstraint(tool_type, "tools", tools, choice)
