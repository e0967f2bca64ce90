"""A conformance sweep over the pydantic types a field can have: for `class M(BaseModel): x: T`,
structgen either refuses T with an error that says what to do, or every output drawn at random
from its grammar passes `M.model_validate_json`, on both backends. A grammar looser than
pydantic would end `generate()` in a validation error instead of a value."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import importlib.util
import ipaddress
import pathlib
import random
import re
import typing
import uuid
import zoneinfo
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NamedTuple

import annotated_types
import numpy as np
import pydantic
import pytest
import typing_extensions
from pydantic import Field

from structgen.errors import UnsupportedSchemaError, UnsupportedTypeError
from structgen.grammar import CompiledGrammar, GrammarCompiler, candidate_backends
from structgen.grammar.backends.base import HostMaskRow, allowed_ids, token_bytes
from structgen.types import to_constraint

BACKENDS = ("xgrammar", "llguidance")
SAMPLES = 32  # outputs drawn per type and backend
MAX_TOKENS = 48  # a draw that has not ended by then is dropped


class GrammarSampler:
    """Random outputs of a grammar, token by token with a seeded generator. Each step picks
    uniformly among the tokens the mask allows; or, one step in four each, among the allowed
    one-byte tokens (patterns explored character by character) or the allowed tokens that
    close a string, array or object and the stop token (so that outputs end within the cap)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.stop = compiler.stop_token_ids[0]
        self.text = token_bytes(compiler.tokenizer, compiler.vocab_size)
        self.one_byte = np.array([len(t) == 1 for t in self.text])
        self.closing = np.array([t[:1] in (b'"', b"]", b"}") for t in self.text])
        self.closing[compiler.stop_token_ids] = True
        self.row = HostMaskRow(compiler.vocab_size, compiler.stop_token_ids)

    def outputs(self, grammar: CompiledGrammar, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        drawn = (self.draw(grammar, rng) for _ in range(SAMPLES))
        return [text for text in drawn if text is not None]

    def draw(self, grammar: CompiledGrammar, rng: random.Random) -> str | None:
        matcher = grammar.matcher()
        tokens: list[int] = []
        for _ in range(MAX_TOKENS):
            token = self.pick(allowed_ids(self.row.fill(matcher)), rng)
            assert matcher.accept_token(token), token
            if token == self.stop:
                return b"".join(self.text[t] for t in tokens).decode()
            tokens.append(token)
        return None

    def pick(self, allowed: np.ndarray, rng: random.Random) -> int:
        mode = rng.random()
        subset = self.closing if mode < 0.25 else self.one_byte if mode < 0.5 else None
        few = allowed if subset is None else allowed[subset[allowed]]
        choices = few if len(few) else allowed
        return int(choices[rng.randrange(len(choices))])


@pytest.fixture(scope="module")
def sampler(grammar_compiler: GrammarCompiler) -> GrammarSampler:
    return GrammarSampler(grammar_compiler)


# -- the field types ------------------------------------------------------------------------
class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mixed(enum.Enum):
    HALF = 0.5
    NAME = "name"


class Permission(enum.IntFlag):
    READ = 4
    WRITE = 2


class Point(NamedTuple):
    x: int
    y: int


class Movie(typing_extensions.TypedDict):
    title: str
    year: int


@dataclasses.dataclass
class Pair:
    a: int
    b: str


needs_email_validator = pytest.mark.skipif(
    importlib.util.find_spec("email_validator") is None,
    reason="pydantic's EmailStr/NameEmail need the email-validator package",
)

# Every kind of type a field can have: the standard library's, pydantic.types,
# pydantic.networks, and the constraints of con*() / Field / annotated-types.
FIELD_TYPES: list[Any] = [
    # JSON scalars, containers and the standard library
    int,
    float,
    str,
    bool,
    bytes,
    type(None),
    Any,
    int | None,
    int | str,
    decimal.Decimal,
    complex,
    fractions.Fraction,
    datetime.date,
    datetime.time,
    datetime.datetime,
    datetime.timedelta,
    uuid.UUID,
    ipaddress.IPv4Address,
    ipaddress.IPv6Address,
    ipaddress.IPv4Network,
    ipaddress.IPv6Network,
    ipaddress.IPv4Interface,
    ipaddress.IPv6Interface,
    pathlib.Path,
    pathlib.PurePosixPath,
    re.Pattern,
    typing.Pattern[str],
    zoneinfo.ZoneInfo,
    typing.Hashable,
    Color,
    Level,
    Mixed,
    Permission,
    Literal["a", 1, True, None],
    Point,
    Movie,
    Pair,
    list[str],
    set[int],
    frozenset[int],
    collections.deque[int],
    collections.Counter[str],
    collections.OrderedDict[str, int],
    typing.Sequence[int],
    typing.Mapping[str, float],
    tuple[int, str],
    tuple[int, ...],
    tuple[()],
    dict[int, str],
    dict[float, int],
    dict[bool, int],
    dict[uuid.UUID, int],
    dict[datetime.date, int],
    dict[Level, int],
    dict[Literal["a", "b"], int],
    # pydantic.types
    pydantic.Base64Str,
    pydantic.Base64Bytes,
    pydantic.Base64UrlStr,
    pydantic.Base64UrlBytes,
    Annotated[pydantic.Base64Bytes, Field(max_length=8)],
    pydantic.ByteSize,
    pydantic.Json,
    pydantic.Json[int],
    pydantic.Json[float],
    pydantic.Json[bool],
    pydantic.Json[str],
    pydantic.Json[int | None],
    pydantic.Json[list[int]],
    pydantic.Json[dict[str, int]],
    pydantic.Json[Movie],
    pydantic.StrictStr,
    pydantic.StrictInt,
    pydantic.StrictFloat,
    pydantic.StrictBool,
    pydantic.StrictBytes,
    pydantic.PositiveInt,
    pydantic.NegativeInt,
    pydantic.NonNegativeInt,
    pydantic.NonPositiveInt,
    pydantic.PositiveFloat,
    pydantic.NegativeFloat,
    pydantic.NonNegativeFloat,
    pydantic.NonPositiveFloat,
    pydantic.FiniteFloat,
    Annotated[float, pydantic.AllowInfNan()],
    Annotated[float, Field(allow_inf_nan=False, gt=0)],
    pydantic.UUID1,
    pydantic.UUID3,
    pydantic.UUID4,
    pydantic.UUID5,
    pydantic.UUID6,
    pydantic.UUID7,
    pydantic.UUID8,
    pydantic.FilePath,
    pydantic.DirectoryPath,
    pydantic.NewPath,
    pydantic.SocketPath,
    pydantic.ImportString,
    pydantic.Secret[int],
    pydantic.SecretStr,
    pydantic.SecretBytes,
    pydantic.PaymentCardNumber,
    pydantic.PastDate,
    pydantic.FutureDate,
    pydantic.PastDatetime,
    pydantic.FutureDatetime,
    pydantic.AwareDatetime,
    pydantic.NaiveDatetime,
    pydantic.JsonValue,
    list[pydantic.OnErrorOmit[int]],
    list[pydantic.Base64Str],
    dict[str, pydantic.ByteSize],
    # pydantic.networks
    pydantic.AnyUrl,
    pydantic.AnyHttpUrl,
    pydantic.HttpUrl,
    pydantic.FileUrl,
    pydantic.FtpUrl,
    pydantic.WebsocketUrl,
    pydantic.AnyWebsocketUrl,
    Annotated[pydantic.AnyUrl, pydantic.UrlConstraints(max_length=20)],
    Annotated[pydantic.AnyUrl, pydantic.UrlConstraints(allowed_schemes=["file", "http"])],
    pydantic.IPvAnyAddress,
    pydantic.IPvAnyInterface,
    pydantic.IPvAnyNetwork,
    pydantic.PostgresDsn,
    pydantic.CockroachDsn,
    pydantic.AmqpDsn,
    pydantic.RedisDsn,
    pydantic.MongoDsn,
    pydantic.KafkaDsn,
    pydantic.NatsDsn,
    pydantic.MySQLDsn,
    pydantic.MariaDBDsn,
    pydantic.ClickHouseDsn,
    pydantic.SnowflakeDsn,
    pytest.param(pydantic.EmailStr, marks=needs_email_validator),
    pytest.param(pydantic.NameEmail, marks=needs_email_validator),
    # constraints: con*(), Field, StringConstraints, annotated-types
    pydantic.constr(min_length=2, max_length=6),
    pydantic.constr(strip_whitespace=True, min_length=2),
    pydantic.constr(to_upper=True, pattern="^[A-Z]+$"),
    pydantic.constr(pattern=r"^[a-z]+\d$", max_length=5),
    pydantic.constr(pattern=r"^\d{3}(-\d{1,4})?$"),
    Annotated[str, pydantic.StringConstraints(pattern=r"^\d{1,3}(\.\d{1,2})?$")],
    Annotated[str, Field(pattern=r"^(ab|c)*$", min_length=1, max_length=4)],
    pydantic.conbytes(min_length=2, max_length=4),
    pydantic.conint(ge=10, lt=20),
    pydantic.conint(gt=-3, le=7, multiple_of=2),
    Annotated[int, annotated_types.MultipleOf(3), annotated_types.Ge(-9), annotated_types.Le(9)],
    pydantic.confloat(gt=0, le=1),
    pydantic.confloat(multiple_of=0.25),
    Annotated[float, Field(ge=0.5, lt=2.5)],
    Annotated[float, Field(multiple_of=0.5, ge=-2, le=2)],
    pydantic.condecimal(max_digits=4, decimal_places=2),
    pydantic.condecimal(max_digits=3),
    pydantic.condecimal(gt=0, decimal_places=1),
    pydantic.condecimal(gt=0, lt=10),
    pydantic.condecimal(max_digits=5, decimal_places=2, le=100),
    pydantic.condecimal(multiple_of=decimal.Decimal("0.5")),
    Annotated[decimal.Decimal, Field(max_digits=5, decimal_places=2, ge=0)],
    pydantic.condate(ge=datetime.date(2020, 1, 1)),
    Annotated[datetime.datetime, Field(strict=True)],
    pydantic.conlist(int, min_length=2, max_length=3),
    pydantic.conset(int, max_length=3),
    pydantic.confrozenset(str, min_length=1),
    Annotated[list[str], annotated_types.Len(1, 2)],
    Annotated[dict[str, int], Field(min_length=1, max_length=2)],
]


def type_id(field_type: Any) -> str:
    """A short test id: the type as Python prints it, without module paths and unset options."""
    text = re.sub(r"<\w+ '([\w.]+)'>", r"\1", str(field_type))
    text = text.replace("FieldInfo(annotation=NoneType, required=True, metadata=", "Field(")
    text = re.sub(r"\b[a-z_]+\.(?=[A-Za-z_])|\w+=None(, )?", "", text).replace(", )", ")")
    if text.startswith("Annotated["):  # constr(), condecimal(), ... leave None items
        text = re.sub(r", None(?=[,\]])", "", text)
    return text.replace("Interval(), ", "").replace("_PydanticGeneralMetadata", "Metadata")


def compiled_or_refused(
    compiler: GrammarCompiler, model: type[pydantic.BaseModel], backend: str
) -> CompiledGrammar | None:
    """The grammar of `model` on `backend`, or None where structgen refuses the type with an
    error that says what to do instead."""
    try:
        constraint = to_constraint(model)
        backends = candidate_backends(constraint)
    except (UnsupportedSchemaError, UnsupportedTypeError) as refused:
        assert re.search("strict=False|Use |use ", str(refused)), refused
        return None
    if backend not in backends:
        pytest.skip(f"{backend} does not enforce all of this schema; auto does not use it")
    return compiler.compile(constraint, backend=backend)


def invalid_outputs(model: type[pydantic.BaseModel], outputs: Sequence[str]) -> list[str]:
    """The outputs `model` does not validate, each with pydantic's first error."""
    invalid = []
    for text in outputs:
        try:
            model.model_validate_json(text)
        except pydantic.ValidationError as e:
            invalid.append(f"{text} ({e.errors()[0]['msg']})")
        except Exception as e:  # a validator that crashes on the text fails it too
            invalid.append(f"{text} ({type(e).__name__}: {e})")
    return invalid


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("field_type", FIELD_TYPES, ids=type_id)
def test_every_output_drawn_from_a_pydantic_types_grammar_validates(grammar_compiler, sampler, field_type, backend):
    model = pydantic.create_model("M", x=(field_type, ...))
    grammar = compiled_or_refused(grammar_compiler, model, backend)
    if grammar is None:
        return
    outputs = sampler.outputs(grammar)
    assert outputs, f"none of {SAMPLES} draws ended within {MAX_TOKENS} tokens"
    assert not invalid_outputs(model, outputs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sampler_finds_what_a_loose_grammar_lets_through(grammar_compiler, sampler, backend):
    """Any string for a base64 field, as the grammar was before base64 had a pattern."""
    loose = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    grammar = grammar_compiler.compile(to_constraint(loose), backend=backend)
    model = pydantic.create_model("M", x=(pydantic.Base64Bytes, ...))
    assert invalid_outputs(model, sampler.outputs(grammar))
