"""The incremental JSON parser on hand-written texts cut at every place: the events it reports
(paths, and offsets whose text is the value) and the open string it decodes must not depend
on where the chunks were cut."""

from __future__ import annotations

import json

import pytest

from structgen.errors import OutputValidationError
from structgen.partial import JsonStreamParser

TEXTS = [
    '{"a": "x\\"y\\\\z\\/\\n\\t", "b": [1, -2.5e-3, [true, null, false]], "c": {}, "d": []}',
    '{"smile": "\\ud83d\\ude00 and \\u00e9", "raw": "\U0001f600 é"}',
    '[[[]], [[1], [2, [3]]], {"k": [{"n": 10}]}]',
    '  {"number": 12345678901234567, "neg": -0, "exp": 1E+10}  ',
    '"just a string \\u0041"',
    "-12.5",
    "true",
]


def read(text: str, cuts: list[int]) -> tuple[list[tuple], list[str]]:
    """Feed `text` cut at `cuts`; the events (kind, path, value text) and the open string
    after each chunk."""
    parser = JsonStreamParser()
    events, strings = [], []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for piece in pieces:
        events += parser.feed(piece)
        strings.append(parser.open_string)
    events += parser.finish()
    assert parser.done
    return [(e.kind, e.path, text[e.start : e.end] if e.kind == "done" else e.container) for e in events], strings


def whole_values(text: str, events: list[tuple]) -> dict[tuple, object]:
    return {path: json.loads(value) for kind, path, value in events if kind == "done"}


@pytest.mark.parametrize("text", TEXTS)
def test_events_are_the_same_for_every_way_of_cutting_the_text(text: str) -> None:
    whole, _ = read(text, [])
    for size in (1, 2, 3, 5):
        cuts = list(range(size, len(text), size))
        assert read(text, cuts)[0] == whole
    for cut in range(1, len(text)):
        assert read(text, [cut])[0] == whole


@pytest.mark.parametrize("text", TEXTS)
def test_each_finished_value_is_the_text_of_that_value(text: str) -> None:
    events, _ = read(text, [])
    values = whole_values(text, events)
    assert values[()] == json.loads(text)
    for path, value in values.items():
        node = json.loads(text)
        for key in path:
            node = node[key]
        assert node == value


def test_events_come_in_text_order_and_containers_close_after_their_members() -> None:
    events, _ = read('{"a": [1, {"b": "c"}], "d": 2}', [])
    assert [(k, p) for k, p, _ in events] == [
        ("open", ()), ("open", ("a",)), ("done", ("a", 0)), ("open", ("a", 1)),
        ("done", ("a", 1, "b")), ("done", ("a", 1)), ("done", ("a",)), ("done", ("d",)), ("done", ()),
    ]  # fmt: skip


def test_a_number_finishes_only_at_the_character_after_it() -> None:
    parser = JsonStreamParser()
    assert [e.kind for e in parser.feed('{"n": 12')] == ["open"]
    assert parser.open_path == ("n",)
    assert parser.feed("34") == []
    done = parser.feed(",")
    assert [(e.path, e.end - e.start) for e in done] == [(("n",), 4)]


def test_open_string_decodes_escapes_split_across_chunks() -> None:
    text = '{"s": "a\\nb\\u00e9\\ud83d\\ude00c"}'
    _, strings = read(text, list(range(1, len(text))))
    shown = [s for s in strings if s]
    assert shown[-1] == "a\nbé\U0001f600c"
    for earlier, later in zip(shown, shown[1:], strict=False):  # the text only grows, never half a character
        assert later.startswith(earlier)
    assert not any("\\" in s or "\ud83d" in s for s in shown)


def test_an_escaped_high_surrogate_alone_ends_as_json_reads_it() -> None:
    events, _ = read('["\\ud83d", "\\ud83dx"]', [3, 9])
    values = whole_values('["\\ud83d", "\\ud83dx"]', events)
    assert values[(0,)] == "\ud83d" and values[(1,)] == "\ud83dx"


def test_open_path_names_the_innermost_open_value_and_keys_are_not_values() -> None:
    parser = JsonStreamParser()
    parser.feed('{"outer": {"na')
    assert parser.open_path == ("outer",) and parser.open_string_path is None
    parser.feed('me": "Ad')
    assert parser.open_path == ("outer", "name") and parser.open_string == "Ad"
    parser.feed('a"}, "list": [3, "x')
    assert parser.open_path == ("list", 1)


@pytest.mark.parametrize("bad", ['{"a" 1}', '{"a": 1,}', "[1 2]", '{"a": tru }', "{} {}", '"\\x"', "```json"])
def test_text_that_is_not_json_is_refused_at_the_first_impossible_character(bad: str) -> None:
    parser = JsonStreamParser()
    with pytest.raises(OutputValidationError, match="not JSON"):
        parser.feed(bad)
        parser.finish()


def test_text_cut_off_before_the_value_closed_is_refused_at_the_end() -> None:
    parser = JsonStreamParser()
    parser.feed('{"a": [1, 2')
    with pytest.raises(OutputValidationError, match="raise max_tokens"):
        parser.finish()
