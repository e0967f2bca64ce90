"""The HTTP front in processes of its own: `structgen serve --front-processes N`.

This process loads the model and becomes the engine process: it binds the listening socket,
starts N front processes (front_main.py) that accept on that one socket
and run the whole HTTP server (create_app over an `EngineClient`), and answers their calls
(engine_host.py). Parsing, checking and formatting requests and their stream events then
never hold the GIL of the engine thread (docs/performance.md, "The HTTP front in processes of
its own").

It stops as the single server does (draining.py): a stop signal is passed to every front, which
drains; once they have exited the engine is closed. A front that dies is started again (a few
times a minute at most); one whose engine process dies stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from typing import Any

from structgen.errors import StructgenError
from structgen_server.draining import DRAIN_S
from structgen_server.engine_client import EngineFacts
from structgen_server.engine_host import EngineHost
from structgen_server.engine_link import private_socket_path
from structgen_server.metrics import Metrics

log = logging.getLogger("structgen.server")

RESTARTS_PER_MINUTE = 5  # a front failing more often than this stops the server
STOP_WAIT_S = DRAIN_S + 5.0  # the fronts' drain, uvicorn's own grace, and their exit


def serve_with_fronts(llm: Any, count: int, host: str, port: int, app_options: dict[str, Any],
                      log_level: str = "info") -> int | None:
    """Serve `llm` through `count` front processes on `host:port` until a stop signal; return
    that signal. `app_options` are `create_app`'s keyword arguments."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=4096)
    listener.set_inheritable(True)
    path = private_socket_path()
    settings = {
        "socket": path, "fd": listener.fileno(), "parent_pid": os.getpid(), "log_level": log_level,
        "facts": dataclasses.asdict(EngineFacts.of(llm)), "app": _portable(app_options),
    }  # fmt: skip
    try:
        bound = listener.getsockname()  # the port chosen where `port` is 0
        log.info("serving http://%s:%d with %d front processes", host if ":" not in host else f"[{host}]", bound[1],
                 count)
        return asyncio.run(_serve(llm, count, settings, app_options.get("served_model_name")))
    finally:
        listener.close()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


async def _serve(llm: Any, count: int, settings: dict[str, Any], served_name: str | None) -> int | None:
    host = EngineHost(llm, Metrics(served_name or llm.model_name))
    await host.start(settings["socket"])
    fronts = FrontSet(settings, count)
    stop_signal: list[int] = []
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop_signal, stopping, fronts)
    try:
        await fronts.start()
        log.info("front processes started (pids %s)", ", ".join(map(str, fronts.pids())))
        await fronts.keep_running(stopping)
    finally:
        await fronts.stop()
        await host.close()
    return stop_signal[0] if stop_signal else None


def _on_signal(sig: int, received: list[int], stopping: asyncio.Event, fronts: FrontSet) -> None:
    """Pass the signal on (the fronts drain; a second one stops them without waiting)."""
    received.append(sig)
    stopping.set()
    fronts.signal(signal.SIGTERM)


class FrontSet:
    """The front processes, started again when one dies unasked."""

    def __init__(self, settings: dict[str, Any], count: int):
        self.settings = settings
        self.count = count
        self.processes: list[asyncio.subprocess.Process] = []
        self.restarts: list[float] = []
        self.stopping = False  # a signal went to the fronts

    async def start(self) -> None:
        self.processes = [await self._spawn() for _ in range(self.count)]

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    async def _spawn(self) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "structgen_server.front_main", stdin=asyncio.subprocess.PIPE,
            pass_fds=(self.settings["fd"],), start_new_session=True)  # signals reach it from us alone
        assert process.stdin is not None
        process.stdin.write(json.dumps(self.settings).encode())  # the API key stays out of `ps`
        await process.stdin.drain()
        process.stdin.close()
        return process

    async def keep_running(self, stopping: asyncio.Event) -> None:
        """Until `stopping`: start a front again when one exits; raise when they keep dying."""
        stop = asyncio.ensure_future(stopping.wait())
        try:
            while not stopping.is_set():
                exits = {asyncio.ensure_future(p.wait()): i for i, p in enumerate(self.processes)}
                done, _ = await asyncio.wait({stop, *exits}, return_when=asyncio.FIRST_COMPLETED)
                for task in exits:
                    task.cancel()
                for task in done - {stop}:
                    if not stopping.is_set():
                        await self._restart(exits[task])
        finally:
            stop.cancel()

    async def _restart(self, index: int) -> None:
        old = self.processes[index]
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < 60] + [now]
        if len(self.restarts) > RESTARTS_PER_MINUTE:
            raise StructgenError(f"front processes exited {len(self.restarts)} times within a minute (the last "
                                 f"with code {old.returncode}); the server stops: see the log above")
        log.error("front process %d exited with code %s; starting another", old.pid, old.returncode)
        self.processes[index] = await self._spawn()

    def signal(self, sig: int) -> None:
        self.stopping = True
        for p in self.processes:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)

    async def stop(self) -> None:
        """SIGTERM (they drain) unless a stop signal was passed on already (a second one would
        cut their drain short), then SIGKILL what is left after `STOP_WAIT_S`."""
        if not self.stopping:
            self.signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(p.wait()) for p in self.processes]
        if waits:
            _, late = await asyncio.wait(waits, timeout=STOP_WAIT_S)
            if late:
                self.signal(signal.SIGKILL)
                await asyncio.gather(*waits, return_exceptions=True)


def _portable(app_options: dict[str, Any]) -> dict[str, Any]:
    """`create_app`'s options as JSON (a frozenset of hosts as a list)."""
    hosts = app_options.get("allowed_hosts")
    return {**app_options, "allowed_hosts": None if hosts is None else sorted(hosts)}
