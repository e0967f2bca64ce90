"""engine/repair.py's ban: on the real tokenizer, a repaired request's mask row loses exactly
the tokens that would keep its output on the rejected text."""

from __future__ import annotations

import numpy as np
import pytest

from structgen.engine.jump_forward import VocabBytes
from structgen.engine.repair import RejectedText, ban_rejected
from structgen.engine.request import Request
from structgen.grammar.backends.base import allocate_bitmask, allowed_ids, set_only_tokens
from structgen.sampling import SamplingParams


@pytest.fixture(scope="module")
def vocab(tokenizer) -> VocabBytes:
    return VocabBytes(tokenizer, len(tokenizer), set())


def _request(rejected: bytes, output: list[int]) -> Request:
    req = Request([1, 2], SamplingParams(max_tokens=8))
    req.token_ids += output
    req.rejected.append(RejectedText(0, rejected))
    return req


def test_the_ban_clears_every_token_that_spells_on_the_rejected_text(vocab, tokenizer):
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    bitmask = allocate_bitmask(1, len(tokenizer), host_only=True)
    ban_rejected(bitmask, [(0, _request(b'USA"', []), None)], vocab)
    allowed = set(allowed_ids(bitmask[0].numpy().view(np.uint32)).tolist())
    for text in ("U", "US", "USA"):
        assert ids(text)[0] not in allowed  # spells a prefix of the rejected text
    assert vocab.token_id(b'"') in allowed and vocab.token_id(b"United") in allowed


def test_the_ban_follows_the_output_and_stops_once_it_left_the_rejected_text(vocab, tokenizer):
    us, quote = vocab.token_id(b"US"), vocab.token_id(b'"')
    bitmask = allocate_bitmask(2, len(tokenizer), host_only=True)
    ban_rejected(bitmask, [(0, _request(b'USA"', [us]), None), (1, _request(b'USA"', [quote]), None)], vocab)
    after_us = set(allowed_ids(bitmask[0].numpy().view(np.uint32)).tolist())
    assert vocab.token_id(b"A") not in after_us and vocab.token_id(b'A"') not in after_us
    assert vocab.token_id(b"S") in after_us
    assert bitmask[1].eq(-1).all()  # `"` left the rejected text: nothing banned


def test_a_row_the_ban_would_empty_keeps_its_grammar_mask(vocab, tokenizer):
    forced = vocab.token_id(b"U")
    bitmask = allocate_bitmask(1, len(tokenizer), host_only=True)
    set_only_tokens(bitmask, 0, [forced])  # the grammar forces the rejected text here
    ban_rejected(bitmask, [(0, _request(b'USA"', []), None)], vocab)
    assert allowed_ids(bitmask[0].numpy().view(np.uint32)).tolist() == [forced]
