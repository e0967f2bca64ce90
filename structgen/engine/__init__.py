"""The embedded engine: a compact Llama-family runner with a paged KV cache (prefix caching,
preemption), continuous batching and masked sampling. `Engine` steps requests; `EngineLoop`
runs it in the background."""
