"""Streamed text (`LLM.stream` / `astream`, the server's deltas): what each update of a request
sends, checked against decoding the whole output again at every update, on the real tokenizer
and real `Request`s grown and cut back as the engine does."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from structgen.api import _DeltaDecoder, _DeltaFeed, _OutputDeltas
from structgen.engine.reasoning import CLOSE_TAG, ReasoningPhase
from structgen.engine.request import Request, RequestStatus
from structgen.sampling import SamplingParams

TEXT = 'Héllo wörld 😀 {"name": "Ada — Lovelace", "rocket": "🚀🚀", "中文": "汉字测试"} <b>x</b> </thin k <'


def held_tail(text: str, hold: str) -> int:
    for at in range(max(0, len(text) - len(hold)), len(text)):
        if hold.startswith(text[at:]) or text[at:].startswith(hold):
            return len(text) - at
    return 0


class WholeDecoding:
    """The reference: each update decodes the whole section again."""

    def __init__(self, tokenizer, hold: str = ""):
        self.tokenizer, self.hold, self.sent = tokenizer, hold, ""

    def delta(self, ids: list[int], final: bool) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if not final and text.endswith("\ufffd"):
            return ""
        if not final and self.hold:
            text = text[: len(text) - held_tail(text, self.hold)]
        common = len(os.path.commonprefix([text, self.sent]))
        out, self.sent = text[common:], text
        return out


def grow(req: Request, ids: list[int], rng: random.Random, rewinds: bool) -> list[int]:
    """Appends 1-3 of `ids` to `req` (or, now and then with `rewinds`, cuts back a few tokens
    and appends others, as re-tokenization does); the tokens still to come."""
    if rewinds and req.num_output > 6 and rng.random() < 0.15:
        back = rng.randint(0, 5)
        dropped = req.output_ids[req.num_output - back :]
        req.truncate(len(req.token_ids) - back)
        if rng.random() < 0.5:
            ids = dropped + ids  # the same tokens again: the text goes on unchanged
        else:
            ids = [rng.randint(100, 40_000)] + ids
    n = rng.randint(1, 3)
    req.append(ids[:n])
    return ids[n:]


@pytest.mark.parametrize("thinking", [False, True])
def test_deltas_match_decoding_everything_at_each_update_through_rewinds(tokenizer, thinking: bool):
    """An answer's deltas, or a think section's (which hold back what may begin its closing tag)."""
    ids = tokenizer.encode(TEXT * 2, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(6):
        req = Request([1, 2, 3], SamplingParams(max_tokens=1000, close_at_budget=False))
        if thinking:
            req.reasoning = ReasoningPhase(matcher=None, jump_forward=False, start=0, budget=1000)
        reference = WholeDecoding(tokenizer, CLOSE_TAG if thinking else "")
        stream, rest = _OutputDeltas(tokenizer), list(ids)
        while rest:
            rest = grow(req, rest, rng, rewinds=True)
            assert stream.deltas(req) == [d for d in [reference.delta(req.output_ids, final=False)] if d]
        req.status = RequestStatus.FINISHED
        assert stream.deltas(req) == [d for d in [reference.delta(req.output_ids, final=True)] if d]
        assert stream.final


def test_a_stream_whose_tokens_split_multibyte_characters_sends_whole_characters(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))  # split characters
    req = Request([1], SamplingParams(max_tokens=1000))
    stream, sent = _OutputDeltas(tokenizer), []
    for token in ids:  # one token an update: emoji and CJK characters span several
        req.append([token])
        sent += stream.deltas(req)
    req.status = RequestStatus.FINISHED
    sent += stream.deltas(req)
    assert not any("\ufffd" in d for d in sent)
    assert "".join(sent) == TEXT


def test_think_deltas_hold_back_what_may_begin_the_closing_tag(tokenizer):
    think = "Let me think <about> it </thi no, </think-ish > fine 😀 a < b"
    think_ids = tokenizer.encode(think, add_special_tokens=False)
    close_ids = tokenizer.encode(CLOSE_TAG, add_special_tokens=False)
    answer_ids = tokenizer.encode('{"a": "汉字"}', add_special_tokens=False)
    req = Request([1], SamplingParams(max_tokens=1000, close_at_budget=False))
    req.reasoning = phase = ReasoningPhase(matcher=None, jump_forward=False, start=0, budget=500)
    stream, thinking, answer = _OutputDeltas(tokenizer), WholeDecoding(tokenizer, CLOSE_TAG), WholeDecoding(tokenizer)
    got, want = [], []
    for token in think_ids + close_ids:
        req.append([token])
        got += stream.deltas(req)
        want += [d for d in [thinking.delta(phase.reasoning_ids(req.output_ids), final=False)] if d]
    phase.end, phase.answer_start = len(think_ids), req.num_output
    for token in answer_ids:
        req.append([token])
        got += stream.deltas(req)
        want += [d for d in [thinking.delta(phase.reasoning_ids(req.output_ids), final=True),
                             answer.delta(phase.answer_ids(req.output_ids), final=False)] if d]
    assert got == want
    assert "".join(d for d in got if type(d) is not str) == think
    assert "".join(d for d in got if type(d) is str) == '{"a": "汉字"}'


def test_a_section_decoder_sends_text_again_from_where_a_rewrite_diverges(tokenizer):
    first = tokenizer.encode("The answer is forty-two", add_special_tokens=False)
    second = tokenizer.encode("The answer is nine", add_special_tokens=False)
    decoder = _DeltaDecoder(tokenizer)
    assert decoder.delta(first, 0, len(first), final=False) == "The answer is forty-two"
    decoder.changed(len(os.path.commonprefix([first, second])))
    assert decoder.delta(second, 0, len(second), final=True) == "nine"


def test_a_rewound_think_tail_that_now_begins_the_closing_tag_is_held_as_decoding_everything_holds_it(tokenizer):
    """Sent "a <b", then "b" is replaced by "/": the text ends "</", which may begin the tag."""
    pieces = [tokenizer.encode(t, add_special_tokens=False) for t in ("Think a", " <", "b", "/", "th", "ink", "> ok")]
    req = Request([1], SamplingParams(max_tokens=100, close_at_budget=False))
    req.reasoning = phase = ReasoningPhase(matcher=None, jump_forward=False, start=0, budget=100)
    stream, reference = _OutputDeltas(tokenizer), WholeDecoding(tokenizer, CLOSE_TAG)
    for i, piece in enumerate(pieces):
        if i == 3:
            req.truncate(len(req.token_ids) - len(pieces[2]))
        req.append(piece)
        want = reference.delta(phase.reasoning_ids(req.output_ids), final=False)
        assert stream.deltas(req) == ([want] if want else [])


def test_a_feed_wakes_its_stream_only_with_text_and_joins_the_updates_that_came_meanwhile(tokenizer):
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    words = [tokenizer.encode(w, add_special_tokens=False) for w in (" Hello", " there", ",")]
    assert len(emoji) > 1  # a token alone is half the character
    req = Request([1], SamplingParams(max_tokens=100, close_at_budget=False))

    async def main() -> None:
        feed = _DeltaFeed(tokenizer)
        waiting = asyncio.ensure_future(feed.next())
        await asyncio.sleep(0)
        req.append(emoji[:1])
        feed.put_nowait(req)  # nothing whole to send: the task sleeps on
        await asyncio.sleep(0)
        assert not waiting.done()
        req.append(emoji[1:])
        feed.put_nowait(req)
        for word in words:  # updates before the task runs again
            req.append(word)
            feed.put_nowait(req)
        assert await waiting == ["😀 Hello there,"]
        req.status = RequestStatus.FINISHED
        feed.put_nowait(req)
        assert await feed.next() == [] and feed.final

    asyncio.run(main())


def test_decoding_skips_the_python_wrapper_only_where_its_clean_up_changes_nothing(tokenizer):
    """The Rust decoder stands in for `tokenizer.decode` where that adds nothing: clean-up off,
    or on and skipped (transformers 5.x keeps SmolLM2's flag set and skips it for BPE). A
    tokenizer whose clean-up changes text keeps its own decode, and outputs are what
    `tokenizer.decode` gives either way."""
    import copy

    from structgen.api import _raw_decoder

    ids = tokenizer.encode('{"note": "a , b . c ?"}', add_special_tokens=False)

    class Cleaning:  # a tokenizer whose decoding cleans up spaces before punctuation
        clean_up_tokenization_spaces = True

        def __init__(self, inner):
            self.inner, self.backend_tokenizer = inner, inner.backend_tokenizer

        def decode(self, ids, **kw):
            return self.inner.clean_up_tokenization(self.inner.decode(ids, **kw))

    flagged = copy.deepcopy(tokenizer)
    flagged.clean_up_tokenization_spaces = True  # as transformers 5.17 loads SmolLM2's
    cleaning = Cleaning(tokenizer)
    tokenizers = {"plain": tokenizer, "flagged": flagged, "cleaning": cleaning}
    decoders = {name: _raw_decoder(tok) for name, tok in tokenizers.items()}
    for name, tok in tokenizers.items():
        assert decoders[name](ids) == tok.decode(ids, skip_special_tokens=False)
    direct = {name: d.func == tokenizers[name].backend_tokenizer.decode for name, d in decoders.items()}
    skipped = flagged.decode(ids) == flagged.backend_tokenizer.decode(ids)  # transformers 5.x: BPE skips it
    assert direct == {"plain": True, "flagged": skipped, "cleaning": False}
    assert cleaning.decode(ids) == '{"note": "a, b. c?"}'

    class Unprobed(Cleaning):  # its Rust tokenizer cannot encode the probe: its own decode stays
        def __init__(self, inner):
            super().__init__(inner)
            self.backend_tokenizer = type("Backend", (), {"encode": lambda *a, **k: 1 / 0,
                                                          "decode": inner.backend_tokenizer.decode})()

    unprobed = Unprobed(tokenizer)
    assert _raw_decoder(unprobed).func == unprobed.decode
