"""A front process of `structgen serve --front-processes N` (fronts.py starts it): the whole
HTTP server over an `EngineClient`, accepting on the listening socket it inherits; its settings
come on stdin (so the API key stays out of `ps`). It drains on SIGTERM as the single server
does, and stops when its engine process goes away."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys

from structgen_server.app import create_app, server_config
from structgen_server.draining import draining_server
from structgen_server.engine_client import EngineClient, EngineFacts
from structgen_server.process import exit_with_parent


def front_main() -> None:
    """A front process: the settings come on stdin; the listening socket is inherited."""
    settings = json.loads(sys.stdin.read())
    logging.basicConfig(level=settings["log_level"].upper(),
                        format="%(asctime)s %(levelname)s %(name)s[front %(process)d]: %(message)s")
    exit_with_parent(settings["parent_pid"])
    options = settings["app"]
    if options.get("allowed_hosts") is not None:
        options["allowed_hosts"] = frozenset(options["allowed_hosts"])
    client = EngineClient(settings["socket"], EngineFacts(**settings["facts"]),
                          on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))
    app = create_app(client, **options)
    server = draining_server(server_config(app, log_level=settings["log_level"]), app.state.server.mark_stopping)
    try:
        server.run(sockets=[socket.socket(fileno=settings["fd"])])
    finally:
        client.close()


if __name__ == "__main__":
    front_main()
