"""JSON schemas for pydantic types whose grammar must be as strict as pydantic's validator.

pydantic describes many types by a `format` alone (`duration`, `uuid4`, `ipv4network`, ...)
that no backend enforces as pydantic validates (non-spec formats are stripped, spec ones are
looser or differ), and it drops dict key types that are not strings (`dict[int, str]` keys
become any string). `GrammarJsonSchema` writes such types as a `pattern` (dict keys as
`patternProperties` with `additionalProperties: false`) that accepts a subset of what
pydantic accepts in JSON mode, so both backends enforce it. Types no pattern can express
(time-dependent or filesystem-dependent checks, bounds on dates) raise
`UnsupportedSchemaError`, or with strict=False keep pydantic's schema and are listed as
relaxed (pydantic validates the output afterwards).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from structgen.errors import UnsupportedSchemaError
from structgen.schema.patterns import escape_regex

# -- the patterns (each accepts only strings pydantic's JSON-mode validator accepts) ---------
_HEX = "[0-9a-fA-F]"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"  # Python's ipaddress: no leading zeros
_IPV4 = rf"{_OCTET}(\.{_OCTET}){{3}}"
_H6 = f"{_HEX}{{1,4}}"
_IPV6 = "(" + "|".join(
    (
        f"({_H6}:){{7}}{_H6}",
        f"({_H6}:){{1,7}}:",
        f"({_H6}:){{1,6}}:{_H6}",
        f"({_H6}:){{1,5}}(:{_H6}){{1,2}}",
        f"({_H6}:){{1,4}}(:{_H6}){{1,3}}",
        f"({_H6}:){{1,3}}(:{_H6}){{1,4}}",
        f"({_H6}:){{1,2}}(:{_H6}){{1,5}}",
        f"{_H6}:(:{_H6}){{1,6}}",
        f":((:{_H6}){{1,7}}|:)",
    )
) + ")"  # fmt: skip
_V4_PREFIX = "([0-9]|[12][0-9]|3[0-2])"
_V6_PREFIX = "([0-9]|[1-9][0-9]|1[01][0-9]|12[0-8])"
# Networks must have no host bits set: only prefixes on octet/group boundaries, whose host
# part is written as zeros, are offered (a subset: "10.0.0.0/8", not "10.16.0.0/12").
_IPV4_NETWORK = (
    rf"({_IPV4}(/32)?|{_OCTET}(\.{_OCTET}){{2}}\.0/24|{_OCTET}\.{_OCTET}\.0\.0/16"
    rf"|{_OCTET}\.0\.0\.0/8|0\.0\.0\.0/0)"
)
_IPV6_NETWORK = (
    f"({_IPV6}(/128)?|::/0|" + "|".join(f"({_H6}:){{{k}}}:/{16 * k}" for k in range(1, 7)) + ")"
)
_IPV4_INTERFACE = f"{_IPV4}(/{_V4_PREFIX})?"
_IPV6_INTERFACE = f"{_IPV6}(/{_V6_PREFIX})?"

_UUID_ANY = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"


def _uuid_version(version: int) -> str:
    """A version other than the nil UUID's needs the RFC 4122 variant bits (8, 9, a, b)."""
    return f"{_HEX}{{8}}-{_HEX}{{4}}-{version}{_HEX}{{3}}-[89abAB]{_HEX}{{3}}-{_HEX}{{12}}"


# Year 0000 is out of Python's range; February 29th only in leap years.
_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = "((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
_DATE = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
# No leap second (pydantic refuses ":60"); at most microseconds.
_CLOCK = r"([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9](\.[0-9]{1,6})?)?"
_OFFSET = "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_TZ_SUFFIX = {None: f"{_OFFSET}?", "naive": "", "aware": _OFFSET}

# Bounded digit runs: pydantic refuses numbers past u32 in a duration, and 999,999,999 days.
_DURATION_DATE = "|".join(
    (
        "[0-9]{1,4}Y([0-9]{1,4}M)?([0-9]{1,4}W)?([0-9]{1,6}D)?",
        "[0-9]{1,4}M([0-9]{1,4}W)?([0-9]{1,6}D)?",
        "[0-9]{1,4}W([0-9]{1,6}D)?",
        "[0-9]{1,6}D",
    )
)
_DURATION_TIME = "|".join(
    (
        r"[0-9]{1,6}H([0-9]{1,6}M)?([0-9]{1,6}(\.[0-9]{1,6})?S)?",
        r"[0-9]{1,6}M([0-9]{1,6}(\.[0-9]{1,6})?S)?",
        r"[0-9]{1,6}(\.[0-9]{1,6})?S",
    )
)
_DURATION = f"-?P(({_DURATION_DATE})(T({_DURATION_TIME}))?|T({_DURATION_TIME}))"

# URLs: scheme://host[:port][/path][?query][#fragment] with an ASCII host name or IPv4
# address, a port below 10000 and unreserved/sub-delimiter characters; pydantic (the `url`
# crate) accepts more.
_LABEL = "[a-zA-Z0-9]([a-zA-Z0-9-]{0,30}[a-zA-Z0-9])?"
_URL_CHAR = "[a-zA-Z0-9._~!$&'()*+,;=:@%-]"
_URL_REST = rf"(:[0-9]{{1,4}})?(/{_URL_CHAR}*)*(\?({_URL_CHAR}|/|\?)*)?(#({_URL_CHAR}|/|\?)*)?"
_ANY_SCHEME = "[a-zA-Z][a-zA-Z0-9+.-]{0,15}"

