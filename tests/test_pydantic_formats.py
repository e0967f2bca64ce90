"""pydantic types whose schema pydantic writes as a `format`, drops (dict key types) or leaves
to a validator function (base64, `ByteSize`, `Json`): their grammar must be at least as strict
as pydantic's validator, on both backends (structgen/schema/pydantic_types.py).
tests/test_pydantic_sampled.py checks every kind of field type the same way, by sampling."""

from __future__ import annotations

import codecs
import datetime
import decimal
import enum
import fractions
import ipaddress
import json
import time
import typing
import uuid
import zoneinfo
from typing import Any, Literal

import pydantic
import pytest
from pydantic import (
    UUID1,
    UUID4,
    AnyUrl,
    AwareDatetime,
    Base64Bytes,
    Base64Str,
    Base64UrlBytes,
    Base64UrlStr,
    BaseModel,
    ByteSize,
    CockroachDsn,
    FileUrl,
    FiniteFloat,
    FutureDate,
    HttpUrl,
    IPvAnyAddress,
    IPvAnyInterface,
    IPvAnyNetwork,
    Json,
    NaiveDatetime,
    conbytes,
    condecimal,
    constr,
)

from structgen.errors import UnsupportedSchemaError
from structgen.types import to_constraint

BACKENDS = ("xgrammar", "llguidance")
U4 = "12345678-1234-4234-8234-123456789abc"


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Point(BaseModel):
    x: int


class Rot13(pydantic.EncoderProtocol):
    @classmethod
    def decode(cls, data: bytes) -> bytes:
        return codecs.encode(data.decode(), "rot13").encode()

    @classmethod
    def encode(cls, value: bytes) -> bytes:
        return cls.decode(value)

    @classmethod
    def get_json_format(cls) -> str:
        return "rot13"


class Base64Config(BaseModel):
    model_config = pydantic.ConfigDict(val_json_bytes="base64")
    x: bytes


class HexConfig(BaseModel):
    model_config = pydantic.ConfigDict(val_json_bytes="hex")
    x: bytes


class FiniteConfig(BaseModel):
    model_config = pydantic.ConfigDict(allow_inf_nan=False)
    x: float


def q(*texts: str) -> list[str]:
    """Strings as the JSON texts the grammar generates."""
    return [json.dumps(t) for t in texts]


