"""The OpenAI-compatible HTTP server: `create_app(llm)` returns a FastAPI app serving
`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health` and `/metrics`.

Every request runs on the LLM's shared engine loop through its async API, so concurrent HTTP
requests are batched together exactly like concurrent in-process callers; each HTTP request is
its own admission group, so the engine shares free slots fairly between requests however many
generations one asks for. A request passes the guard (guard.py: Host, API key, body size), is
read and validated (body.py: Content-Type and JSON; protocol.py: the fields), checked, bounded
and turned into jobs (planning.py: its output type from constraints.py, its prompt rendered and
tokenized off the event loop), run (serving.py) and formatted back (responses.py); any failure
becomes an OpenAI-shaped error for that request alone (errors.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from structgen.engine.request import request_client, request_group
from structgen.partial import partial_tracker
from structgen.schema.budget import DEFAULT_COMPILE_TIMEOUT_S
from structgen.schema.limits import DEFAULT_LIMITS, ConstraintLimits
from structgen_server import responses, serving
from structgen_server.body import parse_body, validation_error
from structgen_server.connection import KEEP_ALIVE_S, MAX_HEAD_BYTES, http_protocol
from structgen_server.constraints import RequestConstraint
from structgen_server.draining import draining_server, no_new_requests_error, shutting_down_error
from structgen_server.engine_client import EngineClient, MetricsRelay
from structgen_server.errors import APIError, new_request_id, to_api_error
from structgen_server.event_stream import EventStream
from structgen_server.guard import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CLIENT_ERRORS,
    GuardConfig,
    RequestGuard,
    default_allowed_hosts,
)
from structgen_server.metrics import Metrics, endpoint_label, engine_load
from structgen_server.planning import DEFAULT_MAX_GENERATIONS, ServerState, check_model, plan
from structgen_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)
from structgen_server.throttle import client_key

log = logging.getLogger("structgen.server")


def create_app(
    llm: Any,
    *,
    served_model_name: str | None = None,
    default_max_tokens: int = 1024,
    api_key: str | None = None,
    allowed_hosts: frozenset[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_generations: int = DEFAULT_MAX_GENERATIONS,
    max_client_errors: int = DEFAULT_MAX_CLIENT_ERRORS,
) -> FastAPI:
    """The FastAPI app serving `llm`. `served_model_name` is the id clients send as `model`
    (default: the LLM's own name, which is accepted too). With `api_key` every path but
    `/health` needs it; `allowed_hosts` (None: any) are the Host headers answered;
    `max_generations` caps prompts x n of one request; a client (by address) whose requests
    got `max_client_errors` 4xx answers within 10 s is answered 429 for a while (0: never)."""
    name = served_model_name or llm.model_name
    # fronts of one engine (`--front-processes`) keep their metrics together, in its process
    metrics = MetricsRelay(llm) if isinstance(llm, EngineClient) else Metrics(name)
    state = ServerState(llm, name, frozenset({name, llm.model_name}), default_max_tokens, max_generations, metrics)
    app = FastAPI(title="structgen", version="0.1.0")
    app.state.server = state
    guard = GuardConfig(api_key=api_key, allowed_hosts=allowed_hosts, max_body_bytes=max_body_bytes,
                        max_client_errors=max_client_errors)
    app.add_middleware(RequestGuard, config=guard, metrics=metrics)
    _install_error_handlers(app, state)

    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # load balancers probe with either
    async def health() -> Any:
        if state.stopping:  # a load balancer takes it out of rotation
            return JSONResponse({"status": "stopping", "model": state.model_name}, status_code=503)
        return {"status": "ok", "model": state.model_name, **(await _engine_load(state.llm))}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        if isinstance(state.llm, EngineClient):
            text = await state.llm.metrics_text()
        else:
            text = state.metrics.render(engine=engine_load(state.llm))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        check_model(state, model_id)
        return ModelCard(id=state.model_name)

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Any:
        body = parse_body(request.headers.get("content-type"), await request.body(), ChatCompletionRequest)
        return await _serve(state, "chat", body, request)

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request) -> Any:
        body = parse_body(request.headers.get("content-type"), await request.body(), CompletionRequest)
        return await _serve(state, "completions", body, request)

    _document_request_models(app, [ChatCompletionRequest, CompletionRequest])
    return app


def _request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses `model` itself (`parse_body`)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _document_request_models(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add the request models (and the models they hold) to the OpenAPI document's schemas,
    which FastAPI lists only for body parameters it parses itself."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = build()
            _, defs = models_json_schema([(m, "validation") for m in models],
                                         ref_template="#/components/schemas/{model}")
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _engine_load(llm: Any) -> dict[str, int]:
    """The engine's running and waiting requests, from its process where that is another."""
    if isinstance(llm, EngineClient):
        return await llm.engine_load()
    return engine_load(llm)


# --------------------------------------------------------------------------- handlers


async def _serve(state: ServerState, endpoint: str, body: SamplingFields, request: Request) -> Any:
    """Validate, run and format one request, recording its metrics."""
    t0 = time.perf_counter()
    state.metrics.started()
    # This request's generations share admission fairly, and with other clients' (engine/waiting.py).
    request_group.set(new_request_id())
    request_client.set(client_key(request.client.host) if request.client else None)
    status, error_type, streaming = 200, None, False
    try:
        if state.stopping:
            raise no_new_requests_error()
        jobs, rc = await plan(state, body)
        state.metrics.request_planned(time.perf_counter() - t0)
        if body.stream:
            response = await _start_stream(state, endpoint, body, jobs, rc, t0)
            streaming = True  # the stream records its own end
            return response
        gens = await serving.cancel_on_disconnect(_run_all(state.llm, jobs), request)
        for g in gens:
            state.metrics.record_generation(g.prompt_tokens, g.completion_tokens, g.stats)
        if endpoint == "chat":
            return responses.chat_response(state.model_name, rc, gens)
        return responses.completion_response(state.model_name, gens, body.n)
    except serving.ClientDisconnected:
        status, error_type = 499, "client_disconnected"
        return APIError(499, "client disconnected", code="client_disconnected").response()
    except asyncio.CancelledError:
        if not state.stopping:
            raise
        uncancel()  # answered below: the cancellation is handled, not lost
        err = shutting_down_error()
        status, error_type = err.status, err.code
        return err.response()
    except Exception as exc:
        err = to_api_error(exc)
        status, error_type = err.status, err.code or err.type
        return err.response()
    finally:
        if not streaming:
            state.metrics.finished(endpoint, status, time.perf_counter() - t0, error_type)



def stream_error_end(err: APIError) -> tuple[str, str]:
    """The events that end a stream with `err` once its headers are sent (as OpenAI does)."""
    error = {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    return responses.error_event(error), responses.sse("[DONE]")


def uncancel() -> None:
    """Clear the current task's pending cancellation once it has been answered, so that it
    does not cancel a later `asyncio.timeout` in the same task (Python 3.11+)."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


async def _run_all(llm: Any, jobs: list[serving.Job]) -> list[serving.Generation]:
    """Every choice's generation; where one fails (the request is answered with its error),
    the others are cancelled, which aborts their engine requests."""
    tasks = [asyncio.ensure_future(serving.generate(llm, j)) for j in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def _start_stream(
    state: ServerState, endpoint: str, body: SamplingFields, jobs: list[serving.Job], rc: RequestConstraint, t0: float
) -> EventStream:
    """Start one streamed generation. The first delta is awaited before the response starts,
    so errors raised while compiling or admitting the request still get a 4xx status."""
    stream = serving.GenerationStream(state.llm, jobs[0])
    deltas = stream.deltas()
    try:
        first: str | None = await deltas.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await deltas.aclose()
        raise
    if first is not None:
        state.metrics.first_text_sent(time.perf_counter() - t0)

    async def pieces() -> AsyncIterator[str]:
        if first is not None:
            yield first
        async for piece in deltas:
            yield piece

    def result() -> serving.Generation:
        assert stream.result is not None
        return stream.result

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    tracker = partial_tracker(jobs[0].output_type) if body.stream_options and body.stream_options.include_partial else None
    if endpoint == "chat":
        events = responses.chat_stream(state.model_name, rc, pieces(), result, include_usage, tracker)
    else:
        events = responses.completion_stream(state.model_name, pieces(), result, include_usage, tracker)

    async def send() -> AsyncIterator[str]:
        status, error_type = 200, None
        try:
            async for event in events:
                yield event
        except Exception as exc:  # after the headers: report in-band, as OpenAI does
            err = to_api_error(exc)
            status, error_type = err.status, err.code or err.type
            for event in stream_error_end(err):
                yield event
        except asyncio.CancelledError:
            if not state.stopping:  # cancelled: the client went away
                status, error_type = 499, "client_disconnected"
                raise
            uncancel()  # the server's graceful timeout ran out: end the stream with an error event
            err = shutting_down_error()
            status, error_type = err.status, err.code
            for event in stream_error_end(err):
                yield event
        except BaseException:
            status, error_type = 499, "client_disconnected"
            raise
        finally:
            await deltas.aclose()  # aborts the request if it is still running
            if (g := stream.result) is not None:
                state.metrics.record_generation(g.prompt_tokens, g.completion_tokens, g.stats)
            state.metrics.finished(endpoint, status, time.perf_counter() - t0, error_type)

    return EventStream(send())


# --------------------------------------------------------------------------- errors


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error leaves as OpenAI's `{"error": {...}}`, and is counted."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
        state.metrics.rejected(_endpoint(request), err.status, err.code or err.type)
        return err.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        state.metrics.rejected(_endpoint(request), exc.status, exc.code or exc.type)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        state.metrics.rejected(_endpoint(request), exc.status_code, code)
        where = f"{request.method} {request.url.path[:200]}"
        return APIError(exc.status_code, f"{exc.detail}: {where}", code=code).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        err = to_api_error(exc)  # logs it with the request id the body names
        state.metrics.rejected(_endpoint(request), err.status, err.code or err.type)
        return err.response()


def _endpoint(request: Request) -> str:
    return endpoint_label(request.url.path)


# --------------------------------------------------------------------------- running


def run_server(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    backend: str = "auto",
    config: Any = None,
    default_max_tokens: int = 1024,
    api_key: str | None = None,
    allowed_hosts: list[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_generations: int = DEFAULT_MAX_GENERATIONS,
    max_client_errors: int = DEFAULT_MAX_CLIENT_ERRORS,
    log_level: str = "info",
    front_processes: int = 0,
    limits: ConstraintLimits = DEFAULT_LIMITS,
    compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S,
) -> None:
    """Load the model, then serve it with uvicorn until interrupted. `allowed_hosts` None:
    the loopback names when bound to loopback, any Host otherwise; ["*"]: any.
    `front_processes` > 0 runs the HTTP server in that many processes of its own (fronts.py).
    `limits`, `compile_timeout`: the largest constraint a request may send (`LLM`'s)."""
    from structgen import LLM

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm = LLM(model, backend=backend, config=config, limits=limits, compile_timeout=compile_timeout)
    log.info("loaded %s in %.1fs", llm.model_name, getattr(llm, "load_time_s", 0.0))
    llm.grammars.warm_up()  # not in the first requests' compiles
    if allowed_hosts is None:
        hosts = default_allowed_hosts(host, port)
    else:
        hosts = None if "*" in allowed_hosts else frozenset(h.strip().lower() for h in allowed_hosts)
    options = {"served_model_name": served_model_name, "default_max_tokens": default_max_tokens, "api_key": api_key,
               "allowed_hosts": hosts, "max_body_bytes": max_body_bytes, "max_generations": max_generations,
               "max_client_errors": max_client_errors}  # fmt: skip
    try:
        if front_processes > 0:
            from structgen_server.fronts import serve_with_fronts

            stop_signal = serve_with_fronts(llm, front_processes, host, port, options, log_level)
        else:
            app = create_app(llm, **options)
            server = draining_server(server_config(app, host, port, log_level), app.state.server.mark_stopping)
            server.run()
            stop_signal = server.stop_signal
    finally:
        llm.close()  # also stops tensor-parallel worker ranks
    if stop_signal == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C: the command says "interrupted" and exits 130


def server_config(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> Any:
    """The uvicorn settings of `run_server` (a `uvicorn.Config`), apart so that the
    server benchmark serves with exactly them."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=http_protocol(),  # drops connections that never finish a request head
        timeout_keep_alive=KEEP_ALIVE_S,
        access_log=False,  # a line per request is noise at hundreds of requests a second
        backlog=4096,  # a burst of new connections waits in the kernel, not refused
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        timeout_graceful_shutdown=1,  # after the drain (draining.py), which waited for running requests
    )