# Dict keys arrive as strings; pydantic parses them into the key type.
_INT_KEY = "-?(0|[1-9][0-9]{0,17})"
_FLOAT_KEY = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?"
_BOOL_KEY = "true|false"

# Formats pydantic writes for types whose schema it builds by a function (IP addresses).
FORMAT_PATTERNS: dict[str, str] = {
    "ipv4": _IPV4,
    "ipv6": _IPV6,
    "ipvanyaddress": f"{_IPV4}|{_IPV6}",
    "ipv4network": _IPV4_NETWORK,
    "ipv6network": _IPV6_NETWORK,
    "ipvanynetwork": f"{_IPV4_NETWORK}|{_IPV6_NETWORK}",
    "ipv4interface": _IPV4_INTERFACE,
    "ipv6interface": _IPV6_INTERFACE,
    "ipvanyinterface": f"{_IPV4_INTERFACE}|{_IPV6_INTERFACE}",
}
# Formats whose validity depends on more than the text (the filesystem, installed packages).
UNENFORCEABLE_FORMATS: dict[str, str] = {
    "file-path": "an existing file (FilePath)",
    "directory-path": "an existing directory (DirectoryPath)",
    "socket-path": "an existing socket (SocketPath)",
    "multi-host-uri": "a multi-host URL / DSN (PostgresDsn, ...)",
}
_UUID_VERSION_FORMAT = re.compile("uuid[1-8]")
_VALIDATION_KEYWORDS = ("le", "ge", "lt", "gt", "now_op", "now_utc_offset")


def anchored(pattern: str) -> str:
    """Both backends match a pattern against the whole string only when it is anchored."""
    return f"^({pattern})$"


def string_pattern(pattern: str) -> JsonSchemaValue:
    return {"type": "string", "pattern": anchored(pattern)}


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
        return string_pattern(_DATE)

    def time_schema(self, schema: core_schema.TimeSchema) -> JsonSchemaValue:
        return self._zoned(schema, "time", _CLOCK, super().time_schema)

    def datetime_schema(self, schema: core_schema.DatetimeSchema) -> JsonSchemaValue:
        return self._zoned(schema, "datetime", f"{_DATE}T{_CLOCK}", super().datetime_schema)

    def _zoned(self, schema: Any, name: str, body: str,
               pydantic_schema: Callable[[Any], JsonSchemaValue]) -> JsonSchemaValue:
        """A time or datetime: `body` and the time zone its `tz_constraint` asks for; a bound
        or a fixed offset no pattern expresses goes to `unenforceable` with pydantic's schema."""
        bound = self._bounded(schema, name)
        tz = schema.get("tz_constraint")
        if bound or tz not in _TZ_SUFFIX:
            why = bound or f"a {name} with the fixed UTC offset {tz!r}"
            return self.unenforceable(why, "format", pydantic_schema(schema))
        return string_pattern(body + _TZ_SUFFIX[tz])

    def timedelta_schema(self, schema: core_schema.TimedeltaSchema) -> JsonSchemaValue:
        base = super().timedelta_schema(schema)
        bound = self._bounded(schema, "timedelta")
        if bound:
            return self.unenforceable(bound, "format", base)
        if base.get("type") != "string":  # ser_json_timedelta="float": seconds as a number
            return base
        return string_pattern(_DURATION)

    # -- identifiers, addresses, URLs ---------------------------------------------------
    def uuid_schema(self, schema: core_schema.UuidSchema) -> JsonSchemaValue:
        version = schema.get("version")
        return string_pattern(_uuid_version(version) if version else _UUID_ANY)

    def url_schema(self, schema: core_schema.UrlSchema) -> JsonSchemaValue:
        base = super().url_schema(schema)
        if (
            schema.get("host_required") is False
            or schema.get("default_host")
            or schema.get("default_port")
        ):
            return self.unenforceable("a URL with host defaults", "format", base)
        schemes = schema.get("allowed_schemes")
        scheme = "|".join(schemes) if schemes else _ANY_SCHEME
        out = string_pattern(f"({scheme})://({_LABEL}(\\.{_LABEL})*){_URL_REST}")
        if isinstance(base.get("maxLength"), int):
            out["maxLength"] = base["maxLength"]
        return out

    def generate_inner(self, schema: Any) -> JsonSchemaValue:
        """Types whose JSON schema pydantic writes in a function (IP addresses, paths) are
        only recognisable by their `format`, after it is written."""
        out = super().generate_inner(schema)
        fmt = out.get("format") if isinstance(out, dict) else None
        if isinstance(fmt, str) and "pattern" in out and _UUID_VERSION_FORMAT.fullmatch(fmt):
            # `UuidVersion` writes its format over the pattern `uuid_schema` wrote
            out = {k: v for k, v in out.items() if k != "format"}
        elif fmt in FORMAT_PATTERNS and out.get("type") == "string":
            out = {k: v for k, v in out.items() if k != "format"}
            out["pattern"] = anchored(FORMAT_PATTERNS[fmt])
        elif fmt in UNENFORCEABLE_FORMATS:
            out = self.unenforceable(UNENFORCEABLE_FORMATS[fmt], "format", out)
        return out

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
        scalar = {"integer": _INT_KEY, "number": _FLOAT_KEY, "boolean": _BOOL_KEY}
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
