"""The `structgen` command: `structgen serve` runs the OpenAI-compatible server,
`structgen generate` prints one constrained generation (a quick check of a model + schema)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from structgen.engine.config import EngineConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF-style directory, .safetensors or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default="auto", choices=["auto", "xgrammar", "llguidance"], help="grammar backend")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: per device)")
    p.add_argument("--max-batch-size", type=int, default=EngineConfig.max_batch_size, help="concurrent requests")
    p.add_argument("--max-seq-len", type=int, default=EngineConfig.max_seq_len, help="prompt + output tokens per request")
    p.add_argument("--no-jump-forward", action="store_true", help="decode grammar-forced text token by token")
    p.add_argument(
        "--tensor-parallel", type=int, default=1,
        help="split the model across N GPUs of this host (or across the processes torchrun launched: "
        "docs/guide/multi-gpu.md)",
    )
    p.add_argument("--batch-invariant", action="store_true",
                   help="GPU kernels that sum the same way at every step size: greedy outputs do not change with "
                   "batching or speculation (slower: docs/performance.md)")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        jump_forward=not args.no_jump_forward,
        tensor_parallel=args.tensor_parallel,
        batch_invariant=args.batch_invariant,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="structgen", description="Structured generation with an embedded engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the `model` id clients send (default: the model's name)")
    serve.add_argument("--default-max-tokens", type=int, default=1024, help="max_tokens when a request omits it")
    serve.add_argument(
        "--api-key-file", default=None,
        help="require `Authorization: Bearer <key>` on every path but /health, the key read from "
        "this file (or set STRUCTGEN_API_KEY)",
    )
    serve.add_argument("--api-key", default=None, help="the key itself (visible to other users in `ps`: prefer the file or variable)")
    serve.add_argument(
        "--allowed-hosts", default=None,
        help="comma-separated Host headers to answer, '*' for any (default: 127.0.0.1/localhost/[::1] "
        "with the port when bound to loopback, any otherwise)",
    )
    serve.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body accepted (413 beyond)")
    serve.add_argument(
        "--max-generations-per-request", type=int, default=128,
        help="most generations (prompts x n) one request may ask for (400 beyond)",
    )
    serve.add_argument(
        "--max-client-errors", type=int, default=64,
        help="4xx answers one client address may get within 10 s before it is answered 429 for "
        "the rest of that window (0: never; raise it behind a reverse proxy)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--data-parallel", type=int, default=1,
        help="run N engine replicas (one GPU each, or --tensor-parallel GPUs each) behind this one server",
    )

    gen = sub.add_parser("generate", help="print one constrained generation")
    _engine_args(gen)
    kind = gen.add_mutually_exclusive_group()
    kind.add_argument("--schema", help="JSON Schema: a file path or inline JSON")
    kind.add_argument("--regex", help="a regular expression")
    kind.add_argument("--grammar", help="a grammar file (EBNF/GBNF or Lark)")
    kind.add_argument("--choice", nargs="+", help="one of these strings (after the prompt: the list takes every word that follows)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("prompt")
    return parser


def _output_type(args: argparse.Namespace) -> object:
    from structgen.types import CFG, Choice, JsonSchema, Regex

    if args.schema:
        path = Path(args.schema)
        return JsonSchema(path.read_text() if path.exists() else args.schema)
    if args.regex:
        return Regex(args.regex)
    if args.grammar:
        return CFG(Path(args.grammar).read_text())
    if args.choice:
        return Choice(args.choice)
    return str


def _api_key(args: argparse.Namespace) -> str | None:
    """The server's API key: --api-key-file, --api-key or $STRUCTGEN_API_KEY (None: no key)."""
    from structgen.errors import InvalidParameterError

    if args.api_key_file and args.api_key:
        raise InvalidParameterError("give the API key once: --api-key-file or --api-key, not both")
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise InvalidParameterError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror}") from e
        if not key:
            raise InvalidParameterError(f"--api-key-file {args.api_key_file} is empty; put the key in it")
        return key
    return args.api_key or os.environ.get("STRUCTGEN_API_KEY") or None


