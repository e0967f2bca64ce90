"""The paged KV cache: the page table's allocator and reference counts, the prefix cache's hash
chain and LRU, and the engine over them on the real default model (CPU, float32): prefix
caching keeps greedy outputs and skips the shared prompt's prefill; a pool too small for
every request preempts and recomputes instead of failing, with the same outputs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from structgen.engine.config import EngineConfig
from structgen.engine.engine import Engine
from structgen.engine.kv_cache import PAGE_SIZE
from structgen.engine.models.loader import load_model_config
from structgen.engine.page_table import SCRATCH_PAGE, PageTable
from structgen.engine.prefix_cache import common_pages, page_keys
from structgen.engine.request import Request
from structgen.errors import EngineError
from structgen.sampling import SamplingParams

PAGE = 4
CPU = torch.device("cpu")


def table(num_pages: int = 9, slots: int = 3, prefix_caching: bool = True) -> PageTable:
    return PageTable(num_pages, PAGE, slots, 64, CPU, prefix_caching)


# ------------------------------------------------------------------------------ page table

@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_decoding_request_holds_exactly_the_pages_of_its_length_as_it_grows_and_rolls_back(prefix_caching):
    from structgen.engine.scheduler import Scheduler

    pages = table(num_pages=40, prefix_caching=prefix_caching)
    sched = Scheduler(pages, max_batch_size=2, chunk_tokens=64, lookahead=2)
    req = Request(list(range(100, 109)), SamplingParams(max_tokens=40), None, frozenset())
    sched.add(req)

    def step() -> None:
        for r, n in sched.schedule():
            r.num_cached += n
        assert pages.num_mapped(req.slot) == pages.pages_for(len(req.token_ids) + 2) * PAGE

    step()  # the prompt
    for tok in range(30):  # one token a step, crossing page boundaries (and the context's end)
        req.append([tok])
        step()
    assert len(pages._keyed[req.slot]) == (2 if prefix_caching else 0)  # the prompt's full pages
    req.truncate(len(req.token_ids) - 9)  # a rollback of output tokens gives pages back
    step()
    req.truncate(5)  # into the published prompt pages: the shared one is recomputed
    sched.schedule()
    assert req.num_cached == (4 if prefix_caching else 5)
    assert pages.num_mapped(req.slot) == 2 * PAGE
    sched.remove(req)
    assert pages.free_pages == 39



def test_pages_are_taken_a_page_at_a_time_and_given_back_on_shrink_and_release():
    pages = table()
    slot = pages.allocate_slot()
    assert pages.cover(slot, 1) and pages.num_mapped(slot) == PAGE
    assert pages.cover(slot, 9) and pages.num_mapped(slot) == 3 * PAGE
    assert pages.free_pages == 8 - 3
    mapped = pages.host[slot, :3].tolist()
    assert SCRATCH_PAGE not in mapped and len(set(mapped)) == 3
    assert (pages.host[slot, 3:] == SCRATCH_PAGE).all()  # unmapped positions: the scratch page
    rows = pages.token_slots(slot, 3, 3).tolist()  # positions 3, 4, 5 cross a page boundary
    assert rows == [mapped[0] * PAGE + 3, mapped[1] * PAGE, mapped[1] * PAGE + 1]
    pages.shrink(slot, 5)  # a rollback to 5 positions keeps two pages
    assert pages.num_mapped(slot) == 2 * PAGE and pages.free_pages == 6
    pages.release_slot(slot)
    assert pages.free_pages == 8 and pages.free_slots == 3


def test_cover_reports_an_exhausted_pool_and_keeps_what_it_took():
    pages = table(num_pages=4)  # three usable pages
    a, b = pages.allocate_slot(), pages.allocate_slot()
    assert pages.cover(a, 2 * PAGE)
    assert not pages.cover(b, 2 * PAGE)
    assert pages.num_mapped(b) == PAGE and pages.free_pages == 0
    pages.release_slot(a)
    assert pages.cover(b, 2 * PAGE)


def test_sync_copies_exactly_the_rows_changed_since_the_last_sync():
    pages = table(num_pages=20, slots=6)
    pages.table = torch.full_like(pages.host, -1)  # a separate device copy, as on CUDA
    pages.sync()  # nothing changed yet: nothing is copied
    assert (pages.table == -1).all()
    slots = [pages.allocate_slot() for _ in range(6)]
    for slot in (slots[1], slots[2], slots[4]):
        pages.cover(slot, 2 * PAGE)
    assert pages.changed_runs() == [(1, 3), (4, 5)]
    version = pages.version
    pages.sync()
    copied = [row for row in range(7) if not (pages.table[row] == -1).all()]
    assert copied == [1, 2, 4]
    assert torch.equal(pages.table[copied], pages.host[copied])
    assert pages.changed_runs() == [] and pages.version == version  # a sync changes no page
    pages.table[1].fill_(-1)
    pages.shrink(slots[2], PAGE)  # a rollback changes its row only
    pages.sync()
    assert (pages.table[1] == -1).all() and torch.equal(pages.table[2], pages.host[2])
    assert pages.version > version


# ------------------------------------------------------------------------------ prefix cache


def test_the_hash_chain_keys_a_page_by_everything_before_it():
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8], PAGE, 2)
    b = page_keys([9, 2, 3, 4, 5, 6, 7, 8], PAGE, 2)
    assert a[0][1] == (1, 2, 3, 4) and a[1][1] == b[1][1] == (5, 6, 7, 8)
    assert a[1] != b[1]  # same tokens, different prefix: another key
    assert a == page_keys([1, 2, 3, 4, 5, 6, 7, 8, 0], PAGE, 2)
    assert page_keys(list(range(12)), PAGE, 1, hash(a[1]), 2)[0][0] == hash(a[1])  # the chain goes on


def test_published_prompt_pages_are_shared_then_kept_idle_then_evicted_tail_first():
    pages = table(num_pages=9)
    prompt = list(range(100, 111))  # 11 tokens: two full pages and a partial one
    a = pages.allocate_slot()
    assert pages.match_prefix(a, prompt, len(prompt)) == 0
    assert pages.cover(a, len(prompt) + 2)
    pages.publish(a, prompt, num_computed=6, num_prompt=len(prompt))  # only page 0 is computed
    assert len(pages.cache) == 1
    pages.publish(a, prompt, num_computed=11, num_prompt=len(prompt))
    assert len(pages.cache) == 2  # the partial page is never cached
    b = pages.allocate_slot()
    assert pages.match_prefix(b, prompt, len(prompt)) == 2 * PAGE
    assert pages.host[b, :2].tolist() == pages.host[a, :2].tolist()  # the same pages, shared
    # The last prompt token is always run again: a prompt of exactly two pages matches one.
    c = pages.allocate_slot()
    assert pages.match_prefix(c, prompt[:8], 8) == PAGE
    for slot in (a, b, c):
        pages.release_slot(slot)
    assert pages.free_pages == 8 and pages.cache.num_idle == 2  # cached, idle, still findable
    hog = pages.allocate_slot()
    assert pages.cover(hog, 7 * PAGE)  # needs one cached page: the least recently idle goes,
    assert len(pages.cache) == 1  # the chain's tail (released before its head)
    assert pages.match_prefix(pages.allocate_slot(), prompt, len(prompt)) == PAGE
    assert not pages.cover(hog, 8 * PAGE)  # the head is held again: nothing left to evict


def test_a_shared_page_stays_held_until_its_last_holder_lets_go():
    pages = table(num_pages=12, slots=4)
    prompt = list(range(200, 213))  # three full pages
    owner = pages.allocate_slot()
    pages.cover(owner, 15)
    pages.publish(owner, prompt, 13, 13)
    sharers = [pages.allocate_slot() for _ in range(3)]
    for slot in sharers:
        assert pages.match_prefix(slot, prompt, 13) == 3 * PAGE
        assert pages.cover(slot, 15)  # its own fourth page
    assert pages.slot_pages(sharers[0])[:3] == pages.slot_pages(owner)[:3]
    assert pages.free_pages == 11 - 4 - 3
    pages.release_slot(owner)  # its own last page goes back; the shared three stay held
    pages.release_slot(sharers[0])
    assert pages.cache.num_idle == 0 and pages.free_pages == 11 - 3 - 2
    pages.release_slot(sharers[1])
    assert pages.cache.num_idle == 0
    pages.release_slot(sharers[2])  # the last holder: all three idle, still cached
    assert pages.cache.num_idle == 3 and pages.free_pages == 11
    again = pages.allocate_slot()
    assert pages.match_prefix(again, prompt, 13) == 3 * PAGE and pages.cache.num_idle == 0


def test_a_rollback_into_shared_pages_lets_go_of_them_for_recomputation():
    pages = table()
    prompt = list(range(13))
    a = pages.allocate_slot()
    pages.cover(a, 15)
    pages.publish(a, prompt, 13, 13)
    b = pages.allocate_slot()
    assert pages.match_prefix(b, prompt, 13) == 3 * PAGE
    shared = pages.host[b, 1].item()
    assert pages.writable_from(b, 12) == 12  # past the shared pages: nothing to do
    assert pages.writable_from(b, 6) == PAGE  # into page 1: it and those after are let go
    assert pages.num_mapped(b) == PAGE and pages.host[a, 1].item() == shared
    assert pages.cover(b, 8) and pages.host[b, 1].item() != shared


def test_a_matched_prefix_holds_the_pages_and_keys_that_publishing_it_gave_and_stops_at_a_fork():
    pages = table(num_pages=12, slots=4)
    prompt = list(range(200, 217))  # four full pages and one token
    a = pages.allocate_slot()
    assert pages.cover(a, len(prompt))
    pages.publish(a, prompt, len(prompt), len(prompt))
    b = pages.allocate_slot()
    assert pages.match_prefix(b, prompt, len(prompt)) == 4 * PAGE
    assert pages.host[b].tolist() == pages.host[a].tolist()[:4] + [SCRATCH_PAGE] * (pages.max_pages_per_seq - 4)
    assert pages._keyed[b] == pages._keyed[a] == [hash(k) for k in page_keys(prompt, PAGE, 4)]
    # A prompt that forks inside page 2 finds pages 0 and 1 only, and its own page 2 extends
    # the chain from the shared page 1's key.
    fork = prompt[:9] + [7] + prompt[10:]
    c = pages.allocate_slot()
    assert pages.match_prefix(c, fork, len(fork)) == 2 * PAGE
    assert pages.host[c, :3].tolist() == pages.host[a, :2].tolist() + [SCRATCH_PAGE]
    assert pages.cover(c, len(fork))
    pages.publish(c, fork, len(fork), len(fork))
    assert pages._keyed[c] == [hash(k) for k in page_keys(fork, PAGE, 4)]
    assert pages.match_prefix(pages.allocate_slot(), fork, len(fork)) == 4 * PAGE


def walked(pages: PageTable, tokens: list[int], num_pages: int) -> list[int]:
    """The cached pages `tokens` start with, found by hashing every page's key in turn."""
    found = []
    for key in page_keys(tokens, pages.page_size, num_pages):
        page = pages.cache.find(key)
        if page is None:
            break
        found.append(page)
    return found


