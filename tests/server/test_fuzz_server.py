"""Hypothesis fuzzing of the server and of the constraint compiler, bounded in count and time.

Against a real `structgen_server` subprocess under an address-space limit: request bodies for
/v1/chat/completions and /v1/completions with random types in every field, random JSON-schema
`response_format`s, lone surrogates and huge numbers. Every answer must be a 2xx, or a 4xx in
OpenAI's error format; never a 5xx, never a dead server. In process: `to_constraint` and
`GrammarCompiler.compile` raise only `StructgenError`s on random schemas.

Generations stay short: `max_tokens` is always sent, at most 8 where it is a valid number."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from structgen.errors import StructgenError

MAX_EXAMPLES = 60
# Wall-clock seconds each fuzz test may spend on examples (`WallBudget`).
WALL_BUDGET_S = 150.0
ADDRESS_SPACE_HEADROOM = 4 * 2**30  # over what the started server holds
REQUEST_TIMEOUT_S = 60.0
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
ERROR_KEYS = {"message", "type", "param", "code"}

# -- values of any JSON type, with the awkward ones over-represented -------------------------
LONE_SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800", '{"k": "\ud83d"}'])
AWKWARD_TEXT = st.one_of(
    st.text(max_size=40), LONE_SURROGATES, st.sampled_from(["", " ", "\x00", "\u202e", "0\U00040000", "\U0010fffd"])
)
HUGE_NUMBERS = st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 5e-324])
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    HUGE_NUMBERS,
    st.floats(allow_nan=False, allow_infinity=False),
    AWKWARD_TEXT,
)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(AWKWARD_TEXT, inner, max_size=4)
    ),
    max_leaves=8,
)

# -- JSON-schema fragments --------------------------------------------------------------------
TYPES = ["string", "integer", "number", "boolean", "null", "object", "array"]
PATTERNS = st.one_of(
    st.sampled_from(["^[a-z]+$", "[0-9]{2,4}", "(a|b)*c", "\\d+", "[", "(?P<x>a)", "a{99999}"]),
    st.text(max_size=12),
)
BOUND = st.one_of(st.integers(-5, 5), HUGE_NUMBERS)
SCHEMA_LEAVES = st.one_of(
    st.builds(lambda t: {"type": t}, st.sampled_from(TYPES)),
    st.builds(lambda v: {"enum": v}, st.lists(JSON_SCALARS, max_size=5)),
    st.builds(lambda v: {"const": v}, JSON_SCALARS),
    st.builds(lambda p: {"type": "string", "pattern": p}, PATTERNS),
    st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}, BOUND, BOUND),
    st.builds(lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": hi}, BOUND, BOUND),
    st.builds(
        lambda f: {"type": "string", "format": f},
        st.sampled_from(["date", "date-time", "email", "uuid", "ipv4", "uri", "nonsense"]),
    ),
    st.sampled_from([{"$ref": "#"}, {"$ref": "#/$defs/missing"}, {}, {"not": {}}, True, False]),
    st.dictionaries(
        st.sampled_from(["type", "items", "properties", "required", "enum", "$ref", "anyOf"]),
        ANY_JSON,
        max_size=3,
    ),
)


def _object(props: dict[str, Any], required: list[str], extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": extra,
    }


SCHEMAS = st.recursive(
    SCHEMA_LEAVES,
    lambda inner: st.one_of(
        st.builds(
            _object,
            st.dictionaries(AWKWARD_TEXT, inner, max_size=3),
            st.lists(st.sampled_from(["a", "b", "self", ""]), max_size=3),
            st.one_of(st.booleans(), inner),
        ),
        st.builds(
            lambda items, lo: {"type": "array", "items": items, "minItems": lo}, inner, BOUND
        ),
        st.builds(
            lambda k, xs: {k: xs},
            st.sampled_from(["anyOf", "oneOf", "allOf"]),
            st.lists(inner, max_size=3),
        ),
        st.builds(lambda x: {"not": x}, inner),
        st.builds(
            lambda d, r: {"$defs": {"d": d}, **({"$ref": "#/$defs/d"} if r else {})},
            inner,
            st.booleans(),
        ),
        st.builds(lambda x: _object({"self": {"$ref": "#"}, "x": x}, ["self"], False), inner),
    ),
    max_leaves=10,
)

# -- request bodies: a well-formed body with a few fields replaced by anything ----------------
MAX_TOKENS_CAP = 8
N_CAP = 2
RESPONSE_FORMATS = st.one_of(
    st.builds(
        lambda s, strict: {
            "type": "json_schema",
            "json_schema": {"name": "r", "schema": s, "strict": strict},
        },
        SCHEMAS,
        st.booleans(),
    ),
    st.builds(lambda p: {"type": "regex", "regex": p}, PATTERNS),
    st.builds(
        lambda g: {"type": "grammar", "grammar": g},
        st.one_of(
            st.sampled_from(
                [
                    'root ::= "a"',
                    'root ::= root "a"',
                    'root ::= "ab" root',
                    'start: "x" | start "y"',
                    "root ::= [a-",
                ]
            ),
            AWKWARD_TEXT,
        ),
    ),
    st.builds(lambda c: {"type": "choice", "choices": c}, st.lists(AWKWARD_TEXT, max_size=4)),
    st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "nonsense"}]),
)
SAMPLING_FIELDS = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.one_of(st.integers(0, 2**32), HUGE_NUMBERS),
    "stop": st.one_of(AWKWARD_TEXT, st.lists(AWKWARD_TEXT, max_size=5)),
    "stream": st.booleans(),
    "n": st.integers(1, N_CAP),
    "logit_bias": st.dictionaries(AWKWARD_TEXT, JSON_SCALARS, max_size=2),
    "jump_forward": st.booleans(),
}
# At most one of these goes in a body (two constraints are a 400 of their own).
CONSTRAINT_FIELDS = {
    "response_format": RESPONSE_FORMATS,
    "guided_json": SCHEMAS,
    "guided_regex": PATTERNS,
    "guided_choice": st.lists(AWKWARD_TEXT, max_size=3),
}
TEXT_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url"]), "text": AWKWARD_TEXT}
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool"]),
        "content": st.one_of(AWKWARD_TEXT, st.lists(TEXT_PART, max_size=2)),
    }
)
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=3)
PROMPTS = st.one_of(AWKWARD_TEXT, st.lists(AWKWARD_TEXT, min_size=1, max_size=3))


@st.composite
def _bodies(draw: st.DrawFn, model: str, required: dict[str, Any], optional: dict[str, Any]) -> Any:
    """A well-formed body (the model, a small max_tokens, `required`, a few of the optional
    fields and at most one constraint), then up to two fields replaced by any JSON value."""
    body = {"model": model, "max_tokens": draw(st.integers(1, MAX_TOKENS_CAP))}
    body.update({name: draw(values) for name, values in required.items()})
    optional = {**SAMPLING_FIELDS, **optional}
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)):
        body[name] = draw(optional[name])
    constraint = draw(st.one_of(st.none(), st.sampled_from(sorted(CONSTRAINT_FIELDS))))
    if constraint is not None:
        body[constraint] = draw(CONSTRAINT_FIELDS[constraint])
    names = sorted({*body, *optional, *CONSTRAINT_FIELDS})
    body.update(draw(st.dictionaries(st.sampled_from(names), ANY_JSON, max_size=2)))
    return _short(body)


def _short(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with any valid length or fan-out clamped small, so generations stay short."""
    for name, cap in (
        ("max_tokens", MAX_TOKENS_CAP),
        ("max_completion_tokens", MAX_TOKENS_CAP),
        ("n", N_CAP),
    ):
        value = body.get(name)
        if isinstance(value, (int, float)) and cap < value < 2**16:
            body[name] = cap
    return body