# type -> (valid JSON texts the grammar must accept, invalid ones it used to accept)
CASES: dict[Any, tuple[list[str], list[str]]] = {
    datetime.timedelta: (
        q("P1D", "PT1H", "P1Y2M3DT4H5M6S", "P1W", "-P1D", "PT1.5S", "P0D", "P999999D"),
        q(
            "P12001212211111111111111111111D",
            "PT999999999999S",
            "P",
            "PT",
            "P1d",
            "hello",
            "P1DT58394899246S",
        ),
    ),
    UUID4: (
        q(U4, U4.upper()),
        q("hello world", "12345678-1234-1234-8234-123456789abc", U4.replace("-8", "-c")),
    ),
    UUID1: (q("12345678-1234-1234-8234-123456789abc"), q(U4, "x")),
    uuid.UUID: (
        q(U4, "00000000-0000-0000-0000-000000000000"),
        q("12345678-1234-1234-0234-123456789ab", "x"),
    ),
    ipaddress.IPv4Address: (
        q("1.2.3.4", "0.0.0.0", "255.255.255.255"),
        q("0.040.000.99", "01.2.3.4", "256.1.1.1", "1.2.3"),
    ),
    ipaddress.IPv6Address: (
        q("::1", "::", "2001:db8::1", "1:2:3:4:5:6:7:8"),
        q("1::2::3", "1:2:3:4:5:6:7:8:9", "01234::", "x"),
    ),
    IPvAnyAddress: (q("1.2.3.4", "::1"), q("x", "1.2.3.04", "hello world")),
    ipaddress.IPv4Network: (
        q("10.0.0.0/8", "10.1.0.0/16", "10.0.0.1", "0.0.0.0/0"),
        q("10.0.0.1/8", "10.0.0.0/33", "x"),
    ),
    ipaddress.IPv6Network: (
        q("2001:db8::/32", "::/0", "::1/128", "::1"),
        q("2001:db8::1/32", "2001:db8::/129", "x"),
    ),
    IPvAnyNetwork: (q("10.0.0.0/8", "::/0"), q("10.0.0.1/8", "x")),
    ipaddress.IPv4Interface: (q("10.0.0.1/8", "10.0.0.1"), q("10.0.0.1/33", "x")),
    ipaddress.IPv6Interface: (q("2001:db8::1/64", "::1"), q("::1/129", "x")),
    IPvAnyInterface: (q("10.0.0.1/8", "2001:db8::1/64"), q("10.0.0.1/33", "x")),
    HttpUrl: (
        q(
            "http://a.com",
            "https://example.com/x?y=1",
            "http://localhost:8080/p",
            "http://1.2.3.4/",
        ),
        q("ftp://a.com", "a.com", "http://", "http://a b.com", "http://a.com:99999"),
    ),
    AnyUrl: (q("ftp://a.com/x", "https://example.com/a/b#c"), q("a.com", "http://", "hello world")),
    datetime.date: (
        q("2020-01-01", "2020-02-29", "2000-02-29", "0001-01-01", "9999-12-31"),
        q("2021-02-29", "1900-02-29", "2020-13-01", "0000-01-01", "2020-1-1"),
    ),
    datetime.time: (
        q("10:20:30", "10:20", "10:20:30.123456Z", "10:20:30+01:00"),
        q("10:20:60Z", "24:00:00", "10:20:30+24:00", "1:20:30", "10:2030", "21:385"),
    ),
    datetime.datetime: (
        q("2020-01-01T10:20:30", "2020-01-01T10:20:30Z", "2020-02-29T23:59:59.5-05:30"),
        q(
            "2020-01-01T24:00:00",
            "2020-01-01T10:20:60",
            "2021-02-29T10:20:30",
            "2020-01-01T10:20:30+2400",
            "2020-01-01T11:5545+16:43",
        ),
    ),
    NaiveDatetime: (
        q("2020-01-01T10:20:30", "2020-01-01T10:20"),
        q("2020-01-01T10:20:30Z", "2020-01-01T10:20:30+01:00"),
    ),
    AwareDatetime: (
        q("2020-01-01T10:20:30Z", "2020-01-01T10:20:30+01:00"),
        q("2020-01-01T10:20:30", "2020-01-01T10:20"),
    ),
    dict[int, str]: (
        ['{"404": "Not Found"}', '{"-1": "a", "0": "b"}', "{}"],
        ['{"404": "Not Found", "": ""}', '{"x": "a"}', '{"1e3": "a"}'],
    ),
    dict[float, str]: (
        ['{"1.5": "a"}', '{"-2": "b"}', '{"1e3": "c"}'],
        ['{"": "a"}', '{"x": "a"}'],
    ),
    dict[bool, int]: (['{"true": 1, "false": 0}'], ['{"maybe": 1}', '{"": 1}']),
    dict[Color, int]: (['{"red": 1, "blue": 2}'], ['{"RED": 1}', '{"green": 1}']),
    dict[Level, int]: (['{"1": 1, "2": 2}'], ['{"3": 1}', '{"LOW": 1}']),
    dict[Literal["a", "b"], int]: (['{"a": 1}', '{"b": 2}'], ['{"c": 1}', '{"": 1}']),
    dict[uuid.UUID, int]: ([f'{{"{U4}": 1}}'], ['{"x": 1}']),
    dict[datetime.date, int]: (['{"2020-01-31": 1}'], ['{"2020-02-30": 1}', '{"x": 1}']),
    # base64 as Python's b64decode reads it: padding required; a Base64Str decodes to UTF-8
    Base64Str: (q("", "aGVsbG8=", "aGk=", "YWJj"), q("not base64!!", "aGVsbG8", "/w==", "a===")),
    Base64Bytes: (q("", "/w==", "aGVsbG8=", "+/+/"), q("not base64!!", "aGVsbG8", "a===")),
    Base64UrlStr: (q("aGk=", "LV8t"), q("aGk", "/w==", "x")),
    Base64UrlBytes: (q("-_-_", "_w=="), q("aGk", "a")),
    ByteSize: (
        ['"12 kb"', '"1.5MiB"', '"3 GIB"', '"10"', '"7b"', "42"],
        ['"12 parsecs"', '"kb"', "-1", '"1e3"', '"12 kbx"'],
    ),
    # JSON text in a string; xgrammar writes a pattern's quotes unescaped, so none here
    Json: (q("{}", "[1,2]", "null", "-1.5", "true", "[]"), q("{not json", "", "nope", "[1,")),
    Json[list[int]]: (q("[]", "[1,-2]"), q("[1,", "[1.5]", "{}", "")),
    complex: (q("1+2j", "-1.5e3-2j", "j", "3"), q("1 + 2j", "x", "")),
    fractions.Fraction: (q("1/3", "-2", "0.5"), q("1/0", "1 / 2", "x")),
    decimal.Decimal: (["1.5", '"1.5"', '"-0"', "-12"], ["1e400", '"NaN"', '"x"']),
    condecimal(max_digits=4, decimal_places=2): (
        q("12.34", "0.5", "-1", "0"),
        q("123.4", "1.234", "12345", "999"),
    ),
    condecimal(gt=0, decimal_places=1): (q("0.5", "12"), q("0", "-1", "0.55")),
    FiniteFloat: (["1.5", "-2"], ["1e400", "-1e999"]),
    conbytes(max_length=3): (q("abc", ""), q("abcd", "ééé")),
    typing.Hashable: (["1", '"a"', "null", "true"], ["[1]", "{}"]),
    FileUrl: (q("file://host/x", "file://a.b/x?y#z"), q("file://host:82/x", "http://a.com")),
    CockroachDsn: (q("cockroachdb+asyncpg://h/db"), q("cockroachdbbasyncpg://h/db")),
    # model_config options that change what pydantic reads
    Base64Config: (['{"x": "aGk="}', '{"x": ""}'], ['{"x": "not base64!!"}', '{"x": "a==="}']),
    HexConfig: (['{"x": "00ff"}', '{"x": ""}'], ['{"x": "0"}', '{"x": "zz"}']),
    FiniteConfig: (['{"x": 1.5}'], ['{"x": 1e400}']),
    # an optional group that ends in a repetition (xgrammar skipped the group's start)
    constr(pattern=r"^\d{1,3}(\.\d{1,2})?$"): (q("123", "1.25", "0.5"), q("1234", "12345", "1.")),
}

