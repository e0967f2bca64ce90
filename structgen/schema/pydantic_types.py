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

from pydantic import ByteSize, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic.types import Base64Encoder, Base64UrlEncoder, EncodedBytes, EncodedStr
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
_URL_HOST = rf"{_LABEL}(\.{_LABEL})*"
_URL_PORT = "(:[0-9]{1,4})?"
_URL_PATH = rf"(/{_URL_CHAR}*)*(\?({_URL_CHAR}|/|\?)*)?(#({_URL_CHAR}|/|\?)*)?"
# Any scheme; a file URL takes no port, so "file" (in any case) is apart.
_FILE_SCHEME = "[fF][iI][lL][eE]"
_SCHEME_CHAR = "[a-zA-Z0-9+.-]"
_PORTED_SCHEME = "|".join(
    (
        f"[a-zA-Z]({_SCHEME_CHAR}{{0,2}}|{_SCHEME_CHAR}{{4,15}})",
        f"[a-eg-zA-EG-Z]{_SCHEME_CHAR}{{3}}",
        f"[fF][a-hj-zA-HJ-Z0-9+.-]{_SCHEME_CHAR}{{2}}",
        f"[fF][iI][a-km-zA-KM-Z0-9+.-]{_SCHEME_CHAR}",
        "[fF][iI][lL][a-df-zA-DF-Z0-9+.-]",
    )
)

# Numbers in strings, with exponents short enough to stay finite.
_UNSIGNED = r"(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?"

# Dict keys arrive as strings; pydantic parses them into the key type.
_INT_KEY = "-?(0|[1-9][0-9]{0,17})"
_FLOAT_KEY = f"-?{_UNSIGNED}"
_BOOL_KEY = "true|false"

# A JSON number's exponent is unbounded, and pydantic refuses the infinity a long one makes
# for a Decimal, or a float with allow_inf_nan=False: with a bound, both backends write the
# number without one. Decimals are also strings of digits, as are `complex` and `Fraction`.
_COMPLEX = rf"-?{_UNSIGNED}([+-]({_UNSIGNED})?j)?|-?({_UNSIGNED})?j"
_FRACTION = r"-?[0-9]{1,18}(/[1-9][0-9]{0,17}|\.[0-9]{1,18})?"
_DECIMAL = r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,18})?"
_FINITE_BOUND = 1e15  # past about 1e18 llguidance cannot write a number range

# `ByteSize`: a number and a unit of `ByteSize.byte_sizes`, in any case.
_BYTE_UNIT = "|".join(
    "".join(f"[{c.lower()}{c.upper()}]" for c in unit)
    for unit in sorted(ByteSize.byte_sizes, key=lambda u: (-len(u), u))
)
_BYTE_SIZE = rf"[0-9]{{1,18}}(\.[0-9]{{1,18}})? ?({_BYTE_UNIT})?"

# JSON text inside a string (`Json[...]`), without whitespace; strings of printable ASCII
# without escapes.
_JSON_STRING = r'"[ !#-\[\]-~]*"'
_JSON_SCALARS = {
    "integer": _INT_KEY,
    "number": _FLOAT_KEY,
    "boolean": _BOOL_KEY,
    "null": "null",
    "string": _JSON_STRING,
}
_JSON_SCALAR = "|".join(_JSON_SCALARS.values())

_B64_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_B64_ALPHABETS = {Base64Encoder: _B64_LETTERS + "+/", Base64UrlEncoder: _B64_LETTERS + "-_"}


def _sextets(alphabet: str, keep: Callable[[int], bool] = lambda value: True) -> str:
    """A class of the base64 characters whose 6-bit value is kept, as ranges."""
    runs: list[list[str]] = []
    for c in sorted(c for value, c in enumerate(alphabet) if keep(value)):
        if runs and ord(c) == ord(runs[-1][1]) + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return "[" + "".join(_class_run(a, b) for a, b in runs) + "]"


