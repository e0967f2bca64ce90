"""JSON schemas for pydantic types whose grammar must be as strict as pydantic's validator.

pydantic describes many types by a `format` alone (`duration`, `uuid4`, `ipv4network`, ...)
that no backend enforces as pydantic validates (non-spec formats are stripped, spec ones are
looser or differ), and it drops dict key types that are not strings (`dict[int, str]` keys
become any string). `GrammarJsonSchema` writes such types as a `pattern` (dict keys as
`patternProperties` with `additionalProperties: false`) that accepts a subset of what
pydantic accepts in JSON mode, so both backends enforce it. So are types pydantic checks in a
validator function beyond their schema (base64 types, `ByteSize`, `Json[...]`, digit limits
of a `Decimal`), and numbers get bounds where an exponent could make them infinite. Types no
pattern can express (time-, filesystem- or environment-dependent checks, bounds on dates, a
checksum) raise `UnsupportedSchemaError`, or with strict=False keep pydantic's schema and
are listed as relaxed (pydantic validates the output afterwards).
tests/test_pydantic_sampled.py checks every kind of field type against pydantic by sampling.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic.types import Base64Encoder, EncodedBytes, EncodedStr
from pydantic_core import core_schema

from structgen.errors import UnsupportedSchemaError
from structgen.schema.patterns import escape_regex
from structgen.schema.pydantic_patterns import (
    B64_ALPHABETS,
    BOOL_KEY,
    BYTE_SIZE,
    CLOCK,
    COMPLEX,
    DATE,
    DECIMAL,
    DURATION,
    FLOAT_KEY,
    FORMAT_PATTERNS,
    HEX,
    INT_KEY,
    TZ_SUFFIX,
    UUID_ANY,
    base64_pattern,
    decimal_pattern,
    finite_number,
    json_text_pattern,
    url_pattern,
    uuid_version,
)


def _format_patterned(schema: Any) -> JsonSchemaValue | None:
    """`schema` with its `format` from FORMAT_PATTERNS written as a pattern, where it is such a
    string; an `anyOf` with such a string among its branches becomes that string alone (pydantic
    2.14 writes Fraction as a number or a "fraction" string, 2.13 as the string)."""
    if not isinstance(schema, dict):
        return None
    fmt = schema.get("format")
    if fmt in FORMAT_PATTERNS and schema.get("type") == "string":
        out = {k: v for k, v in schema.items() if k != "format"}
        out["pattern"] = anchored(FORMAT_PATTERNS[fmt])
        return out
    branches = schema.get("anyOf")
    if isinstance(branches, list):
        return next(filter(None, map(_format_patterned, branches)), None)
    return None


# Formats whose validity depends on more than the text (the filesystem, installed packages).
UNENFORCEABLE_FORMATS: dict[str, str] = {
    "file-path": "an existing file (FilePath)",
    "directory-path": "an existing directory (DirectoryPath)",
    "socket-path": "an existing socket (SocketPath)",
    "multi-host-uri": "a multi-host URL / DSN (PostgresDsn, ...)",
    "zoneinfo": "an IANA time zone (ZoneInfo; which exist depends on the tz database, use a "
    "Literal of the zones you need)",
}
# pydantic types whose validity is decided by a validator function, by its qualified name.
UNENFORCEABLE_VALIDATORS: dict[str, str] = {
    "PaymentCardNumber.validate": "a payment card number (PaymentCardNumber: a Luhn checksum)",
    "import_string": "an importable object path (ImportString)",
    "PathType.validate_new": "a path that does not exist yet (NewPath)",
    "PathType.validate_socket": "an existing socket (SocketPath)",
}
_UUID_VERSION_FORMAT = re.compile("uuid[1-8]")
_VALIDATION_KEYWORDS = ("le", "ge", "lt", "gt", "now_op", "now_utc_offset")


def anchored(pattern: str) -> str:
    """Both backends match a pattern against the whole string only when it is anchored."""
    return f"^({pattern})$"


def string_pattern(pattern: str) -> JsonSchemaValue:
    return {"type": "string", "pattern": anchored(pattern)}


def _repeats_allowed(out: JsonSchemaValue, schema: Any) -> JsonSchemaValue:
    """A set's array without `uniqueItems`, which no backend enforces: pydantic merges repeated
    items into the set, so the value is right either way. Kept (and so refused, or validated
    afterwards) where the set has a `min_length` above 1, which repeats could leave unmet."""
    if (schema.get("min_length") or 0) <= 1:
        out.pop("uniqueItems", None)
    return out


class GrammarJsonSchema(GenerateJsonSchema):
    """pydantic's JSON schema with formats and key types written as patterns the grammar
    backends enforce; what no pattern expresses raises `UnsupportedSchemaError` (strict) or
    is kept as pydantic writes it and named in `unenforced`."""

    strict: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unenforced: list[str] = []

    def unenforceable(self, what: str, keyword: str, schema: JsonSchemaValue) -> JsonSchemaValue:
        if self.strict:
            raise UnsupportedSchemaError(
                f"{what} cannot be enforced by a grammar: the output could fail pydantic's "
                "validation. Use a plainer type, or pass strict=False to generate it "
                "unenforced and validate it afterwards.",
                keyword=keyword,
            )
        self.unenforced.append(f"{keyword} ({what})")
        return schema

    # -- dates and times ----------------------------------------------------------------
    def _bounded(self, schema: Any, name: str) -> str | None:
        """The bound (`gt`, `now_op`, ...) a date/time schema has that no pattern expresses."""
        found = [kw for kw in _VALIDATION_KEYWORDS if schema.get(kw) is not None]
        return f"a {name} with the constraint {found[0]!r}" if found else None

    def date_schema(self, schema: core_schema.DateSchema) -> JsonSchemaValue:
        bound = self._bounded(schema, "date")
        if bound:
            return self.unenforceable(bound, "format", super().date_schema(schema))
        return string_pattern(DATE)

    def time_schema(self, schema: core_schema.TimeSchema) -> JsonSchemaValue:
        return self._zoned(schema, "time", CLOCK, super().time_schema)

    def datetime_schema(self, schema: core_schema.DatetimeSchema) -> JsonSchemaValue:
        return self._zoned(schema, "datetime", f"{DATE}T{CLOCK}", super().datetime_schema)

    def _zoned(self, schema: Any, name: str, body: str,
               pydantic_schema: Callable[[Any], JsonSchemaValue]) -> JsonSchemaValue:
        """A time or datetime: `body` and the time zone its `tz_constraint` asks for; a bound
        or a fixed offset no pattern expresses goes to `unenforceable` with pydantic's schema."""
        bound = self._bounded(schema, name)
        tz = schema.get("tz_constraint")
        if bound or tz not in TZ_SUFFIX:
            why = bound or f"a {name} with the fixed UTC offset {tz!r}"
            return self.unenforceable(why, "format", pydantic_schema(schema))
        return string_pattern(body + TZ_SUFFIX[tz])

    def timedelta_schema(self, schema: core_schema.TimedeltaSchema) -> JsonSchemaValue:
        base = super().timedelta_schema(schema)
        bound = self._bounded(schema, "timedelta")
        if bound:
            return self.unenforceable(bound, "format", base)
        if base.get("type") != "string":  # ser_json_timedelta="float": seconds as a number
            return base
        return string_pattern(DURATION)

    # -- identifiers, addresses, URLs ---------------------------------------------------
    def uuid_schema(self, schema: core_schema.UuidSchema) -> JsonSchemaValue:
        version = schema.get("version")
        return string_pattern(uuid_version(version) if version else UUID_ANY)

    def url_schema(self, schema: core_schema.UrlSchema) -> JsonSchemaValue:
        base = super().url_schema(schema)
        if (
            schema.get("host_required") is False
            or schema.get("default_host")
            or schema.get("default_port")
        ):
            return self.unenforceable("a URL with host defaults", "format", base)
        out = string_pattern(url_pattern(schema.get("allowed_schemes")))
        if isinstance(base.get("maxLength"), int):
            out["maxLength"] = base["maxLength"]
        return out

    def generate_inner(self, schema: Any) -> JsonSchemaValue:
        """Types pydantic validates by a function (`ByteSize`, base64) are recognised by it,
        before pydantic writes their schema; types whose JSON schema pydantic writes in a
        function (IP addresses, paths) only by their `format`, after it is written."""
        validated = self._pydantic_validated(schema)
        if validated is not None:
            return validated
        out = super().generate_inner(schema)
        fmt = out.get("format") if isinstance(out, dict) else None
        patterned = _format_patterned(out)
        if isinstance(fmt, str) and "pattern" in out and _UUID_VERSION_FORMAT.fullmatch(fmt):
            # `UuidVersion` writes its format over the pattern `uuid_schema` wrote
            out = {k: v for k, v in out.items() if k != "format"}
        elif patterned is not None:
            out = patterned
        elif fmt in UNENFORCEABLE_FORMATS:
            out = self.unenforceable(UNENFORCEABLE_FORMATS[fmt], "format", out)
        return out

    # -- numbers ------------------------------------------------------------------------
    def float_schema(self, schema: core_schema.FloatSchema) -> JsonSchemaValue:
        out = super().float_schema(schema)
        allowed = schema.get("allow_inf_nan")
        finite = not (self._config.allow_inf_nan if allowed is None else allowed)
        return finite_number(out) if finite else out

    def decimal_schema(self, schema: core_schema.DecimalSchema) -> JsonSchemaValue:
        """Bounds and `multiple_of` on a JSON number; digit limits as a pattern on the
        string form (with no bound but a lower one of 0)."""
        base = super().decimal_schema(schema)
        digits, places = schema.get("max_digits"), schema.get("decimal_places")
        bounds = {k: schema[k] for k in ("gt", "ge", "lt", "le") if schema.get(k) is not None}
        if digits is None and places is None:
            number = finite_number(next(b for b in base["anyOf"] if b.get("type") == "number"))
            if bounds or schema.get("multiple_of") is not None:
                return number  # (pydantic's string form ignores them)
            return {"anyOf": [number, string_pattern(DECIMAL)]}
        lower = next(iter(bounds), None)
        if (
            schema.get("multiple_of") is not None
            or len(bounds) > 1
            or bounds and (lower not in ("ge", "gt") or bounds[lower] != 0)
        ):
            what = "a Decimal with max_digits/decimal_places and bounds other than gt=0/ge=0"
            return self.unenforceable(what, "pattern", base)
        return string_pattern(decimal_pattern(digits, places, lower))

    def complex_schema(self, schema: core_schema.ComplexSchema) -> JsonSchemaValue:
        return string_pattern(COMPLEX)

    def bytes_schema(self, schema: core_schema.BytesSchema) -> JsonSchemaValue:
        """Bytes as the string `val_json_bytes` decodes. pydantic counts bytes where JSON
        Schema counts characters: length limits hold for ASCII, and for hex digit pairs."""
        out = super().bytes_schema(schema)
        low, high = schema.get("min_length"), schema.get("max_length")
        counts = f"{{{low or 0},{'' if high is None else high}}}"
        encoding = self._config.val_json_bytes
        if encoding == "hex":
            return string_pattern(f"({HEX}{HEX}){counts}")
        if encoding == "base64" and (low is not None or high is not None):
            return self.unenforceable("base64 bytes with a length limit", "pattern", out)
        if encoding == "base64":
            return string_pattern(base64_pattern(B64_ALPHABETS[Base64Encoder], ascii_only=False))
        return out if low is None and high is None else string_pattern(f"[ -~]{counts}")

    # -- types validated by a function ----------------------------------------------------
    def _pydantic_validated(self, schema: Any) -> JsonSchemaValue | None:
        """pydantic's types whose validator function decides what is valid (`ByteSize`, the
        base64 types), recognised by the function; those no pattern expresses go to
        `unenforceable`. None for other schemas."""
        function = schema.get("function")
        function = function.get("function") if isinstance(function, dict) else None
        name = getattr(function, "__qualname__", "")
        owner = getattr(function, "__self__", None)
        if name == "ByteSize._validate":
            return {"anyOf": [string_pattern(BYTE_SIZE), {"type": "integer", "minimum": 0}]}
        if isinstance(owner, (EncodedStr, EncodedBytes)):
            alphabet = B64_ALPHABETS.get(owner.encoder)
            if alphabet is not None:
                text = isinstance(owner, EncodedStr)
                return string_pattern(base64_pattern(alphabet, ascii_only=text))
            what = f"a value of the encoder {owner.encoder.__name__}"
            return self.unenforceable(what, "format", super().generate_inner(schema))
        if name in UNENFORCEABLE_VALIDATORS and function.__module__.startswith("pydantic."):
            what = UNENFORCEABLE_VALIDATORS[name]
            return self.unenforceable(what, "format", super().generate_inner(schema))
        return None

    def json_schema(self, schema: core_schema.JsonSchema) -> JsonSchemaValue:
        """`Json[T]`: a string holding JSON text valid for T, where a pattern expresses it."""
        base = super().json_schema(schema)
        content = self._resolved(base.get("contentSchema", {}))
        pattern = json_text_pattern(content)
        if pattern is None:
            what = (
                "a Json[...] of a type other than Any, a JSON scalar, or a list or str-keyed "
                "dict of them"
            )
            return self.unenforceable(what, "contentSchema", base)
        return string_pattern(pattern)

    def chain_schema(self, schema: core_schema.ChainSchema) -> JsonSchemaValue:
        """`Hashable` is any JSON value pydantic finds hashable: not an array or object."""
        hashable = any(
            step.get("type") == "is-instance" and step.get("cls") is Hashable
            for step in schema["steps"]
        )
        if hashable:
            return {"type": ["string", "number", "boolean", "null"]}
        return super().chain_schema(schema)

    # -- sets -------------------------------------------------------------------------------
    def set_schema(self, schema: core_schema.SetSchema) -> JsonSchemaValue:
        return _repeats_allowed(super().set_schema(schema), schema)

    def frozenset_schema(self, schema: core_schema.FrozenSetSchema) -> JsonSchemaValue:
        return _repeats_allowed(super().frozenset_schema(schema), schema)

    # -- dict keys ----------------------------------------------------------------------
    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        out = super().dict_schema(schema)
        keys = schema.get("keys_schema")
        if keys is None:
            return out
        key_pattern = self._key_pattern(keys)
        if key_pattern is not None:
            values = out.pop("additionalProperties", None)
            if values is None:
                values = next(iter(out.pop("patternProperties", {}).values()), True)
            out.pop("propertyNames", None)
            out.pop("patternProperties", None)
            out["patternProperties"] = {anchored(key_pattern): values}
        if "patternProperties" in out:
            # pydantic leaves other keys open, though its validator refuses them
            out["additionalProperties"] = False
        return out

    def _key_pattern(self, keys: Any) -> str | None:
        """The keys pydantic parses into the key type, as a pattern; None where pydantic's
        own schema for them is exact (string keys)."""
        key_json = self._resolved(self.generate_inner(keys))
        declared = key_json.get("type")
        live = {k for k in key_json if k not in ("type", "title", "description", "$ref")}
        values = (
            key_json["enum"]
            if "enum" in key_json
            else [key_json["const"]]
            if "const" in key_json
            else None
        )
        if values is not None:
            return self._choice_key_pattern(values, keys)
        if not live and declared is None or _any_string_branch(key_json):
            return None  # `Any`, or a union with `str`: every key validates
        if declared == "string":
            return (
                None
                if live <= {"pattern", "minLength", "maxLength"}
                else self._unenforced_key(key_json)
            )
        if live:
            return self._unenforced_key(key_json)
        scalar = {"integer": INT_KEY, "number": FLOAT_KEY, "boolean": BOOL_KEY}
        return scalar[declared] if declared in scalar else self._unenforced_key(key_json)

    def _choice_key_pattern(self, values: list[Any], keys: Any) -> str | None:
        """Literal keys match only strings; Enum keys also parse their int values."""
        is_literal = keys.get("type") == "literal"
        texts = [
            v if isinstance(v, str) else str(v)
            for v in values
            if isinstance(v, str)
            or (not is_literal and isinstance(v, int) and not isinstance(v, bool))
        ]
        if not texts:
            return self._unenforced_key({"enum": values})
        return "|".join(escape_regex(t) for t in sorted(set(texts), key=lambda t: (-len(t), t)))

    def _unenforced_key(self, key_json: JsonSchemaValue) -> str | None:
        """None (pydantic's own key schema stays) once `unenforceable` lets it pass."""
        self.unenforceable(f"a dict key of schema {key_json}", "propertyNames", key_json)
        return None

    def _resolved(self, json_schema: JsonSchemaValue) -> JsonSchemaValue:
        ref = json_schema.get("$ref")
        if not isinstance(ref, str):
            return json_schema
        try:
            return self.get_schema_from_definitions(ref) or json_schema  # type: ignore[arg-type]
        except Exception:  # not written yet (a recursive key type): judged as it stands
            return json_schema


def _any_string_branch(key_json: JsonSchemaValue) -> bool:
    branches = key_json.get("anyOf")
    return isinstance(branches, list) and {"type": "string"} in branches


class LenientGrammarJsonSchema(GrammarJsonSchema):
    """strict=False: what no pattern expresses keeps pydantic's schema."""

    strict: ClassVar[bool] = False


def grammar_json_schema(
    adapter: TypeAdapter[Any], strict: bool
) -> tuple[JsonSchemaValue, tuple[str, ...]]:
    """The JSON schema of a pydantic type for the grammar, and what it leaves unenforced
    (strict=False only)."""
    made: list[GrammarJsonSchema] = []

    def generator(**kwargs: Any) -> GrammarJsonSchema:
        # a factory, so the generator's findings can be read after (the adapter rebuilds a
        # type with forward references first, as for its own schema)
        made.append((GrammarJsonSchema if strict else LenientGrammarJsonSchema)(**kwargs))
        return made[-1]

    schema = adapter.json_schema(schema_generator=generator)  # type: ignore[arg-type]
    return schema, tuple(made[0].unenforced)