# Near misses for every type: whatever a grammar accepts among them must validate.
TRICKY = q(
    "",
    " ",
    "x",
    "0",
    "-0",
    "P1Y1Y",
    "P1,5D",
    "PT1.5H30M",
    "P1DT",
    "1:00:00",
    "P0.5W",
    U4,
    U4.replace("-", ""),
    "{" + U4 + "}",
    "urn:uuid:" + U4,
    "00000000-0000-4000-8000-000000000000",
    "0.0.0.0",
    "00.0.0.0",
    "1.2.3.4/24",
    "1.2.3.0/24",
    "1.2.0.0/16",
    "::ffff:1.2.3.4",
    "fe80::1%eth0",
    "1:2:3:4:5:6:7::",
    "::2:3:4:5:6:7:8",
    "1::/16",
    "1:2::/32",
    "::/128",
    ":::",
    "http://a.com:0",
    "http://a--b.com",
    "http://a.com/%zz",
    "http://a.com?x#y",
    "HTTP://A.COM",
    "http://" + "a" * 40 + ".com",
    "x://y",
    "http://-a.com",
    "http://a-.com",
    "http://a.com/ä",
    "2020-02-29T00:00",
    "2020-02-29T00:00:00.1234567",
    "2020-01-01t10:20:30",
    "2020-01-01 10:20:30",
    "23:59:59.999999+23:59",
    "00:00-00:00",
    "10:20:30,5",
) + [
    '{"01": "a"}',
    '{"+1": "a"}',
    '{"1.0": "a"}',
    '{"nan": "a"}',
    '{"1": "a", "01": "b"}',
    '{"9223372036854775807": "a"}',
    '{"-0.0e-99": "a"}',
    '{"True": 1}',
]


