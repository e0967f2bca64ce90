"""What a grammar lets the model write, the output check accepts: a regex's `.`, `\\d`, `\\w`,
`\\s` and their negations read alike by each backend and by the Python check after it (a regex
output is checked with Python's `re`, a JSON schema's pattern as ECMA-262 reads it)."""

from __future__ import annotations

import json

import pytest

from structgen.errors import InvalidConstraintError, OutputValidationError
from structgen.schema.python_patterns import python_pattern
from structgen.types import JsonSchema, Regex, to_constraint

BACKENDS = ("xgrammar", "llguidance", "auto")
PATTERNS = (".*", "a.b", "[^a]+", r"\d+", r"\D+", r"\w+", r"\W+", r"\s+", r"\S+", r"[\w.-]+", r"x\.y")
# A newline, a carriage return, Unicode digits, letters and spaces, punctuation, a dot.
TEXTS = ("a\nb", "a\rb", "ab", "axb", "5", "\u0663", "x", "\u00e9", "_", "-", " ", "\u00a0", "\u2003", "x.y",
         "x\ny", "\u2028")


def _outcome(check, text: str) -> bool:
    try:
        check(text)
        return True
    except OutputValidationError:
        return False


def _grammar(grammar_compiler, constraint, backend: str):
    try:
        return grammar_compiler.compile(constraint, backend=None if backend == "auto" else backend)
    except InvalidConstraintError as e:  # xgrammar refuses what it would read otherwise, saying so
        assert backend == "xgrammar" and "ASCII classes" in str(e)
        return None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_regex_output_the_grammar_admits_passes_the_check(grammar_compiler, backend: str, pattern: str) -> None:
    constraint = to_constraint(Regex(pattern))
    grammar = _grammar(grammar_compiler, constraint, backend)
    if grammar is None:
        return
    for text in TEXTS:
        if grammar.accepts(text):
            assert _outcome(constraint.parse, text), (grammar.backend, pattern, text)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_json_string_the_grammar_admits_passes_the_schema_check(grammar_compiler, backend: str, pattern: str) -> None:
    constraint = to_constraint(JsonSchema({"type": "string", "pattern": f"^{pattern}$"}))
    grammar = _grammar(grammar_compiler, constraint, backend)
    if grammar is None:
        return
    for text in TEXTS:
        if grammar.accepts(json.dumps(text, ensure_ascii=False)):
            assert _outcome(constraint.parse, json.dumps(text, ensure_ascii=False)), (grammar.backend, pattern, text)


def test_a_regex_dot_is_not_a_newline_with_either_backend(grammar_compiler) -> None:
    for backend in ("xgrammar", "llguidance"):
        grammar = grammar_compiler.compile(to_constraint(Regex("a.*")), backend=backend)
        assert grammar.accepts("a\rb") and grammar.accepts("a.b") and not grammar.accepts("a\nb"), backend


def test_negated_classes_leave_xgrammar_for_regexes_and_say_why_when_it_is_asked_for(grammar_compiler) -> None:
    assert grammar_compiler.compile(to_constraint(Regex(r"\W+"))).backend == "llguidance"
    assert grammar_compiler.compile(to_constraint(Regex(r"\w+"))).backend == "xgrammar"
    with pytest.raises(InvalidConstraintError, match=r"\\D or \\W.*llguidance"):
        grammar_compiler.compile(to_constraint(Regex(r"x\D")), backend="xgrammar")


@pytest.mark.parametrize(("pattern", "python"), [
    (r"^\W+$", "^[^A-Za-z0-9_]+$"),
    (r"[\w-]+", "[A-Za-z0-9_-]+"),
    (r"[\w-a]", r"[A-Za-z0-9_\-a]"),
    (r"[^\d]", "[^0-9]"),
    (r"[]\d]", "[]0-9]"),
    (r"\\d", r"\\d"),
    (r"(?<y>\d{4})", "(?P<y>[0-9]{4})"),
])
def test_a_schemas_pattern_is_checked_with_ecmas_ascii_classes(pattern: str, python: str) -> None:
    assert python_pattern(pattern) == python