def chat_bodies(model: str) -> st.SearchStrategy[Any]:
    """Chat bodies; one in ten is any JSON value at all."""
    bodies = _bodies(
        model, {"messages": MESSAGES}, {"max_completion_tokens": st.integers(1, MAX_TOKENS_CAP)}
    )
    return st.integers(0, 9).flatmap(lambda i: ANY_JSON if i == 0 else bodies)


def completion_bodies(model: str) -> st.SearchStrategy[Any]:
    return _bodies(model, {"prompt": PROMPTS}, {"echo": st.booleans()})


# -- the wall-clock guard and the server -------------------------------------------------------
@dataclass
class WallBudget:
    """Each fuzz test may try examples for WALL_BUDGET_S from its first one; later ones pass
    untried (Hypothesis' shrinking included, which then reports the smallest failure so far)."""

    started: dict[str, float] = field(default_factory=dict)

    def left(self, test: str) -> bool:
        return time.monotonic() - self.started.setdefault(test, time.monotonic()) < WALL_BUDGET_S


BUDGET = WallBudget()


@dataclass
class FuzzServer:
    root: str
    model: str
    client: httpx.Client

    def post(self, path: str, body: Any) -> httpx.Response:
        # ensure_ascii: lone surrogates travel as \\ud800 escapes, as a JSON client may send them
        raw = json.dumps(body, ensure_ascii=True).encode()
        return self.client.post(
            f"{self.root}{path}", content=raw, headers={"content-type": "application/json"}
        )