def validates(output_type: Any, text: str) -> bool:
    try:
        pydantic.TypeAdapter(output_type).validate_json(text)
    except (pydantic.ValidationError, ArithmeticError):  # Fraction("1/0") raises
        return False
    return True


@pytest.mark.parametrize("output_type", list(CASES), ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grammar_of_a_pydantic_type_is_as_strict_as_pydantic(
    grammar_compiler, backend, output_type
):
    from structgen.grammar import candidate_backends

    constraint = to_constraint(output_type)
    if backend not in candidate_backends(constraint):
        pytest.skip(f"{backend} does not enforce all of this schema; auto does not use it")
    grammar = grammar_compiler.compile(constraint, backend=backend)
    valid, invalid = CASES[output_type]
    for text in valid:
        assert validates(output_type, text), text  # the test's own premise
        assert grammar.accepts(text), text
    for text in invalid:
        assert not validates(output_type, text), text
        assert not grammar.accepts(text), text
    for text in TRICKY:
        if grammar.accepts(text):
            assert validates(output_type, text), text


def test_pydantic_type_grammars_compile_fast(grammar_compiler):
    """Fresh compiles (a new compiler, no cache) of the largest patterns stay well under a
    second."""
    from structgen.grammar import GrammarCompiler

    fresh = GrammarCompiler(
        grammar_compiler.tokenizer,
        grammar_compiler.vocab_size,
        [grammar_compiler.tokenizer.eos_token_id],
    )
    for output_type in (datetime.timedelta, IPvAnyNetwork, AnyUrl, datetime.datetime):
        start = time.perf_counter()
        fresh.compile(to_constraint(output_type))
        assert time.perf_counter() - start < 1.0, output_type


def test_formats_become_patterns_in_the_schema():
    source = json.loads(to_constraint(UUID4).source)
    assert "format" not in source and source["pattern"].startswith("^(")
    ints = json.loads(to_constraint(dict[int, str]).source)
    assert ints["additionalProperties"] is False and list(ints["patternProperties"]) == [
        "^(-?(0|[1-9][0-9]{0,17}))$"
    ]


def test_a_plain_json_schema_format_is_left_to_the_backends():
    schema = {"type": "string", "format": "uuid"}
    assert json.loads(to_constraint(schema).source) == schema


@pytest.mark.parametrize(
    "output_type, named",
    [
        (FutureDate, "now_op"),
        (dict[Literal[1, 2], int], "dict key"),
        (pydantic.FilePath, "existing file"),
        (pydantic.PostgresDsn, "DSN"),
        (pydantic.condate(gt=datetime.date(2020, 1, 1)), "'gt'"),
        (pydantic.ImportString, "ImportString"),
        (pydantic.NewPath, "NewPath"),
        (pydantic.SocketPath, "SocketPath"),
        (pydantic.PaymentCardNumber, "PaymentCardNumber"),
        (zoneinfo.ZoneInfo, "ZoneInfo"),
        (Json[Point], "Json"),
        (condecimal(max_digits=5, decimal_places=2, le=100), "Decimal"),
        (typing.Annotated[str, pydantic.EncodedStr(encoder=Rot13)], "Rot13"),
    ],
    ids=str,
)
def test_what_no_pattern_expresses_is_refused_unless_not_strict(output_type, named):
    with pytest.raises(UnsupportedSchemaError, match=named) as caught:
        to_constraint(output_type)
    assert "strict=False" in str(caught.value)
    relaxed = to_constraint(output_type, strict=False)
    assert any(named in r for r in relaxed.relaxed)
