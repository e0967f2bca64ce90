"""llama.cpp as a CPU peer (llama-cpp-python), on the same GGUF, prompt tokens and threads as
ours: greedy, its grammar built from the same JSON schema. Optional: llama-cpp-python compiles
llama.cpp on install (`pip install llama-cpp-python`), so it is a benchmark extra only.

Each run starts from an empty KV state (`reset()`): llama-cpp-python otherwise reuses the
previous call's matching prompt prefix, which would time a cache hit, not a prefill.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def available() -> str | None:
    """None where llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # not installed, or a build without this CPU's instructions
        return f"{type(exc).__name__}: {exc}"
    return None


class LlamaCppPeer:
    def __init__(self, gguf: Path, threads: int, n_ctx: int = 1024):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         verbose=False)

    def generate(self, prompt_ids: list[int], max_tokens: int, schema: dict[str, Any] | None = None,
                 ban_tokens: tuple[int, ...] = ()) -> dict[str, Any]:
        """One greedy completion after a warm-up: ms per output token (wall / tokens, prefill
        included, as ours) and time to the first streamed token."""
        from llama_cpp import LlamaGrammar

        grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False) if schema else None
        bias = {t: -1e9 for t in ban_tokens} or None

        def run() -> tuple[float, float, int, str]:
            self.llm.reset()
            t0 = time.perf_counter()
            first, text, n = 0.0, [], 0
            for chunk in self.llm.create_completion(prompt_ids, max_tokens=max_tokens, temperature=0.0,
                                                    grammar=grammar, logit_bias=bias, stream=True):
                if n == 0:
                    first = time.perf_counter() - t0
                n += 1
                text.append(chunk["choices"][0]["text"])
            return time.perf_counter() - t0, first, n, "".join(text)

        run()
        wall, first, n, text = run()
        return {"ms_per_token": 1e3 * wall / max(n, 1), "ttft_ms": 1e3 * first, "tokens": n, "text": text[:80]}
