"""The `structgen` command: `structgen serve` runs the OpenAI-compatible server,
`structgen generate` prints one constrained generation (a quick check of a model + schema)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
from pathlib import Path

from structgen.engine.config import EngineConfig
from structgen.schema.budget import DEFAULT_COMPILE_TIMEOUT_S
from structgen.schema.limits import BUILD_LIMITS, DEFAULT_LIMITS, ConstraintLimits


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF-style directory, .safetensors or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default="auto", choices=["auto", "xgrammar", "llguidance"], help="grammar backend")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: per device)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="requests decoded at once, more wait in a queue (default: by device: 1024 on GPUs of 70 GiB "
                   "or more, 256 on smaller GPUs, 64 on the CPU)")
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
        max_waiting=getattr(args, "max_waiting", None),
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
        "--max-waiting", type=int, default=1024,
        help="generations that may wait for a decoding slot; past it a request is answered 503 with "
        "Retry-After, so a flood neither grows the queue without end nor delays everyone for minutes",
    )
    serve.add_argument("--max-constraint-bytes", type=int, default=DEFAULT_LIMITS.max_source_bytes,
                       help="largest schema / regex / grammar text a request may send, UTF-8 bytes (400 beyond)")
    serve.add_argument("--max-constraint-depth", type=int, default=DEFAULT_LIMITS.max_depth,
                       help="deepest bracket nesting of a constraint's text (400 beyond)")
    serve.add_argument("--max-enum-values", type=int, default=DEFAULT_LIMITS.max_enum_values,
                       help="most enum / const values in one JSON schema (400 beyond)")
    serve.add_argument("--compile-timeout", type=float, default=DEFAULT_COMPILE_TIMEOUT_S,
                       help="seconds one constraint's compile may take (400 beyond)")
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
    serve.add_argument(
        "--front-processes", type=int, default=0,
        help="run the HTTP server in N processes of its own beside the engine's (0: in the engine's process); "
        "under hundreds of concurrent requests their parsing and formatting then never slows the engine",
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
        return JsonSchema(_schema_text(args.schema))
    if args.regex:
        return Regex(args.regex)
    if args.grammar:
        return CFG(_read_user_file("--grammar", args.grammar, "an EBNF/GBNF or Lark grammar file"))
    if args.choice:
        return Choice(args.choice)
    return str


def _schema_text(value: str) -> str:
    """--schema's JSON Schema text: the file it names, else the value itself as inline JSON."""
    from structgen.errors import InvalidParameterError

    path = Path(value).expanduser()
    if path.exists():
        return _read_user_file("--schema", value, "a JSON Schema file or inline JSON")
    if _looks_like_path(value):  # a mistyped file name would otherwise fail as "not JSON"
        raise InvalidParameterError(f"--schema {value}: no such file; pass an existing JSON Schema file or inline JSON")
    return value


def _looks_like_path(value: str) -> bool:
    """A value that is no inline JSON (no object or array) but names a .json file or a folder."""
    text = value.strip()
    if text.startswith(("{", "[")):
        return False
    return text.endswith(".json") or os.sep in text or "/" in text


def _read_user_file(flag: str, value: str, what: str) -> str:
    """The text of a file the user named, an unreadable one an `InvalidParameterError`."""
    from structgen.errors import InvalidParameterError

    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise InvalidParameterError(f"{flag} {value}: no such file; pass the path of {what}") from e
    except IsADirectoryError as e:
        raise InvalidParameterError(f"{flag} {value} is a directory; pass the path of {what}") from e
    except OSError as e:
        raise InvalidParameterError(f"cannot read {flag} {value}: {e.strerror}; pass a readable file") from e
    except UnicodeDecodeError as e:
        raise InvalidParameterError(f"{flag} {value} is not UTF-8 text; pass {what}") from e


