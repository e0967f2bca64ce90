"""How tool calls look in model text: the prompt that describes the tools, the ONE constraint
that makes every call valid, and the parser that reads calls back.

The convention is Hermes-style, which Qwen2/Qwen3 templates use natively:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice` decides the constraint:
- "none": no tool constraint (the caller's own output type applies);
- "required": a JSON schema for an array of calls (`anyOf` over the tools, each
  `{"name": const, "arguments": <parameters schema>}`), or one call object when parallel
  calls are off; it compiles on every backend;
- a named function: a JSON schema for one call of that function;
- "auto": a Lark grammar whose start rule is either plain text that never contains
  `<tool_call>` or one or more Hermes calls, each call's JSON embedded with llguidance's
  `%json` so its arguments validate against the tool's schema.

Everything here works on OpenAI-style tool dicts (`{"type": "function", "function": {...}}`),
so the HTTP server and the in-process `structgen.tools` share it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from structgen.errors import InvalidConstraintError, OutputValidationError, UnsupportedSchemaError
from structgen.schema.keywords import ref_loop_error
from structgen.schema.metaschema import schema_error, validator_class
from structgen.schema.python_patterns import python_patterns

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

ToolMode = Literal["none", "auto", "required", "named"]

_SYSTEM_TEMPLATE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolChoice:
    """A resolved `tool_choice`: the mode, and the function name when one is forced."""

    mode: ToolMode
    name: str | None = None


@dataclass
class ParsedCall:
    """One call read back from model text; `arguments` validated against the tool's schema."""

    id: str
    name: str
    arguments: dict[str, Any]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The `function` object of an OpenAI tool dict (a bare function dict is accepted too)."""
    return tool.get("function", tool)


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameters schema; a missing one means "any JSON object"."""
    params = function_of(tool).get("parameters")
    return params if params else {"type": "object"}