def _class_run(first: str, last: str) -> str:
    inner = "".join(_in_class(chr(p)) for p in range(ord(first), ord(last) + 1))
    return inner if len(inner) <= 2 else f"{_in_class(first)}-{_in_class(last)}"


def _in_class(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


def base64_pattern(alphabet: str, ascii_only: bool) -> str:
    """What Python's `b64decode` decodes (groups of four characters, the last one padded);
    `ascii_only`: only encodings of ASCII text, which decodes as UTF-8 (`Base64Str`): the top
    bit of each byte is bit 5 of the group's 1st character, bit 3 of its 2nd, bit 1 of its 3rd."""
    if not ascii_only:
        any_ = _sextets(alphabet)
        return f"({any_}{{4}})*({any_}{{2}}==|{any_}{{3}}=)?"
    first = _sextets(alphabet, lambda v: not v & 32)
    second = _sextets(alphabet, lambda v: not v & 8)
    third = _sextets(alphabet, lambda v: not v & 2)
    any_ = _sextets(alphabet)
    return f"({first}{second}{third}{any_})*({first}{any_}==|{first}{second}{any_}=)?"


def url_pattern(schemes: list[str] | None) -> str:
    """URLs of `schemes` (None: any), a port only where the scheme is not "file"."""
    if schemes:
        ported = "|".join(escape_regex(s) for s in schemes if s != "file")
        file = "file" if "file" in schemes else ""
    else:
        ported, file = _PORTED_SCHEME, _FILE_SCHEME
    urls = [f"({ported})://{_URL_HOST}{_URL_PORT}{_URL_PATH}"] if ported else []
    if file:
        urls.append(f"({file})://{_URL_HOST}{_URL_PATH}")
    return "|".join(urls)


def json_text_pattern(content: JsonSchemaValue) -> str | None:
    """JSON texts valid against `content` (scalars, arrays and string-keyed objects of them,
    `anyOf`; `{}` is any scalar, or an array or object of scalars), as a pattern; None for
    other schemas."""
    live = {k: v for k, v in content.items() if k not in ("title", "description")}
    declared = live.get("type")
    if not live:
        return f"{_JSON_SCALAR}|{_json_array(_JSON_SCALAR)}|{_json_object(_JSON_SCALAR)}"
    if set(live) == {"anyOf"}:
        branches = [json_text_pattern(b) for b in live["anyOf"]]
        return None if None in branches else "|".join(f"({b})" for b in branches)
    if set(live) == {"type"} and declared in _JSON_SCALARS:
        return _JSON_SCALARS[declared]
    if declared == "array" and set(live) <= {"type", "items"}:
        items = json_text_pattern(live.get("items", {}))
        return None if items is None else _json_array(items)
    if declared == "object" and set(live) <= {"type", "additionalProperties"}:
        values = json_text_pattern(live.get("additionalProperties", {}))
        return None if values is None else _json_object(values)
    return None


def _json_array(items: str) -> str:
    return rf"\[(({items})(,({items}))*)?\]"


def _json_object(values: str) -> str:
    member = f"{_JSON_STRING}:({values})"
    return rf"\{{({member}(,{member})*)?\}}"


def decimal_pattern(digits: int | None, places: int | None, lower: str | None) -> str:
    """Decimals in plain notation within pydantic's `max_digits` (`digits`) and
    `decimal_places` (`places`; with both, at most digits - places before the point);
    `lower`: None, "ge" (no sign) or "gt" (no sign, not zero)."""
    if digits is None:
        shapes = [(18, 18 if places is None else places)]
    elif places is not None:
        shapes = [(max(digits - places, 0), places)]
    else:
        shapes = [(digits - fraction, fraction) for fraction in range(digits + 1)]
    alternatives = [a for w, f in shapes for a in _decimal_shapes(w, f, lower == "gt")]
    return ("" if lower else "-?") + "(" + "|".join(dict.fromkeys(alternatives)) + ")"


def _decimal_shapes(whole: int, fraction: int, positive: bool) -> list[str]:
    """At most `whole` digits before the point and `fraction` after it. A fraction ends in a
    nonzero digit (trailing zeros change nothing for pydantic), so a number with one is not
    zero."""
    tail = rf"\.{_up_to('[0-9]', fraction - 1)}[1-9]" if fraction else ""
    out = [f"[1-9]{_up_to('[0-9]', whole - 1)}" + (f"({tail})?" if tail else "")] if whole else []
    if tail:
        out.append("0" + tail)
    if not positive:
        out.append("0")
    return out


def _up_to(atom: str, count: int) -> str:
    return f"{atom}{{0,{count}}}" if count > 0 else ""


def _finite_number(bounds: JsonSchemaValue) -> JsonSchemaValue:
    """A JSON number with `bounds`, and ±_FINITE_BOUND where it has none (see _UNSIGNED)."""
    out = {"type": "number", **bounds}
    if "minimum" not in out and "exclusiveMinimum" not in out:
        out["minimum"] = -_FINITE_BOUND
    if "maximum" not in out and "exclusiveMaximum" not in out:
        out["maximum"] = _FINITE_BOUND
    return out


# Formats pydantic writes for types whose schema it builds by a function (IP addresses,
# fractions).
FORMAT_PATTERNS: dict[str, str] = {
    "fraction": _FRACTION,
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
        if isinstance(fmt, str) and "pattern" in out and _UUID_VERSION_FORMAT.fullmatch(fmt):
            # `UuidVersion` writes its format over the pattern `uuid_schema` wrote
            out = {k: v for k, v in out.items() if k != "format"}
        elif _format_patterned(out) is not None:
            out = _format_patterned(out)
        elif fmt in UNENFORCEABLE_FORMATS:
            out = self.unenforceable(UNENFORCEABLE_FORMATS[fmt], "format", out)
        return out

    # -- numbers ------------------------------------------------------------------------
    def float_schema(self, schema: core_schema.FloatSchema) -> JsonSchemaValue:
        out = super().float_schema(schema)
        allowed = schema.get("allow_inf_nan")
        finite = not (self._config.allow_inf_nan if allowed is None else allowed)
        return _finite_number(out) if finite else out

    def decimal_schema(self, schema: core_schema.DecimalSchema) -> JsonSchemaValue:
        """Bounds and `multiple_of` on a JSON number; digit limits as a pattern on the
        string form (with no bound but a lower one of 0)."""
        base = super().decimal_schema(schema)
        digits, places = schema.get("max_digits"), schema.get("decimal_places")
        bounds = {k: schema[k] for k in ("gt", "ge", "lt", "le") if schema.get(k) is not None}
        if digits is None and places is None:
            number = _finite_number(next(b for b in base["anyOf"] if b.get("type") == "number"))
            if bounds or schema.get("multiple_of") is not None:
                return number  # (pydantic's string form ignores them)
            return {"anyOf": [number, string_pattern(_DECIMAL)]}
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
        return string_pattern(_COMPLEX)

    def bytes_schema(self, schema: core_schema.BytesSchema) -> JsonSchemaValue:
        """Bytes as the string `val_json_bytes` decodes. pydantic counts bytes where JSON
        Schema counts characters: length limits hold for ASCII, and for hex digit pairs."""
        out = super().bytes_schema(schema)
        low, high = schema.get("min_length"), schema.get("max_length")
        counts = f"{{{low or 0},{'' if high is None else high}}}"
        encoding = self._config.val_json_bytes
        if encoding == "hex":
            return string_pattern(f"({_HEX}{_HEX}){counts}")
        if encoding == "base64" and (low is not None or high is not None):
            return self.unenforceable("base64 bytes with a length limit", "pattern", out)
        if encoding == "base64":
            return string_pattern(base64_pattern(_B64_ALPHABETS[Base64Encoder], ascii_only=False))
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
            return {"anyOf": [string_pattern(_BYTE_SIZE), {"type": "integer", "minimum": 0}]}
        if isinstance(owner, (EncodedStr, EncodedBytes)):
            alphabet = _B64_ALPHABETS.get(owner.encoder)
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