# (flag, attribute, smallest value accepted) of the numeric serve flags: below it a server starts but answers nothing useful
_SERVE_MINIMUMS: list[tuple[str, str, int]] = [
    ("--default-max-tokens", "default_max_tokens", 1),
    ("--max-body-bytes", "max_body_bytes", 1),
    ("--max-generations-per-request", "max_generations_per_request", 1),
    ("--max-waiting", "max_waiting", 1),
    ("--max-constraint-bytes", "max_constraint_bytes", 1),
    ("--max-constraint-depth", "max_constraint_depth", 1),
    ("--max-enum-values", "max_enum_values", 1),
    ("--max-client-errors", "max_client_errors", 0),
    ("--data-parallel", "data_parallel", 1),
    ("--front-processes", "front_processes", 0),
]


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse numeric flags out of range before the (slow) model load, naming the flag."""
    from structgen.errors import InvalidParameterError

    checks = [("--tensor-parallel", "tensor_parallel", 1)]
    if args.command == "serve":
        checks += _SERVE_MINIMUMS
        if not 0 <= args.port <= 65535:
            raise InvalidParameterError(f"--port {args.port} is out of range; pass 0-65535 (0: any free port)")
        if not args.host.strip():
            raise InvalidParameterError("--host is empty; pass an address such as 127.0.0.1 or 0.0.0.0")
        if not args.compile_timeout > 0:
            raise InvalidParameterError(f"--compile-timeout {args.compile_timeout} must be a positive number of seconds")
    elif args.max_tokens < 1:
        raise InvalidParameterError(f"--max-tokens {args.max_tokens} must be at least 1")
    for flag, attr, least in checks:
        if getattr(args, attr) < least:
            raise InvalidParameterError(f"{flag} {getattr(args, attr)} must be at least {least}")
    if args.command == "serve":
        for flag, attr, most in (("--max-constraint-bytes", "max_constraint_bytes", BUILD_LIMITS.max_source_bytes),
                                 ("--max-constraint-depth", "max_constraint_depth", BUILD_LIMITS.max_depth)):
            if getattr(args, attr) > most:
                raise InvalidParameterError(f"{flag} {getattr(args, attr)} is over the most structgen takes, {most:,} "
                                            "(deeper or larger constraints are refused whatever the limit)")


def _check_address(host: str, port: int) -> None:
    """Bind `host`:`port` once and let go, so that an unknown host or a port in use is reported
    before the model loads rather than by uvicorn after it."""
    from structgen.errors import InvalidParameterError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidParameterError(f"--host {host} is not an address or a name this machine resolves; "
                                    "pass e.g. 127.0.0.1 or 0.0.0.0") from e
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                raise InvalidParameterError(_bind_error(host, port, e)) from e


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is already in use; stop the other server or pass another --port"
    if e.errno == errno.EACCES:
        return f"no permission to bind port {port} on {host}; pass a --port above 1023"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine; pass one of its addresses or 0.0.0.0"
    return f"cannot bind {host}:{port}: {e.strerror}; pass another --host or --port"


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
    out = ["--backend", args.backend, "--max-seq-len", str(args.max_seq_len), "--tensor-parallel", str(args.tensor_parallel),
           "--default-max-tokens", str(args.default_max_tokens), "--max-body-bytes", str(args.max_body_bytes),
           "--max-generations-per-request", str(args.max_generations_per_request),
           "--max-waiting", str(args.max_waiting), "--max-constraint-bytes", str(args.max_constraint_bytes),
           "--max-constraint-depth", str(args.max_constraint_depth), "--max-enum-values", str(args.max_enum_values),
           "--compile-timeout", str(args.compile_timeout),
           "--max-client-errors", "0", "--allowed-hosts", "*", "--log-level", args.log_level,
           "--front-processes", str(args.front_processes)]
    for flag, value in (("--model", args.model), ("--device", args.device), ("--dtype", args.dtype),
                        ("--max-batch-size", args.max_batch_size), ("--served-model-name", args.served_model_name)):
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
        return _run(args)
    except StructgenError as e:
        print(f"structgen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the `with`/`finally` blocks already aborted the work
        print("structgen: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    _check_flags(args)
    config = _engine_config(args)  # invalid engine settings fail here, before the model loads
    if _is_torchrun_worker(args):
        from structgen.engine.parallel import run_worker

        run_worker(args.model, config)  # rank 0 runs the command itself
        return 0
    if args.command == "serve":
        _serve(args, config)
        return 0
    output_type = _output_type(args)  # a missing schema or grammar file fails before the model loads
    from structgen.api import LLM

    with LLM(args.model, backend=args.backend, config=config) as llm:  # stops worker ranks
        c = llm.complete(output_type, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature)
    print(c.text if isinstance(c.value, str) else json.dumps(c.value, default=str))
    return 0


def _serve(args: argparse.Namespace, config: EngineConfig) -> None:
    api_key = _api_key(args)
    _check_address(args.host, args.port)
    if args.port == 0:  # chosen now: the default Host checks and the replicas need the port clients use
        from structgen_server.process import free_port

        args.port = free_port(args.host)
        print(f"structgen serve: port 0 picked port {args.port}", file=sys.stderr)
    if args.data_parallel > 1:
        _serve_replicas(args)
        return
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
        config=config,
        default_max_tokens=args.default_max_tokens,
        api_key=api_key,
        allowed_hosts=args.allowed_hosts.split(",") if args.allowed_hosts else None,
        max_body_bytes=args.max_body_bytes,
        max_generations=args.max_generations_per_request,
        max_client_errors=args.max_client_errors,
        log_level=args.log_level,
        front_processes=args.front_processes,
        limits=ConstraintLimits(args.max_constraint_bytes, args.max_constraint_depth, args.max_enum_values),
        compile_timeout=args.compile_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