def _replica_args(args: argparse.Namespace) -> list[str]:
    """The `structgen serve` arguments of one data-parallel replica: the engine's and the
    request limits; the front end keeps the address, Host checks and client throttle."""
    out = ["--backend", args.backend, "--max-batch-size", str(args.max_batch_size),
           "--max-seq-len", str(args.max_seq_len), "--tensor-parallel", str(args.tensor_parallel),
           "--default-max-tokens", str(args.default_max_tokens), "--max-body-bytes", str(args.max_body_bytes),
           "--max-generations-per-request", str(args.max_generations_per_request),
           "--max-client-errors", "0", "--allowed-hosts", "*", "--log-level", args.log_level]
    for flag, value in (("--model", args.model), ("--device", args.device), ("--dtype", args.dtype),
                        ("--served-model-name", args.served_model_name)):
        if value is not None:
            out += [flag, str(value)]
    return out + (["--no-jump-forward"] if args.no_jump_forward else [])


def _serve_replicas(args: argparse.Namespace) -> None:
    from structgen.errors import InvalidParameterError
    from structgen_server.guard import default_allowed_hosts
    from structgen_server.replicas import run_replicated_server, visible_gpus

    gpus = 0 if args.device == "cpu" else len(visible_gpus())
    per_replica = args.tensor_parallel if gpus else 0
    if gpus and per_replica * args.data_parallel > gpus:
        raise InvalidParameterError(
            f"--data-parallel {args.data_parallel} x --tensor-parallel {args.tensor_parallel} needs "
            f"{per_replica * args.data_parallel} GPUs and this host has {gpus}; lower one of them")
    if args.allowed_hosts is None:
        hosts = default_allowed_hosts(args.host, args.port)
    else:
        hosts = None if "*" in args.allowed_hosts else frozenset(h.strip().lower() for h in args.allowed_hosts.split(","))
    run_replicated_server(_replica_args(args), args.data_parallel, host=args.host, port=args.port,
                          api_key=_api_key(args), allowed_hosts=hosts, max_body_bytes=args.max_body_bytes,
                          max_client_errors=args.max_client_errors, default_max_tokens=args.default_max_tokens,
                          gpus_per_replica=per_replica, log_level=args.log_level)


def _is_torchrun_worker(args: argparse.Namespace) -> bool:
    """A rank above 0 of a torchrun launch of a split model: it holds a shard of the model for
    rank 0's engine."""
    return args.tensor_parallel > 1 and int(os.environ.get("RANK", "0")) > 0 and "WORLD_SIZE" in os.environ


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from structgen.errors import StructgenError

    try:
        if _is_torchrun_worker(args):
            from structgen.engine.parallel import run_worker

            run_worker(args.model, _engine_config(args))  # rank 0 runs the command itself
            return 0
        if args.command == "serve" and args.data_parallel > 1:
            _serve_replicas(args)
            return 0
        if args.command == "serve":
            from structgen_server.app import run_server
            from structgen_server.process import PARENT_PID_ENV, exit_with_parent

            if os.environ.get(PARENT_PID_ENV, "").isdigit():  # a data-parallel replica
                exit_with_parent(int(os.environ[PARENT_PID_ENV]))

            run_server(
                args.model,
                host=args.host,
                port=args.port,
                served_model_name=args.served_model_name,
                backend=args.backend,
                config=_engine_config(args),
                default_max_tokens=args.default_max_tokens,
                api_key=_api_key(args),
                allowed_hosts=args.allowed_hosts.split(",") if args.allowed_hosts else None,
                max_body_bytes=args.max_body_bytes,
                max_generations=args.max_generations_per_request,
                max_client_errors=args.max_client_errors,
                log_level=args.log_level,
            )
            return 0
        from structgen.api import LLM

        with LLM(args.model, backend=args.backend, config=_engine_config(args)) as llm:  # stops worker ranks
            c = llm.complete(_output_type(args), args.prompt, max_tokens=args.max_tokens, temperature=args.temperature)
        print(c.text if isinstance(c.value, str) else json.dumps(c.value, default=str))
        return 0
    except StructgenError as e:
        print(f"structgen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