def matched(pages: PageTable, tokens: list[int]) -> list[int]:
    """`match_prefix` into a new slot: the pages it mapped, checked against the walk and its keys."""
    slot = pages.allocate_slot()
    n = pages.match_prefix(slot, tokens, len(tokens)) // pages.page_size
    got = pages.host[slot, :n].tolist()
    assert got == walked(pages, tokens, (len(tokens) - 1) // pages.page_size)
    assert pages._keyed[slot] == [hash(k) for k in page_keys(tokens, pages.page_size, n)]
    return got


def test_a_prefix_found_from_the_last_chain_is_the_one_a_walk_of_the_hash_chain_finds():
    pages = PageTable(40, PAGE, 8, 256, CPU)
    prompt = list(range(300, 341))  # ten full pages and one token
    a = pages.allocate_slot()
    assert pages.cover(a, len(prompt))
    pages.publish(a, prompt, len(prompt), len(prompt))
    assert len(matched(pages, prompt)) == 10
    assert len(matched(pages, prompt[:30] + [1, 2, 3])) == 7  # the last chain's first pages
    assert len(matched(pages, prompt[:13] + [5] + prompt[14:])) == 3  # parts inside page 3
    assert len(matched(pages, [7] + prompt[1:])) == 0
    assert len(matched(pages, prompt)) == 10  # past the last chain: found by the walk again
    for slot in range(1, 6):
        pages.release_slot(slot)
    pages.release_slot(a)  # every page of the chain idle: a hog evicts its tail,
    hog = pages.allocate_slot()
    assert pages.cover(hog, 32 * PAGE)
    assert len(pages.cache) == 7 and len(matched(pages, prompt)) == 7  # which the last chain held


def test_common_pages_counts_equal_pages_whether_the_ids_are_the_same_objects_or_equal_ones():
    """The item-pointer comparison is a shortcut only: lists of the same int objects, of equal
    but distinct ones (as two tokenizer calls give), or of both mixed, count the pages a
    page-by-page comparison of values counts, wherever they part, and a guess of where they
    part (right, wrong or out of range) changes only how it is found."""
    import random

    rng, page = random.Random(0), 4
    base = [rng.randrange(1_000, 50_000) for _ in range(40 * page)]
    for _ in range(300):
        b = list(base)  # the same objects
        for i in rng.sample(range(len(b)), rng.randrange(0, 6)):
            b[i] = int(str(b[i]))  # equal, another object
        if rng.random() < 0.7:
            b[rng.randrange(len(b))] += 1  # a different token
        limit = rng.randrange(0, 41)
        a = base + [7] * rng.randrange(0, 9)
        expected = next((i for i in range(limit) if a[i * page : (i + 1) * page] != b[i * page : (i + 1) * page]), limit)
        b = b[: rng.randrange(limit * page, len(b) + 1)]
        assert common_pages(a, b, page, limit) == expected
        for guess in {expected, expected - 1, expected + 1, rng.randrange(-1, limit + 3)}:
            assert common_pages(a, b, page, limit, guess) == expected, guess


def test_an_agent_bursts_prompts_find_the_pages_a_walk_of_the_hash_chain_finds(maskbench_dir, tokenizer):
    """bench_serving's agent turns (one tool catalogue, ~3,000 tokens): each turn's match, in
    burst order after the first turn's prompt was published, maps the walk's pages."""
    from benchmarks.bench_serving import agent_workload

    turns = agent_workload(24, maskbench_dir, tokenizer)
    texts = [tokenizer.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=False) for t in turns]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    pages = PageTable(8 * 256, PAGE_SIZE, 32, 4096, CPU)
    first = pages.allocate_slot()
    assert pages.cover(first, len(prompts[0]))
    pages.publish(first, prompts[0], len(prompts[0]), len(prompts[0]))
    shared = [len(matched(pages, p)) for p in prompts[1:] + prompts[:1]]
    assert min(shared) * PAGE_SIZE > 2_500 and shared[-1] == (len(prompts[0]) - 1) // PAGE_SIZE


