"""The embedded engine: a compact Llama-family runner with a slot KV cache, continuous
batching and masked sampling. `Engine` steps requests; `EngineLoop` runs it in the background."""
