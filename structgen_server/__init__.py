"""structgen's OpenAI-compatible HTTP server: `structgen serve --model ...` or
`python -m structgen_server --model ...`; `create_app(llm)` for embedding it."""

from structgen_server.app import create_app, run_server

__all__ = ["create_app", "run_server"]