def resolve_tool_choice(tool_choice: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """Turn an OpenAI `tool_choice` (string or `{"type": "function", "function": {"name"}}`)
    into a `ToolChoice`; the default is "auto" with tools and "none" without, as in OpenAI."""
    names = [function_of(t)["name"] for t in tools]
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidConstraintError(
                f"tool_choice {tool_choice!r} is not one of 'none', 'auto', 'required' "
                "or {'type': 'function', 'function': {'name': ...}}"
            )
        if tool_choice != "none" and not tools:
            raise InvalidConstraintError(f"tool_choice={tool_choice!r} needs a non-empty `tools` list")
        return ToolChoice(tool_choice)  # type: ignore[arg-type]
    if isinstance(tool_choice, dict):
        name = function_of(tool_choice).get("name") if "function" in tool_choice else None
    else:
        name = getattr(getattr(tool_choice, "function", None), "name", None)
    if not name:
        raise InvalidConstraintError("a named tool_choice needs {'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise InvalidConstraintError(
            f"tool_choice names function {name!r}, which is not among the tools ({', '.join(names) or 'none given'})"
        )
    return ToolChoice("named", name)


def check_tools(tools: list[dict[str, Any]]) -> None:
    """Reject duplicate names and parameter schemas that are not JSON Schema, naming the tool."""
    seen: set[str] = set()
    for tool in tools:
        fn = function_of(tool)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidConstraintError("every tool needs a function name")
        if name in seen:
            raise InvalidConstraintError(f"two tools are named {name!r}; tool names must be unique")
        seen.add(name)
        params = parameters_of(tool)
        if not isinstance(params, dict):
            raise InvalidConstraintError(f"tool {name!r}: parameters must be a JSON Schema object")
        error = _KNOWN_VALID.error(params)
        if error is not None:
            raise InvalidConstraintError(f"tool {name!r}: invalid parameters schema: {error}")


class _KnownValid:
    """Parameter schemas that passed the check, by a digest of their JSON text: an agent sends
    the same tools every turn, and the check costs about a millisecond a tool (the VM). Only
    digests are kept, and only of valid schemas, so no request can make it hold more than
    `size` x 16 bytes; refusals are checked anew."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def error(self, schema: dict[str, Any]) -> str | None:
        try:
            key = hashlib.blake2b(json.dumps(schema).encode(), digest_size=16).digest()
        except (TypeError, ValueError):  # not JSON text: checked as it is, not kept
            return _schema_error(schema)
        with self._lock:
            if key in self._digests:
                self._digests.move_to_end(key)
                return None
        error = _schema_error(schema)
        if error is None:
            with self._lock:
                self._digests[key] = None
                while len(self._digests) > self.size:
                    self._digests.popitem(last=False)
        return error


_KNOWN_VALID = _KnownValid()


def _schema_error(schema: dict[str, Any]) -> str | None:
    """What is wrong with a parameters schema, as a response format's check finds it: the
    metaschema of its draft (schema/metaschema.py), its patterns (schema/python_patterns.py),
    a `$ref` loop with nothing on it."""
    try:
        problem = schema_error(schema)
        if problem is None:
            python_patterns(schema)
            return ref_loop_error(schema)
    except (InvalidConstraintError, UnsupportedSchemaError) as e:
        return str(e)
    where, message = problem
    return f"{message} (at {where})"


# --------------------------------------------------------------------------- constraint


def call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """JSON schema of one call of `tool`: `{"name": const, "arguments": <parameters>}`.
    Self-contained: `$ref`s inside the parameters are rewritten to the call's own `$defs`."""
    fn = function_of(tool)
    params, defs = hoist_defs(parameters_of(tool), prefix="")
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    if defs:
        schema["$defs"] = defs
    return schema


def required_schema(tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool) -> dict[str, Any]:
    """The JSON schema for `tool_choice` "required" or a named function."""
    if choice.mode == "named":
        return call_schema(next(t for t in tools if function_of(t)["name"] == choice.name))
    defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(tools):
        fn = function_of(tool)
        params, tool_defs = hoist_defs(parameters_of(tool), prefix=f"t{i}_")
        defs.update(tool_defs)
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    one: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else dict(one)
    if defs:
        schema["$defs"] = defs
    return schema


def auto_grammar(tools: list[dict[str, Any]], parallel: bool) -> str:
    """The Lark grammar for `tool_choice` "auto": plain text, or Hermes tool calls."""
    names = [f"call_{i}" for i in range(len(tools))]
    lines = [
        "start: TEXT | calls",
        'calls: call ("\\n" call)*' if parallel else "calls: call",
        f'call: "{TOOL_CALL_OPEN}\\n" ({" | ".join(names)}) "\\n{TOOL_CALL_CLOSE}"',
    ]
    for rule, tool in zip(names, tools, strict=True):
        lines.append(f"{rule}: %json {json.dumps(call_schema(tool))}")
    # Text never contains a tool-call tag: otherwise a call could slip out through the text
    # branch unvalidated. llguidance lexemes support `&` (and) and `~` (not).
    lines.append(f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{TOOL_CALL_OPEN}(.|\\n)*/")
    return "\n".join(lines) + "\n"


def hoist_defs(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Move `$defs`/`definitions` out of a sub-schema so it can be nested in a larger one,
    renaming them with `prefix` and rewriting `$ref`s (a reference through the schema's own
    `$id` read as local); a reference to the schema itself (`#`) or into it elsewhere
    (`#/properties/a`) makes its body a def of its own, `{prefix}root`."""
    base = schema.get("$id") if isinstance(schema.get("$id"), str) else None
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    into_body = _refs_into_body(schema, base)
    if not local and not into_body:
        return schema, {}
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions", "$id")}

    def target(ref: str) -> str:
        ref = _local(ref, base)
        for head in ("#/$defs/", "#/definitions/"):
            if ref.startswith(head):
                return f"#/$defs/{prefix}{ref[len(head):]}"
        if ref == "#" or ref.startswith("#/"):
            return f"#/$defs/{prefix}root{ref[1:]}"
        return ref

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            if isinstance(node.get("$ref"), str):
                out["$ref"] = target(node["$ref"])
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    defs = {f"{prefix}{k}": rewrite(v) for k, v in local.items()}
    body = rewrite(body)
    if into_body:
        defs[f"{prefix}root"] = body
        return {"$ref": f"#/$defs/{prefix}root"}, defs
    return body, defs


def _local(ref: str, base: str | None) -> str:
    """`ref` as a local pointer where it goes through the schema's own `$id` (`base`)."""
    return ref[len(base):] if base is not None and ref.startswith(base + "#") else ref


def _refs_into_body(node: Any, base: str | None) -> bool:
    """Does a `$ref` below `node` point at the schema itself or into it elsewhere than its defs?"""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            ref = _local(ref, base)
            if ref == "#" or (ref.startswith("#/") and not ref.startswith(("#/$defs/", "#/definitions/"))):
                return True
        return any(_refs_into_body(v, base) for v in node.values())
    if isinstance(node, list):
        return any(_refs_into_body(v, base) for v in node)
    return False


# --------------------------------------------------------------------------- parsing


def parse_tool_calls(
    text: str, tools: list[dict[str, Any]], choice: ToolChoice
) -> tuple[list[ParsedCall], str | None]:
    """Read the calls out of generated text: `(calls, None)` for a tool call, `([], text)` when
    the model answered in text ("auto"). Arguments are validated against the tool's schema;
    the grammar already guarantees it, so a failure here is an engine bug, not user error."""
    if choice.mode in ("required", "named"):
        payload = _loads(text)
        items = payload if isinstance(payload, list) else [payload]
        return [_to_call(item, tools) for item in items], None
    if choice.mode == "none" or not text.lstrip().startswith(TOOL_CALL_OPEN):
        return [], text
    calls = []
    decoder = json.JSONDecoder()
    pos = text.index(TOOL_CALL_OPEN)
    while pos != -1:
        start = pos + len(TOOL_CALL_OPEN)
        start += len(text[start:]) - len(text[start:].lstrip())
        try:
            item, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as e:
            raise OutputValidationError(f"tool call is not valid JSON: {e}", text=text) from e
        calls.append(_to_call(item, tools))
        close = text.find(TOOL_CALL_CLOSE, end)
        if close == -1:
            raise OutputValidationError("tool call is not closed by </tool_call>", text=text)
        pos = text.find(TOOL_CALL_OPEN, close)
    return calls, None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise OutputValidationError(f"tool call payload is not valid JSON: {e}", text=text) from e


def _to_call(item: Any, tools: list[dict[str, Any]]) -> ParsedCall:
    if not isinstance(item, dict) or "name" not in item:
        raise OutputValidationError(f"tool call {item!r} is not {{'name', 'arguments'}}")
    by_name = {function_of(t)["name"]: t for t in tools}
    tool = by_name.get(item["name"])
    if tool is None:
        raise OutputValidationError(f"model called unknown tool {item['name']!r}")
    args = item.get("arguments", {})
    params = parameters_of(tool)  # checked by `check_tools`: only the arguments are checked here
    error = jsonschema.exceptions.best_match(validator_class(params)(python_patterns(params)).iter_errors(args))
    if error is not None:
        raise OutputValidationError(f"arguments of {item['name']!r} do not validate: {error.message}")
    return ParsedCall(new_call_id(), item["name"], args)


# --------------------------------------------------------------------------- prompt


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders a `tools=` argument itself (Qwen2/3, Llama 3.1...)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: look for a tool-use one
        return "tool_use" in template or any("tools" in t for t in template.values())
    return "tools" in template


def render_messages(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Prepare a conversation with tools for the chat template.

    Returns `(messages, template_tools)`: when the template knows tools, the messages pass
    through (with `None` content made "") and the tools go to the template; otherwise the tools
    are described in the system message and past calls/results are written out as Hermes text,
    so a template with no tool support (SmolLM2's) still shows the model everything."""
    native = template_supports_tools(tokenizer)
    out: list[dict[str, Any]] = []
    for msg in messages:
        msg = dict(msg)
        if not native and msg.get("tool_calls"):
            calls = "\n".join(format_call(c) for c in msg.pop("tool_calls"))
            msg["content"] = "\n".join(s for s in (msg.get("content"), calls) if s)
        elif not native and msg.get("role") in ("tool", "function"):
            msg = {"role": "user", "content": f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"}
        if msg.get("content") is None:
            msg["content"] = ""
        out.append(msg)
    if not tools:
        return out, None
    if native:
        return out, tools
    # Non-ASCII text verbatim: `\u00e9` escapes cost tokens and read worse to the model.
    description = _SYSTEM_TEMPLATE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0].get("role") in ("system", "developer"):
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{description}"}
    else:
        out.insert(0, {"role": "system", "content": description})
    return out, None


def format_call(call: dict[str, Any]) -> str:
    """One OpenAI `tool_calls` entry as Hermes text (for conversation history)."""
    fn = function_of(call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    payload = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


def tool_output_type(tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool) -> Any:
    """The structgen output type that constrains a tool-calling turn (None for "none")."""
    from structgen.types import CFG, JsonSchema

    if choice.mode == "none":
        return None
    check_tools(tools)
    if choice.mode == "auto":
        return CFG(auto_grammar(tools, parallel), syntax="lark")
    return JsonSchema(required_schema(tools, choice, parallel))
