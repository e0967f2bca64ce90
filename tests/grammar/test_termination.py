"""The shortest-output lengths `analyse` refuses never-ending grammars with: the worklist gives
what the plain fixpoint (every rule again until nothing changes) gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from structgen.grammar.backends.xgrammar import build_grammar
from structgen.grammar.termination import NEVER, _Exprs, _shortest, _shortest_lengths
from structgen.types import Regex, to_constraint


def _plain_fixpoint(g: _Exprs) -> list[int]:
    shortest = [NEVER] * len(g.rules)
    changed = True
    while changed:
        changed = False
        for r in range(len(g.rules)):
            n = _shortest(g, g.body(r), shortest)
            if n < shortest[r]:
                shortest[r], changed = n, True
    return shortest


def _exprs(output_type) -> _Exprs:
    return _Exprs(build_grammar(to_constraint(output_type)).serialize_json())


def test_worklist_lengths_equal_the_plain_fixpoint_on_maskbench_schemas(maskbench_dir: Path):
    from structgen.types import JsonSchema

    lines = [line for line in (maskbench_dir / "Github_easy.jsonl").read_text().splitlines() if line.strip()]
    grammars = []
    for line in lines[:20]:
        try:
            grammars.append(_exprs(JsonSchema(json.loads(line)["schema"])))
        except RuntimeError:  # a schema xgrammar cannot read: `analyse` skips it too
            continue
    assert len(grammars) >= 10
    assert [_shortest_lengths(g) for g in grammars] == [_plain_fixpoint(g) for g in grammars]


def test_worklist_lengths_of_recursive_and_never_ending_grammars():
    from structgen.types import CFG

    for grammar in ('root ::= "(" root ")" | "x"', 'root ::= "ab" root', 'root ::= a\na ::= b "1" | "2"\nb ::= a "3"'):
        g = _exprs(CFG(grammar))
        assert _shortest_lengths(g) == _plain_fixpoint(g)
    assert _shortest_lengths(_exprs(CFG('root ::= "ab" root')))[0] == NEVER
    assert _shortest_lengths(_exprs(Regex("a{3}b?")))[0] == 3


# -- the native fixpoint (structgen/csrc/grammar_lengths.cpp) against this Python one ---------

_GRAMMARS = (
    'root ::= "(" root ")" | "x"',
    'root ::= a\na ::= b "1" | "2"\nb ::= a "3"',
    'root ::= [a-c]{2,5} "!" [^a-z]* | "long" "er" "one"',
    'root ::= item{3}\nitem ::= "[" [0-9]+ "]" | "-"',
    'root ::= "a" | [^\\x00-\\U0010FFFF] "b"',
    'root ::= [^\\x00-\\x60\\x62-\\U0010FFFF] "b"',  # one code point left out: "a"
)


def _native_or_skip():
    from structgen.grammar.termination import native_library

    if native_library() is None:
        pytest.skip("the native grammar lengths could not be built here (no C++ compiler, or disabled)")


def _both(serialized: str):
    from structgen.grammar.termination import _native_lengths, _python_lengths

    return _native_lengths(serialized), _python_lengths(serialized)


def _fields(lengths) -> tuple:
    return lengths.shortest, lengths.reachable, lengths.longest_alternative


def test_native_lengths_equal_the_python_ones_on_grammars_regexes_and_schemas():
    from structgen.types import CFG

    _native_or_skip()
    types = [CFG(g) for g in _GRAMMARS] + [Regex(r"[a-z]{4,}@(\d{1,3}\.){3}\d{1,3}"), Regex("x?y*z{2}")]
    types.append({"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#"}, "minItems": 2},
                                                   "b": {"type": "string", "minLength": 3}}, "required": ["b"]})
    for output_type in types:
        native, python = _both(build_grammar(to_constraint(output_type)).serialize_json())
        assert native is not None, output_type
        assert _fields(native) == _fields(python), output_type


def test_native_lengths_equal_the_python_ones_on_maskbench_schemas(maskbench_dir: Path):
    _native_or_skip()
    compared = 0
    for name in ("Github_easy", "Glaiveai2K", "Kubernetes"):
        for line in (maskbench_dir / f"{name}.jsonl").read_text().splitlines()[:40]:
            try:
                serialized = build_grammar(to_constraint(json.loads(line)["schema"])).serialize_json()
            except Exception:  # a schema we or xgrammar refuse: `analyse` never sees it
                continue
            native, python = _both(serialized)
            if python.stuck():
                assert native is None
                continue
            assert native is not None and _fields(native) == _fields(python)
            compared += 1
    assert compared >= 60


def test_a_grammar_that_never_ends_is_named_by_the_python_path():
    from structgen.grammar.termination import grammar_lengths
    from structgen.types import CFG

    _native_or_skip()
    grammar = build_grammar(to_constraint(CFG('root ::= "x" | a\na ::= "ab" a')))
    native, python = _both(grammar.serialize_json())
    assert native is None and python.stuck() == ["a"]
    assert grammar_lengths(grammar).stuck() == ["a"]  # with names, from the Python path


def test_native_lengths_refuse_text_they_cannot_read(monkeypatch):
    from structgen.grammar import termination
    from structgen.types import CFG

    _native_or_skip()
    good = json.loads(build_grammar(to_constraint(CFG(_GRAMMARS[1]))).serialize_json())
    assert len(good["rules"]) > 1
    cyclic = dict(good, grammar_expr_data=list(good["grammar_expr_data"]))
    seq = next(i for i, start in enumerate(good["grammar_expr_indptr"]) if good["grammar_expr_data"][start] == 5)
    cyclic["grammar_expr_data"][good["grammar_expr_indptr"][seq] + 2] = seq  # a sequence that contains itself
    for text in ("", "{}", "[1,2]", json.dumps(good)[:-7], json.dumps(dict(good, root_rule_id=999)),
                 json.dumps(dict(good, rules=[["r", 10**6]])), json.dumps(cyclic), '{"rules": "x"}'):
        assert termination._native_lengths(text) is None, text[:60]
    library = termination.native_library()
    monkeypatch.setattr(termination, "native_library", lambda: None)
    assert _fields(termination.grammar_lengths(build_grammar(to_constraint(CFG(_GRAMMARS[1]))))) \
        == _fields(termination._python_lengths(json.dumps(good)))
    # past its step limit it gives up (-3) rather than run on
    text = json.dumps(good).encode()
    out = [(termination.ctypes.c_int64 * 64)() for _ in range(2)]
    scalar = [termination.ctypes.c_int64() for _ in range(2)]
    args = (out[0], out[1], termination.ctypes.byref(scalar[0]), termination.ctypes.byref(scalar[1]))
    assert library(text, len(text), 64, 0, *args) == -3
    assert library(text, len(text), 1, 10**6, *args) == -2
    assert library(text, len(text), 64, 10**6, *args) == len(good["rules"])
