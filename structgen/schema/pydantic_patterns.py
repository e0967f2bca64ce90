"""Regular expressions for pydantic types, each accepting only strings pydantic's JSON-mode
validator accepts (a subset where pydantic's rule is not regular): dates, times and durations,
IP addresses, UUIDs, URLs, numbers as text, base64, byte sizes, JSON inside a string. Used by
`pydantic_types.GrammarJsonSchema`; tests/test_pydantic_formats.py and
tests/test_pydantic_sampled.py check them against pydantic."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ByteSize
from pydantic.json_schema import JsonSchemaValue
from pydantic.types import Base64Encoder, Base64UrlEncoder

from structgen.schema.patterns import escape_regex

HEX = "[0-9a-fA-F]"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"  # Python's ipaddress: no leading zeros
_IPV4 = rf"{_OCTET}(\.{_OCTET}){{3}}"
_H6 = f"{HEX}{{1,4}}"
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

UUID_ANY = f"{HEX}{{8}}-{HEX}{{4}}-{HEX}{{4}}-{HEX}{{4}}-{HEX}{{12}}"


def uuid_version(version: int) -> str:
    """A version other than the nil UUID's needs the RFC 4122 variant bits (8, 9, a, b)."""
    return f"{HEX}{{8}}-{HEX}{{4}}-{version}{HEX}{{3}}-[89abAB]{HEX}{{3}}-{HEX}{{12}}"


# Year 0000 is out of Python's range; February 29th only in leap years.
_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = "((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
DATE = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
# No leap second (pydantic refuses ":60"); at most microseconds.
CLOCK = r"([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9](\.[0-9]{1,6})?)?"
_OFFSET = "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
TZ_SUFFIX = {None: f"{_OFFSET}?", "naive": "", "aware": _OFFSET}

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
DURATION = f"-?P(({_DURATION_DATE})(T({_DURATION_TIME}))?|T({_DURATION_TIME}))"

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
INT_KEY = "-?(0|[1-9][0-9]{0,17})"
FLOAT_KEY = f"-?{_UNSIGNED}"
BOOL_KEY = "true|false"

# A JSON number's exponent is unbounded, and pydantic refuses the infinity a long one makes
# for a Decimal, or a float with allow_inf_nan=False: with a bound, both backends write the
# number without one. Decimals are also strings of digits, as are `complex` and `Fraction`.
COMPLEX = rf"-?{_UNSIGNED}([+-]({_UNSIGNED})?j)?|-?({_UNSIGNED})?j"
_FRACTION = r"-?[0-9]{1,18}(/[1-9][0-9]{0,17}|\.[0-9]{1,18})?"
DECIMAL = r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,18})?"
_FINITE_BOUND = 1e15  # past about 1e18 llguidance cannot write a number range

# `ByteSize`: a number and a unit of `ByteSize.byte_sizes`, in any case.
_BYTE_UNIT = "|".join(
    "".join(f"[{c.lower()}{c.upper()}]" for c in unit)
    for unit in sorted(ByteSize.byte_sizes, key=lambda u: (-len(u), u))
)
BYTE_SIZE = rf"[0-9]{{1,18}}(\.[0-9]{{1,18}})? ?({_BYTE_UNIT})?"

# JSON text inside a string (`Json[...]`), without whitespace; strings of printable ASCII
# without escapes.
_JSON_STRING = r'"[ !#-\[\]-~]*"'
_JSON_SCALARS = {
    "integer": INT_KEY,
    "number": FLOAT_KEY,
    "boolean": BOOL_KEY,
    "null": "null",
    "string": _JSON_STRING,
}
_JSON_SCALAR = "|".join(_JSON_SCALARS.values())

_B64_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
B64_ALPHABETS = {Base64Encoder: _B64_LETTERS + "+/", Base64UrlEncoder: _B64_LETTERS + "-_"}


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


def finite_number(bounds: JsonSchemaValue) -> JsonSchemaValue:
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
