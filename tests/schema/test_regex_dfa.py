"""Patterns as automata (structgen/schema/regex_dfa.py): the pattern written back for a language, its
complement and intersections must match exactly the strings Python's `re` says they should,
on real MaskBench patterns and on random strings over the characters that matter to them."""

from __future__ import annotations

import functools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structgen.schema.regex_dfa import Language

PATTERNS = [
    "//",  # JsonSchemaStore 152: not {pattern: "//"}
    "^ *[cC][oO][nN][tT][eE][nN][tT]/|\\.[xX][nN][bB] *$",  # Github_hard 233 (not)
    ".{14,}(?:ghlint|plugin)",  # Github_medium 6 (not)
    "^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$",  # Github_medium 124 (oneOf)
    "\\.css$",  # JsonSchemaStore 46 (oneOf)
    "(\\d{1,3}\\.){3}\\d{1,3}",  # JsonSchemaStore 193 (oneOf)
    "^$|(^(?:\\S+\\s+){0,9}\\S+$)",  # Github_easy 131
    "^([a-z][0-9])+$",  # Handwritten 96
    "^a|b$",
    "a$\n",  # `$` before a final newline, then the newline
    "\\Aab\\Z",
    "x*?y",
    "[^\\W\\d]_",
]
ALPHABET = "abcdefxy0123459 ./\n-_CONTENTxnb\u00e9\u0663\t"


@functools.cache
def written_back(pattern: str) -> tuple[str, str]:
    """The pattern for `pattern`'s language and for its complement."""
    language = Language.of_pattern(pattern)
    assert language is not None
    return language.to_pattern(), language.complement().to_pattern()


def full(pattern: str) -> str:
    """The written-back pattern as the backends read it: `$` is the end of the string."""
    return pattern[:-1] + "\\Z" if pattern.endswith("$") else pattern


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=14))
def test_language_and_complement_match_re(pattern, text):
    same, other = written_back(pattern)
    found = re.search(pattern, text) is not None
    assert (re.search(full(same), text) is not None) == found
    assert (re.search(full(other), text) is not None) != found


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=14))
def test_intersection_matches_both(text):
    a, b = "^[a-z0-9]+$", "[0-9]"
    both = _intersection(a, b)
    expected = re.search(a, text) is not None and re.search(b, text) is not None
    assert (re.search(full(both), text) is not None) == expected


@functools.cache
def _intersection(a: str, b: str) -> str:
    return Language.of_pattern(a).intersect(Language.of_pattern(b)).to_pattern()


def test_strings_emptiness_and_unsupported_syntax():
    keys = Language.of_strings(["by", "photos_by"])
    assert re.fullmatch(full(keys.to_pattern()), "by") and not re.search(full(keys.to_pattern()), "b")
    assert Language.of_strings([]).is_empty()
    assert Language.of_pattern("^a").intersect(Language.of_pattern("^b")).is_empty()
    assert Language.of_pattern("").is_everything()
    # a lookahead at the start (after ^) or at the very end is supported ...
    assert Language.of_pattern("a(?=b)").to_pattern() == Language.of_pattern("ab").to_pattern()
    assert Language.of_pattern("^(?!x)").to_pattern() == Language.of_pattern("^[^x]|^$").to_pattern()
    # ... other lookaround, backreferences, word boundaries and flags have no automaton here
    for pattern in ("a(?=b)c", "(?<=a)b", "(a)\\1", "\\bx", "(?i)abc"):
        assert Language.of_pattern(pattern) is None
