"""Lists of token ids out of the cyclic collector's sight (engine/garbage_collection.py,
`untracked_ints`): a request's tokens, the prompt encoder's ids and the prefix cache's chain
stay untracked as they grow, and garbage that holds them is still freed."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest

from structgen.engine.garbage_collection import untracked_ints
from structgen.engine.prefix_cache import PrefixCache
from structgen.engine.request import Request
from structgen.prompt_encoding import SegmentEncoder
from structgen.sampling import SamplingParams
from tests.test_prompt_encoding import chat_texts

pytestmark = pytest.mark.skipif(sys.implementation.name != "cpython", reason="untracking is CPython's collector API")

PROMPT = list(range(1_000, 4_000))  # ids past the small ints CPython shares


@pytest.fixture(scope="module")
def llm():
    from structgen import LLM
    from structgen.engine.config import EngineConfig

    with LLM(config=EngineConfig(device="cpu", max_batch_size=2, max_seq_len=256)) as llm:
        yield llm


def test_a_requests_tokens_stay_untracked_as_the_output_grows_and_is_cut_back() -> None:
    req = Request(PROMPT, SamplingParams())
    assert req.token_ids == PROMPT and req.token_ids is not PROMPT  # still its own copy
    assert gc.is_tracked(PROMPT) and not gc.is_tracked(req.token_ids)
    req.append([5_000, 5_001])
    req.truncate(len(PROMPT) + 1)
    req.append([5_002])
    assert req.token_ids[-2:] == [5_000, 5_002] and not gc.is_tracked(req.token_ids)
    assert gc.is_tracked(req)  # the request itself is walked as before


def test_a_request_adopts_ids_made_for_it_and_the_api_never_shares_a_callers_list(llm) -> None:
    """`adopt_prompt_ids`: the list is the request's own, untracked, not a copy. The API
    adopts only lists its prompt encoding made: a caller's encoded prompt and a second call
    with the same text each get a list of their own."""
    from structgen.arguments import EncodedPrompt

    ids = list(PROMPT)
    req = Request(ids, SamplingParams(), adopt_prompt_ids=True)
    assert req.token_ids is ids and not gc.is_tracked(ids)
    caller = list(llm.encode_prompt("Name a city."))
    first = llm._new_request(llm._encode_all([EncodedPrompt(tuple(caller))], None, None)[0], SamplingParams(), None,
                             llm._constraint(str, True))
    again = [llm._new_request(got, SamplingParams(), None, llm._constraint(str, True))
             for got in llm._encode_all(["Name a city.", "Name a city."], None, None)]
    first.append([7])
    assert first.token_ids[:-1] == caller and len(caller) == first.num_prompt
    assert again[0].token_ids is not again[1].token_ids and again[0].token_ids == caller


def test_a_cycle_through_a_request_is_still_collected() -> None:
    req = Request(PROMPT, SamplingParams())
    req.on_update = lambda r, _req=req: None  # request -> closure -> request
    ref = weakref.ref(req)
    del req
    gc.collect()
    assert ref() is None


def test_an_untracked_list_is_still_freed_by_its_reference_count() -> None:
    values = untracked_ints([7_000 + i for i in range(10)])
    assert not gc.is_tracked(values)
    before = sys.getrefcount(values[3])
    alias = values[3]
    assert sys.getrefcount(alias) == before + 1  # reference counting works on it as on any list
    del values  # freed by its count: no collection needed
    assert sys.getrefcount(alias) == before


def test_the_prompt_encoder_and_the_prefix_cache_hand_out_untracked_ids(tokenizer) -> None:
    encoder = SegmentEncoder(tokenizer)
    for ids in encoder.encode_batch(chat_texts(tokenizer)) + encoder.encode_batch(chat_texts(tokenizer)):
        assert ids and not gc.is_tracked(ids)
    cache, page = PrefixCache(), 16
    tokens = list(range(1_000, 1_000 + 4 * page))
    keys = [(0, tuple(tokens[:page]))]
    assert cache.insert(keys[0], 1)
    chain = cache.match(tokens, page, 4)
    assert chain.pages == [1] and chain.tokens == tokens[:page]
    assert not any(gc.is_tracked(x) for x in (chain.tokens, chain.pages, chain.hashes))