@pytest.fixture(scope="module", params=[[], ["--front-processes", "2"]], ids=["single server", "front processes"])
def fuzz_server(model_dir, request) -> Iterator[FuzzServer]:
    """A server of its own (the fuzz must not disturb the session's shared one), its address
    space capped after start-up so that a runaway request fails instead of taking the host;
    once as a single server, once with its HTTP server in front processes (every request then
    crosses the engine link, engine_link.py)."""
    from structgen_server.process import ServerProcess
    from tests.server.asgi_client import children

    # --max-client-errors 0: every fuzzed body must reach the checks, not the throttle's 429
    args = "--device cpu --max-seq-len 1024 --max-batch-size 8 --max-client-errors 0 --log-level warning".split()
    with ServerProcess([*args, *request.param], address_space_headroom=ADDRESS_SPACE_HEADROOM) as server, \
            httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        model = client.get(f"{server.url}/models").json()["data"][0]["id"]
        fronts = _started_children(server, 2 if request.param else 0)
        fuzz = FuzzServer(server.root, model, client)
        yield fuzz
        assert server.proc.poll() is None, f"the server died during the fuzz; see {server.log_path}"
        assert sorted(children(server.proc.pid)) == fronts, f"a front process died during the fuzz; see {server.log_path}"


def _started_children(server: Any, count: int) -> list[int]:
    """The server's `count` front processes, once all have started."""
    from tests.server.asgi_client import children

    deadline = time.monotonic() + 60
    while len(children(server.proc.pid)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return sorted(children(server.proc.pid))


def assert_well_answered(server: FuzzServer, path: str, body: Any) -> None:
    try:
        response = server.post(path, body)
    except httpx.TransportError as exc:
        raise AssertionError(
            f"no answer ({type(exc).__name__}: {exc}); is the server alive?"
        ) from exc
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json().get("error")
        assert isinstance(error, dict) and ERROR_KEYS <= error.keys(), (
            f"not OpenAI's error format: {response.text[:500]}"
        )


def assert_still_serving(server: FuzzServer) -> None:
    assert httpx.get(f"{server.root}/health", timeout=10).status_code == 200
    good = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Say yes."}],
        "max_tokens": 4,
    }
    response = server.post("/v1/chat/completions", good)
    assert response.status_code == 200, response.text[:500]
    assert response.json()["choices"][0]["message"]["content"]


def fuzz_endpoint(server: FuzzServer, path: str, bodies: st.SearchStrategy[Any]) -> None:
    """Every body drawn from `bodies` is well answered at `path`; the server serves after."""

    @FUZZ_SETTINGS
    @given(body=bodies)
    def answered(body: Any) -> None:
        if BUDGET.left(path):
            assert_well_answered(server, path, body)

    answered()
    assert_still_serving(server)


def test_fuzzed_chat_bodies_get_a_2xx_or_an_openai_4xx(fuzz_server: FuzzServer) -> None:
    fuzz_endpoint(fuzz_server, "/v1/chat/completions", chat_bodies(fuzz_server.model))


def test_fuzzed_completion_bodies_get_a_2xx_or_an_openai_4xx(fuzz_server: FuzzServer) -> None:
    fuzz_endpoint(fuzz_server, "/v1/completions", completion_bodies(fuzz_server.model))


# -- in process -------------------------------------------------------------------------------
@FUZZ_SETTINGS
@given(schema=st.one_of(SCHEMAS, ANY_JSON))
def test_random_schemas_compile_or_raise_a_structgen_error(grammar_compiler, schema: Any) -> None:
    from structgen.types import JsonSchema, to_constraint

    if not BUDGET.left("compile"):
        return
    try:
        grammar_compiler.compile(to_constraint(JsonSchema(schema)))
    except StructgenError:
        pass
