"""Output types -> one `Constraint`.

Everything a user can ask for (a pydantic model, a dataclass, a TypedDict, `int`, `str`,
`Literal[...]`, an Enum, or one of the markers `JsonSchema`, `Regex`, `CFG`, `Choice`) becomes
a `Constraint`: what the grammar compiler needs (`kind`, `source`, `syntax`, `key`) plus how to
turn the generated text back into a typed, validated value (`parse`). All checks that need no
tokenizer happen here, so a bad type fails before any model work.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import json
import os
import re
import sys
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal

import jsonschema
import pydantic

from structgen.errors import (
    InvalidConstraintError,
    OutputValidationError,
    StructgenError,
    StructgenWarning,
    UnsatisfiableConstraintError,
    UnsupportedSchemaError,
    UnsupportedTypeError,
)
from structgen.schema.metaschema import schema_error, validator_class

ConstraintKind = Literal["json_schema", "regex", "grammar", "text"]

# Bounded (int64 / double range): a small model asked for a number sometimes keeps adding
# digits forever when it cannot write the words it wanted; a bound makes it stop.
INT_REGEX = r"-?(0|[1-9][0-9]{0,17})"
FLOAT_REGEX = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,3})?"
BOOL_REGEX = r"true|false"
_SCALARS: dict[type, tuple[str, Callable[[str], Any]]] = {
    int: (INT_REGEX, int),
    float: (FLOAT_REGEX, float),
    bool: (BOOL_REGEX, lambda text: text == "true"),
}
_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*::=", re.MULTILINE)


# -- user-facing markers --------------------------------------------------------------------
@dataclass(frozen=True)
class JsonSchema:
    """Output JSON valid against a JSON Schema (a dict or its JSON text); the value is the
    parsed JSON (dict, list, ...), validated with `jsonschema`."""

    schema: dict[str, Any] | bool | str


@dataclass(frozen=True)
class Regex:
    """Output text that fully matches `pattern`; the value is the text."""

    pattern: str


@dataclass(frozen=True)
class CFG:
    """Output text in the language of a context-free grammar; the value is the text.

    `syntax`: "ebnf" (GBNF as in llama.cpp / xgrammar, root rule `root`), "lark" (as
    llguidance reads it, start rule `start`), or "auto" (EBNF if rules are written `name ::=`).
    """

    grammar: str
    syntax: Literal["auto", "ebnf", "lark"] = "auto"


@dataclass(frozen=True)
class Choice:
    """Output exactly one of `options` (strings, or numbers/bools/None written as JSON); the
    value is the chosen option itself."""

    options: tuple[Any, ...]

    def __init__(self, options: Sequence[Any]):
        object.__setattr__(self, "options", tuple(options))


# -- the constraint -------------------------------------------------------------------------
@dataclass(frozen=True)
class Constraint:
    """What to generate (for the grammar compiler) and how to read it back (for the caller).

    kind: "json_schema" | "regex" | "grammar" | "text" (unconstrained, ends at a stop token).
    source: canonical JSON-schema text / regex / grammar text ("" for text).
    syntax: "ebnf" | "lark" for grammars, "" otherwise.
    strict: JSON schemas only; False allows backends that enforce the schema partially.
    fallback: JSON schemas only: a stricter schema (every instance valid, some valid ones
        excluded) the compiler tries when every backend refuses `source`; see
        `schema.normalize.normalize_schema(tighten=True)`.
    relaxed: with strict=False, the keywords left out of `source` because no backend enforces
        them, as "keyword at path"; `parse` still validates against the full schema.
    """

    kind: ConstraintKind
    source: str = ""
    syntax: str = ""
    description: str = ""
    strict: bool = True
    relaxed: tuple[str, ...] = ()
    parser: Callable[[str], Any] | None = field(default=None, compare=False, repr=False)
    fallback: Constraint | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str, bool, str]:
        """Hashable identity of the grammar (two output types with the same schema share it)."""
        return (self.kind, self.syntax, self.strict, self.source)

    def parse(self, text: str) -> Any:
        """The typed, validated value of generated `text`; `OutputValidationError` if invalid."""
        if self.parser is None:
            return text
        try:
            return self.parser(text)
        except OutputValidationError:
            raise
        except json.JSONDecodeError as e:
            what = "empty" if not text.strip() else "not JSON"
            raise OutputValidationError(
                f"output is {what}, where {self.description} needs a JSON value: {_one_line(e)}", text=text
            ) from e
        except Exception as e:  # pydantic / jsonschema errors, all the same to a caller
            raise OutputValidationError(
                f"output does not validate against {self.description}: {_one_line(e)}", text=text
            ) from e


def to_constraint(output_type: Any, *, strict: bool = True) -> Constraint:
    """Turn an output type into a `Constraint`.

    A plain dict is a JSON Schema (as `JsonSchema(schema)`). `strict=False` lets JSON schemas
    use keywords no grammar backend enforces: those keywords are left out of the grammar (see
    `Constraint.relaxed`) and `parse` validates the output against the full schema.

    Raises `UnsupportedTypeError` (a type with no JSON schema, an instance or a string where a
    type belongs), `InvalidConstraintError` (a malformed schema/regex/grammar/choice),
    `UnsatisfiableConstraintError` (a schema no value satisfies) or `UnsupportedSchemaError`
    (a keyword no backend enforces, with its JSON path, when strict).
    """
    if isinstance(output_type, Constraint):
        return output_type
    if isinstance(output_type, dict):
        output_type = JsonSchema(_schema_text(output_type))
    elif isinstance(output_type, JsonSchema) and isinstance(output_type.schema, dict):
        output_type = JsonSchema(_schema_text(output_type.schema))
    _check_is_a_type(output_type)
    try:
        hash(output_type)
    except TypeError:
        return _build(output_type, strict)
    return _cached_build(output_type, strict)


def _schema_text(schema: dict[str, Any]) -> str:
    """A dict schema as JSON text: hashable, so equal schemas share one cached constraint."""
    try:
        return json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InvalidConstraintError(f"a JSON schema must hold JSON values only: {e}") from e


def _check_is_a_type(output_type: Any) -> None:
    """Refuse the common mistakes before pydantic sees them: a string would be evaluated as a
    forward reference (code), and an instance has no schema of its own."""
    if isinstance(output_type, str):
        raise UnsupportedTypeError(
            f"the output type is the string {output_type!r:.60}; strings are not read as types. "
            "Pass the type first and the prompt second, e.g. generate(Customer, prompt); for a "
            "pattern use Regex(...), for JSON-schema text JsonSchema(...)"
        )
    if isinstance(output_type, (type, JsonSchema, Regex, CFG, Choice)):
        return
    if typing.get_origin(output_type) is not None:
        return
    if isinstance(output_type, pydantic.BaseModel) or (
        dataclasses.is_dataclass(output_type) and not isinstance(output_type, type)
    ) or isinstance(output_type, enum.Enum):
        name = type(output_type).__name__
        raise UnsupportedTypeError(
            f"got an instance of {name}, not the class; pass the class itself: generate({name}, prompt)"
        )
    if isinstance(output_type, (list, tuple, set)):
        kind = type(output_type).__name__
        inner = ", ".join(getattr(t, "__name__", repr(t)) for t in output_type)
        raise UnsupportedTypeError(
            f"got the {kind} {output_type!r:.60}, not a type; write {kind}[{inner}] for a {kind} "
            "of those, or Choice([...]) for one of fixed values"
        )
    if inspect.isroutine(output_type) or isinstance(output_type, functools.partial):
        # pydantic would take a function as its arguments and call it with the model's
        # output: generate(get_weather, p) would run the tool instead of refusing.
        name = getattr(output_type, "__name__", None) or type(output_type).__name__
        raise UnsupportedTypeError(
            f"got the function {name}, not a type; for the model to call it use "
            f"llm.call(prompt, [{name}]) or run_tools (docs/guide/tools.md); for a value of its "
            "return type pass that type"
        )
    if isinstance(output_type, (int, float, bytes)) or output_type is None:
        raise UnsupportedTypeError(
            f"got the value {output_type!r:.60}, not a type; pass a type such as int or "
            "Literal[...] / Choice([...]) for fixed values"
        )


@functools.lru_cache(maxsize=1024)
def _cached_build(output_type: Any, strict: bool) -> Constraint:
    """Types are built once: a pydantic model costs milliseconds (schema, normalization,
    keyword check), and the API calls `to_constraint` on every request."""
    return _build(output_type, strict)


def _build(output_type: Any, strict: bool) -> Constraint:
    if isinstance(output_type, JsonSchema):
        return _json_schema_constraint(output_type.schema, strict)
    if isinstance(output_type, Regex):
        return _regex_constraint(output_type.pattern)
    if isinstance(output_type, CFG):
        return _grammar_constraint(output_type.grammar, output_type.syntax)
    if isinstance(output_type, Choice):
        return _choice_constraint(list(output_type.options), list(output_type.options), "choice")
    if output_type is str:
        return Constraint("text", description="text")
    if output_type in _SCALARS:
        pattern, convert = _SCALARS[output_type]
        return _regex_constraint(pattern, output_type.__name__, convert)
    if typing.get_origin(output_type) is Literal:
        options = list(typing.get_args(output_type))
        return _choice_constraint(options, options, "Literal")
    if isinstance(output_type, type) and issubclass(output_type, enum.Enum):
        members = list(output_type)
        return _choice_constraint([m.value for m in members], members, output_type.__name__)
    return _pydantic_constraint(output_type, strict)


# -- JSON -----------------------------------------------------------------------------------
def _pydantic_constraint(output_type: Any, strict: bool) -> Constraint:
    """Models, dataclasses, TypedDicts and containers of them, through a pydantic TypeAdapter
    (which gives both the JSON schema and the validating parser)."""
    # Formats and key types pydantic validates but the backends would not enforce become
    # patterns there (see `schema.pydantic_types`).
    from structgen.schema.pydantic_types import grammar_json_schema

    name = getattr(output_type, "__name__", None) or repr(output_type)
    try:
        adapter = pydantic.TypeAdapter(_portable_typeddicts(output_type))
        schema, unenforced = grammar_json_schema(adapter, strict)
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, TypeError) as e:
        raise UnsupportedTypeError(
            f"cannot generate a {name}: it has no JSON schema ({_one_line(e)}). Use a pydantic "
            "model, dataclass, TypedDict, int/float/bool/str, Literal, Enum, or JsonSchema/"
            "Regex/CFG/Choice"
        ) from e
    _check_bounds(schema)  # contradictory Field bounds: the caller's error, as for a dict schema
    generated, tightened, relaxed = _generation_schema(close_objects(schema), strict)
    return _json_constraint(
        generated, tightened, f"JSON {name}", strict, adapter.validate_json, unenforced + relaxed
    )


def _portable_typeddicts(tp: Any) -> Any:
    """pydantic refuses `typing.TypedDict` before Python 3.12 (it lacks `__orig_bases__`);
    rebuild such classes, also nested in fields and generics, as `typing_extensions.TypedDict`."""
    if sys.version_info >= (3, 12):
        return tp
    import typing_extensions

    if typing.is_typeddict(tp) and type(tp).__module__ == "typing":
        hints = typing.get_type_hints(tp, include_extras=True)
        fields = {k: v if k in tp.__required_keys__ else typing_extensions.NotRequired[v] for k, v in hints.items()}
        rebuilt = typing_extensions.TypedDict(tp.__name__, {k: _portable_typeddicts(v) for k, v in fields.items()})
        rebuilt.__doc__ = tp.__doc__
        return rebuilt
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:  # its alias keeps the metadata apart from the type
        inner = _portable_typeddicts(args[0])
        return tp if inner is args[0] else typing.Annotated[(inner, *args[1:])]
    if args and origin is not None and origin is not Literal:
        new = tuple(_portable_typeddicts(a) for a in args)
        if new != args:
            try:
                return tp.copy_with(new)
            except AttributeError:
                return origin[new]
    return tp


def _json_schema_constraint(schema: dict[str, Any] | bool | str, strict: bool) -> Constraint:
    from structgen.schema.limits import check_json_schema

    check_json_schema(schema)  # size and nesting first: what follows recurses over the schema
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidConstraintError(
                f"JSON schema text is not JSON: {e.msg} at line {e.lineno} column {e.colno}"
            ) from e
    if schema is True:
        schema = {}
    if schema is False or not isinstance(schema, dict):
        raise InvalidConstraintError(
            f"a JSON schema must be an object (or true), got {type(schema).__name__}: {schema!r:.80}"
        )
    validator_cls = validator_class(schema)
    problem = schema_error(schema)
    if problem is not None:
        raise InvalidConstraintError(f"invalid JSON schema at {problem[0]}: {problem[1]}")
    from structgen.schema.instance_check import instance_check
    from structgen.schema.keywords import ref_loop_error, unresolved_refs
    from structgen.schema.python_patterns import python_patterns

    broken = unresolved_refs(schema)
    if broken:
        ref, where = broken[0]
        raise InvalidConstraintError(f"JSON schema $ref {ref!r} at {where} points nowhere")
    loop = ref_loop_error(schema)
    if loop is not None:
        raise InvalidConstraintError(f"JSON schema {loop}")
    _warn_unknown_keywords(schema)
    _check_bounds(schema)
    checked = python_patterns(schema)  # the outputs' check reads its patterns with Python's re
    generated, tightened, relaxed = _generation_schema(schema, strict)
    validator = validator_cls(checked)
    # jsonschema walks the schema anew for each output: a compiled check says "valid" first
    # where it covers the schema; jsonschema decides the rest, with the message
    # (docs/performance.md, "Serving under load").
    check = instance_check(checked, validator_cls)

    def parse(text: str) -> Any:
        value = json.loads(text)
        if check is not None and _passes(check, value):
            return value
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            where = "#/" + "/".join(map(str, error.absolute_path))
            raise OutputValidationError(
                f"output fails the JSON schema at {where}: {error.message}", text=text
            )
        return value

    title = schema.get("title")
    description = f"JSON schema {title!r}" if isinstance(title, str) else "JSON schema"
    return _json_constraint(generated, tightened, description, strict, parse, relaxed)


def _passes(check: Callable[[Any], bool], value: Any) -> bool:
    """Whether the compiled check says `value` is valid; where it raises (a `$ref` cycle that
    consumes nothing recurses forever), jsonschema gives the verdict."""
    try:
        return check(value)
    except Exception:
        return False


# Keywords of drafts 3 and 4 that validators of those drafts know: not typos.
_OLDER_DRAFT_KEYWORDS = frozenset({"id", "extends", "disallow", "divisibleBy"})


def _warn_unknown_keywords(schema: dict[str, Any]) -> None:
    """Validators ignore keywords they do not know, so a typo (`"tpye"`) silently means "any
    value": warn where an unknown keyword is close to a known one, once a keyword (with its
    first place). Vendor keys (`_x`, `x-x`) are deliberate and pass."""
    import difflib

    from structgen.schema.keywords import ANNOTATIONS, KEYWORDS, walk

    known = sorted(ANNOTATIONS | set(KEYWORDS))
    seen: set[str] = set()
    for node, path in walk(schema):
        for kw in node:
            if kw in seen or kw in ANNOTATIONS or kw in KEYWORDS or kw in _OLDER_DRAFT_KEYWORDS:
                continue
            seen.add(kw)
            if kw.startswith(("_", "x-")):
                continue
            close = difflib.get_close_matches(kw, known, n=1, cutoff=0.7)
            if close:
                warnings.warn(
                    f"unknown JSON Schema keyword {kw!r} (first at {path}) is ignored; did you "
                    f"mean {close[0]!r}?",
                    StructgenWarning,
                    stacklevel=_first_caller_outside_structgen(),
                )


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _first_caller_outside_structgen() -> int:
    """The `stacklevel` that points a warning at the caller's code, not at structgen's."""
    level, frame = 1, typing.cast("FrameType | None", sys._getframe(1))
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        level, frame = level + 1, frame.f_back
    return level


_BOUND_PAIRS = (
    ("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)  # fmt: skip


def _check_bounds(schema: dict[str, Any]) -> None:
    """Lower bounds above upper bounds where a value must exist (the root, required
    properties, allOf members, non-empty arrays' items), named with their path."""
    from structgen.schema.keywords import resolve_ref

    stack: list[tuple[Any, str]] = [(schema, "#")]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        for low, high in _BOUND_PAIRS:
            lo, hi = node.get(low), node.get(high)
            if _is_number(lo) and _is_number(hi) and lo > hi:
                raise UnsatisfiableConstraintError(
                    f"JSON schema at {path}: {low} {lo} is greater than {high} {hi}, so no value "
                    f"fits; swap or correct the bounds"
                )
        lo = node.get("exclusiveMinimum", node.get("minimum"))
        hi = node.get("exclusiveMaximum", node.get("maximum"))
        if _is_number(lo) and _is_number(hi) and lo >= hi and (
            "exclusiveMinimum" in node or "exclusiveMaximum" in node
        ):
            raise UnsatisfiableConstraintError(
                f"JSON schema at {path}: no number lies between the lower bound {lo} and the "
                f"exclusive upper bound {hi}; widen the range"
            )
        stack.extend(_necessary_subschemas(node, path))
        ref = node.get("$ref")
        if isinstance(ref, str):
            stack.append((resolve_ref(schema, ref), ref))


def _necessary_subschemas(node: dict[str, Any], path: str) -> list[tuple[Any, str]]:
    """Subschemas every valid instance must satisfy somewhere."""
    out = [(sub, f"{path}/allOf/{i}") for i, sub in enumerate(node.get("allOf") or [])]
    properties = node.get("properties")
    if isinstance(properties, dict):
        for name in node.get("required") or []:
            if isinstance(name, str) and name in properties:
                out.append((properties[name], f"{path}/properties/{name}"))
    min_items = node.get("minItems")
    if isinstance(node.get("items"), dict) and _is_number(min_items) and min_items > 0:
        out.append((node["items"], f"{path}/items"))
    return out


def _is_number(value: Any) -> typing.TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_constraint(
    generated: Any,
    tightened: Any,
    description: str,
    strict: bool,
    parse: Callable[[str], Any],
    relaxed: tuple[str, ...] = (),
) -> Constraint:
    fallback = None
    if tightened is not None:
        fallback = _json_constraint(tightened, None, description, strict, parse)
    return Constraint(
        "json_schema",
        _canonical(generated),
        description=description,
        strict=strict,
        relaxed=relaxed,
        parser=parse,
        fallback=fallback,
    )


def _generation_schema(schema: dict[str, Any], strict: bool) -> tuple[Any, Any | None, tuple[str, ...]]:
    """The equivalent schema the grammar is compiled from (see `schema.normalize`), a
    stricter one for when the backends refuse it (None if there is none), and the keywords
    left out (strict=False only). Strict, it fails now, naming keyword and path, if no grammar
    backend enforces all of either; not strict, it leaves out what the backend that enforces
    the most cannot enforce.

    The compiler tries the exact one first: llguidance may prove an overlapping `oneOf`
    disjoint where `disjoint.py` could not."""
    # Imported here: the schema modules are pure Python at import time, but callers that only
    # build constraints (the remote client) need not load them.
    from structgen.schema.keywords import BACKENDS, find_issues, unsupported_schema_error
    from structgen.schema.normalize import normalize_exact, normalize_schema, surely_empty

    generated, inexact = normalize_exact(schema)
    tightened = normalize_schema(schema, tighten=True) if inexact else None
    if generated is False:
        raise UnsatisfiableConstraintError(
            "the JSON schema admits no value at all (e.g. an enum or const none of whose values "
            "has the schema's type), so nothing can be generated; check its enum/const and type"
        )
    if tightened is not None and surely_empty(tightened):
        tightened = None  # tightening lost everything: refuse rather than generate nothing
    issues = {b: find_issues(generated, b) for b in BACKENDS}
    if not all(issues.values()):
        return generated, tightened, ()
    if tightened is not None and not all(find_issues(tightened, b) for b in BACKENDS):
        # strict: the compiler falls back to it; not strict: no keyword need be left out
        return (generated, tightened, ()) if strict else (tightened, None, ())
    if strict:
        raise unsupported_schema_error(issues)
    return _relax(generated, issues)


def _relax(schema: Any, issues: dict[str, list[Any]]) -> tuple[Any, None, tuple[str, ...]]:
    """`schema` less the keywords the backend with the fewest issues cannot enforce."""
    import copy

    from structgen.schema.keywords import find_issues, resolve_ref

    backend = min(issues, key=lambda b: len(issues[b]))
    relaxed = copy.deepcopy(schema)
    dropped: list[str] = []
    found = issues[backend]
    for _ in range(4):  # dropping a keyword can expose a rule on its siblings
        for issue in found:
            node = resolve_ref(relaxed, issue.path)
            if isinstance(node, dict) and node.pop(issue.keyword, None) is not None:
                dropped.append(f"{issue.keyword} at {issue.path}")
        found = find_issues(relaxed, backend)
        if not found:
            return relaxed, None, tuple(dropped)
    raise UnsupportedSchemaError(
        f"even with strict=False, {backend} cannot enforce {found[0]}; remove that keyword",
        keyword=found[0].keyword,
        path=found[0].path,
    )


def close_objects(schema: Any) -> Any:
    """Model schemas list every field; forbid extra ones so the model cannot ramble on in keys
    pydantic would drop anyway (an explicit `extra="allow"` keeps additionalProperties).
    Walks schema positions only, so a field named "properties" is not mistaken for one."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for kw, value in schema.items():
        if kw in _SCHEMA_MAPS and isinstance(value, dict):
            out[kw] = {k: close_objects(v) for k, v in value.items()}
        elif kw in _SCHEMA_LISTS and isinstance(value, list):
            out[kw] = [close_objects(v) for v in value]
        elif kw in _SCHEMA_ONE:
            out[kw] = close_objects(value)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalProperties", "not")


def _canonical(schema: dict[str, Any]) -> str:
    # Key order is kept: it is the order in which properties are generated.
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


# -- regex, grammar, choice -----------------------------------------------------------------
def _regex_constraint(
    pattern: str, name: str = "", convert: Callable[[str], Any] = str
) -> Constraint:
    from structgen.schema.limits import BUILD_LIMITS, check_source

    if not isinstance(pattern, str) or not pattern:
        raise InvalidConstraintError("Regex needs a non-empty pattern string")
    check_source("regex", pattern, "regex", BUILD_LIMITS)  # before re's recursive parser
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise InvalidConstraintError(
            f"invalid regex {pattern!r}: {e.msg} at position {e.pos}"
        ) from e
    except (OverflowError, RecursionError) as e:  # a repetition count past re's limits
        raise InvalidConstraintError(
            f"regex {pattern[:200]!r} is beyond what Python's re accepts ({e}); use smaller "
            "repetition counts and less nesting"
        ) from e

    def parse(text: str) -> str:
        if compiled.fullmatch(text) is None:
            raise OutputValidationError(f"output does not fully match regex {pattern!r}", text=text)
        return convert(text)

    return Constraint("regex", pattern, description=name or f"regex /{pattern}/", parser=parse)


def _grammar_constraint(grammar: str, syntax: str) -> Constraint:
    if not isinstance(grammar, str) or not grammar.strip():
        raise InvalidConstraintError("CFG needs a non-empty grammar string")
    if syntax not in ("auto", "ebnf", "lark"):
        raise InvalidConstraintError(f"CFG syntax must be 'auto', 'ebnf' or 'lark', got {syntax!r}")
    if syntax == "auto":
        syntax = "ebnf" if _EBNF_RULE.search(grammar) else "lark"
    return Constraint("grammar", grammar, syntax=syntax, description=f"{syntax} grammar")


def _choice_constraint(options: list[Any], values: list[Any], name: str) -> Constraint:
    """One of fixed options, as a regex alternation of their texts (strings as themselves,
    other literals as JSON)."""
    if not options:
        raise InvalidConstraintError(f"{name} needs at least one option")
    texts: dict[str, Any] = {}
    for option, value in zip(options, values, strict=True):
        text = _option_text(option, name)
        if text in texts:
            raise InvalidConstraintError(
                f"{name} options {texts[text]!r} and {value!r} are both written {text!r}"
            )
        texts[text] = value
    # Longest first: both backends' alternations are unordered, but it keeps the regex readable
    # and deterministic.
    from structgen.schema.patterns import escape_regex

    pattern = "|".join(escape_regex(t) for t in sorted(texts, key=lambda t: (-len(t), t)))

    def parse(text: str) -> Any:
        if text not in texts:
            raise OutputValidationError(f"output {text!r} is not one of {list(texts)}", text=text)
        return texts[text]

    shown = ", ".join(repr(t) for t in list(texts)[:5]) + (", ..." if len(texts) > 5 else "")
    return Constraint("regex", pattern, description=f"{name} of {shown}", parser=parse)


def _option_text(option: Any, name: str) -> str:
    if isinstance(option, enum.Enum):
        option = option.value
    if isinstance(option, str):
        if not option:
            raise InvalidConstraintError(f"{name} options must be non-empty strings")
        return option
    if option is None or isinstance(option, (bool, int, float)):
        return json.dumps(option)
    raise InvalidConstraintError(
        f"{name} options must be strings, numbers, bools or None, got {option!r}"
    )


def _one_line(e: BaseException) -> str:
    if isinstance(e, StructgenError):
        return str(e)
    return " ".join(str(e).split())[:500]