# ------------------------------------------------------------------------------ the Triton kernel


# Triton's interpreter in some releases (3.6, the lent GPU hosts'; 3.9 has the fix) turns a
# loop bound computed in the kernel into an int with `int(array)`, which numpy 2.4 refuses for
# the 1-element arrays it holds there (triton-lang/triton#9171): no kernel with such a loop can
# run under it.
INTERPRETER_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def count_to(n_ptr, out_ptr):
    n = tl.load(n_ptr)
    total = 0
    for i in range(0, tl.where(n > 1, n, 1)):
        total += i
    tl.store(out_ptr, total)

out = torch.zeros(1, dtype=torch.int32)
try:
    count_to[(1,)](torch.tensor([4], dtype=torch.int32), out)
except Exception as e:
    if "only 0-dimensional arrays" not in repr(e):
        raise
    print("INTERPRETER-CANNOT-LOOP", triton.__version__)
"""


def test_the_paged_decode_kernel_equals_the_torch_reference_under_the_interpreter(tmp_path):
    """A small case of tests/engine/test_kernels.py's comparison, in a process of its own so
    Triton's interpreter is on from its first import."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    (tmp_path / "probe.py").write_text(INTERPRETER_PROBE)  # (a file: triton.jit reads its source)
    probe = subprocess.run([sys.executable, str(tmp_path / "probe.py")], env=env, capture_output=True,
                           text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    if "INTERPRETER-CANNOT-LOOP" in probe.stdout:
        pytest.skip(f"Triton {probe.stdout.split()[-1]}'s interpreter cannot run kernel loops with this "
                    "numpy (triton-lang/triton#9171; a newer Triton runs them)")
    code = (
        "import torch\n"
        "from structgen.engine.kernels.decode_attention import decode_attention, decode_attention_reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "k, v = torch.randn(2, 9, 16, 2, 32, generator=g)\n"
        "table = torch.tensor([[3, 1, 7, 0], [2, 8, 5, 4]])\n"
        "q = torch.randn(2, 4, 32, generator=g)\n"
        "slots, lens = torch.tensor([1, 0]), torch.tensor([50, 17])\n"
        "out = decode_attention(q, k, v, table, slots, lens)\n"
        "ref = decode_attention_reference(q, k, v, table, slots, lens)\n"
        "assert (out - ref).abs().max() < 1e-4, (out - ref).abs().max()\n"
        "out = decode_attention(q, k, v, table, slots, lens, window=20)\n"
        "assert (out - decode_attention_reference(q, k, v, table, slots, lens, window=20)).abs().max() < 1e-4\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# ------------------------------------------------------------------------------ the engine


def engine(model_dir, **config) -> Engine:
    config = {"device": "cpu", "max_batch_size": 4, "max_seq_len": 4096, "jump_forward": False, **config}
    return Engine(load_model_config(model_dir), EngineConfig(**config), model_dir)


def run_greedy(eng: Engine, prompts: list[list[int]], max_tokens: int) -> list[Request]:
    reqs = [Request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    eng.run(reqs)
    return reqs


def chat(tokenizer, system: str, user: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


SYSTEM = ("You are a support agent for a hardware store. Answer briefly. Tools: " +
          " ".join(f"tool_{i}(item, quantity) orders {i} boxes of screws;" for i in range(12)))
QUESTIONS = ["Which tool orders three boxes?", "Say hello.", "What do you sell?"]


def test_greedy_outputs_are_the_same_with_prefix_caching_on_and_off(model_dir, tokenizer):
    prompts = [chat(tokenizer, SYSTEM, q) for q in QUESTIONS]
    assert len(prompts[0]) > 200
    outputs = {}
    for caching in (False, True):
        eng = engine(model_dir, prefix_caching=caching)
        first = run_greedy(eng, prompts[:1], 6)  # the system prompt's pages are cached after it
        rest = run_greedy(eng, prompts[1:], 6)  # these two run together, sharing them
        outputs[caching] = [r.output_ids for r in first + rest]
        cached = [r.stats.cached_prompt_tokens for r in first + rest]
        if caching:
            assert cached[0] == 0 and min(cached[1:]) > 0.8 * len(prompts[0])
        else:
            assert cached == [0, 0, 0]
        assert eng.runner.kv.pages.free_slots == eng.runner.kv.num_slots
    assert outputs[True] == outputs[False]


def test_requests_arriving_together_with_a_shared_prompt_compute_it_once(model_dir, tokenizer):
    """Agent turns sharing a tool catalogue arrive at once: the first computes the shared
    pages, the others wait for them instead of computing them beside it."""
    prompts = [chat(tokenizer, SYSTEM, q) for q in QUESTIONS]
    eng = engine(model_dir, prefill_chunk_tokens=64)  # the first prompt takes several steps
    reqs = run_greedy(eng, prompts, 4)
    cached = [r.stats.cached_prompt_tokens for r in reqs]
    assert cached[0] == 0 and min(cached[1:]) >= 192  # the shared 207 tokens' full pages
    plain = run_greedy(engine(model_dir, prefix_caching=False), prompts, 4)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]


def test_the_second_request_with_a_long_shared_prompt_prefills_a_fraction_of_it(model_dir, tokenizer):
    system = SYSTEM * 13
    first, second = (chat(tokenizer, system, q) for q in QUESTIONS[:2])
    assert len(first) > 2500
    eng = engine(model_dir)
    a = run_greedy(eng, [first], 1)[0]
    b = run_greedy(eng, [second], 1)[0]
    prefilled = [r.stats.prompt_tokens - r.stats.cached_prompt_tokens for r in (a, b)]
    assert prefilled[0] == len(first)
    assert prefilled[1] < 0.05 * prefilled[0]


def test_a_pool_too_small_for_every_request_preempts_and_keeps_the_outputs(model_dir, tokenizer):
    prompts = [chat(tokenizer, "Be brief.", q) for q in [*QUESTIONS, "Name a color."]]
    roomy = run_greedy(engine(model_dir, max_seq_len=128, prefix_caching=False), prompts, 24)
    tight = engine(model_dir, max_seq_len=128, kv_cache_tokens=128, prefix_caching=False)  # 8 pages for 4
    squeezed = run_greedy(tight, prompts, 24)
    assert sum(r.stats.preemptions for r in squeezed) > 0
    assert [r.output_ids for r in squeezed] == [r.output_ids for r in roomy]
    assert all(r.finish_reason in ("stop", "length") for r in squeezed)
    assert tight.runner.kv.pages.free_pages == tight.runner.kv.pages.num_pages - 1


def test_on_the_cpu_the_pool_takes_at_most_its_share_of_the_available_memory(model_dir, monkeypatch):
    """The prefix cache keeps the pages it used, so the pool's size is the memory a long-running
    CPU server ends up holding: a share of what the machine has free, not slots x max_seq_len."""
    from structgen.engine import model_runner
    from structgen.engine.kv_cache import KVCache

    per_page = KVCache.bytes_per_page(load_model_config(model_dir), PAGE_SIZE, torch.float32)
    monkeypatch.setattr(model_runner, "_free_memory", lambda device: (10**6 * per_page, "memory"))
    assert engine(model_dir).runner.kv.pages.num_pages == 4 * 4096 // PAGE_SIZE + 1  # every context fits
    monkeypatch.setattr(model_runner, "_free_memory", lambda device: (1000 * per_page, "memory"))
    assert engine(model_dir).runner.kv.pages.num_pages == 500 + 1  # half of it, not the 1,024 pages of four contexts
    with pytest.raises(EngineError, match="lower max_seq_len or give the cache more room"):
        engine(model_dir, kv_cache_memory_fraction=0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_graphs_prefix_caching_and_preemption_keep_greedy_outputs(model_dir, tokenizer):
    """The decode graphs read the page table as a static input: shared pages (prefix caching)
    and pages handed around by preemption give the outputs of a roomy cache without either."""
    prompts = [chat(tokenizer, SYSTEM, q) for q in QUESTIONS]
    base = engine(model_dir, device="cuda", dtype="float32", max_seq_len=1024, prefix_caching=False)
    want = [r.output_ids for r in run_greedy(base, prompts, 32)]
    cached = engine(model_dir, device="cuda", dtype="float32", max_seq_len=1024)
    run_greedy(cached, prompts[:1], 1)
    got = run_greedy(cached, prompts, 32)
    assert min(r.stats.cached_prompt_tokens for r in got) >= 192  # the shared 207 tokens' full pages
    assert [r.output_ids for r in got] == want
    # A pool of 8 pages for 4 short chats (as the CPU test): running requests outgrow it.
    short = [chat(tokenizer, "Be brief.", q) for q in [*QUESTIONS, "Name a color."]]
    roomy = run_greedy(engine(model_dir, device="cuda", dtype="float32", max_seq_len=128, prefix_caching=False),
                       short, 24)
    tight = engine(model_dir, device="cuda", dtype="float32", max_seq_len=128, kv_cache_tokens=128,
                   prefix_caching=False)
    squeezed = run_greedy(tight, short, 24)
    assert sum(r.stats.preemptions for r in squeezed) > 0
    assert [r.output_ids for r in squeezed] == [r.output_ids for r in roomy]


def test_a_chats_next_turn_finds_the_last_turns_answer_in_the_cache(model_dir, tokenizer):
    """A finished request's full pages, its output's included, are cached: the next turn
    (the history, the answer, a new message) prefills from past the answer's full pages."""
    eng = engine(model_dir)
    first = chat(tokenizer, SYSTEM, QUESTIONS[0])
    answer = run_greedy(eng, [first], 40)[0]
    assert answer.num_output >= 2 * PAGE_SIZE  # (the answer spans pages of its own)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]},
                {"role": "assistant", "content": tokenizer.decode(answer.output_ids)},
                {"role": "user", "content": QUESTIONS[1]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    second = tokenizer.encode(text, add_special_tokens=False)
    assert second[: len(answer.token_ids)] == answer.token_ids  # the history is the same tokens
    turn = run_greedy(eng, [second], 2)[0]
    assert turn.stats.cached_prompt_tokens == (len(answer.token_ids) - 1) // PAGE_SIZE * PAGE_SIZE
    assert turn.stats.cached_prompt_tokens > len(first)
