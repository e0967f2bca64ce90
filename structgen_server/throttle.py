"""Refusing, for a while, a client whose requests keep failing.

A refused request is cheap for the server but not free: reading, parsing and checking a bad
body costs it up to a few milliseconds of CPU, taken from the engine thread that serves
everyone else. A client (by network address) whose requests got `max_errors` 4xx answers
within `window_s` seconds is answered 429 for the rest of that window, before its body is read.
A well-behaved client never meets it; behind a reverse proxy every client has the proxy's
address, so such a deployment raises the limit or turns it off (`max_errors=0`).
"""

from __future__ import annotations

import collections
import ipaddress
import time
from dataclasses import dataclass, field

from structgen_server.errors import APIError


def client_key(address: str) -> str:
    """Whom an address is, for per-client limits and fair shares: an IPv4 address itself, an
    IPv6 address its /64 network (one host is commonly given a whole /64, so its addresses
    cost a client nothing to change)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address  # not an IP (a test client, a Unix socket): as it is
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


# Statuses that say the client sent something wrong (a 429 of ours does not count again, or a
# throttled client could never get out).
COUNTED_STATUSES = frozenset(range(400, 500)) - {404, 429}


@dataclass
class ClientRecord:
    errors: collections.deque[float] = field(default_factory=collections.deque)
    last_status: int = 0


@dataclass
class ClientThrottle:
    """Per-client counts of recent 4xx answers; `refusal` says whether to refuse the next one.
    Memory is bounded: at most `max_clients` addresses are remembered, the least recent dropped."""

    max_errors: int = 64
    window_s: float = 10.0
    max_clients: int = 10_000
    clients: collections.OrderedDict[str, ClientRecord] = field(default_factory=collections.OrderedDict)

    @property
    def enabled(self) -> bool:
        return self.max_errors > 0

    def refusal(self, client: str, now: float | None = None) -> APIError | None:
        """The 429 for `client` if its errors within the window reached `max_errors`."""
        record = self.clients.get(client)
        if record is None:
            return None
        now = time.monotonic() if now is None else now
        self._expire(record, now)
        if len(record.errors) < self.max_errors:
            return None
        retry_after = max(1, round(record.errors[0] + self.window_s - now))
        return APIError(
            429,
            f"{len(record.errors)} requests from this client failed within {self.window_s:.0f} s "
            f"(the last answered {record.last_status}); fix what the earlier errors describe and "
            f"retry after {retry_after} s",
            code="too_many_failed_requests",
            headers={"retry-after": str(retry_after)},
        )

    def record(self, client: str, status: int, now: float | None = None) -> None:
        """Count an answer sent to `client` (only statuses in COUNTED_STATUSES)."""
        if status not in COUNTED_STATUSES:
            return
        now = time.monotonic() if now is None else now
        record = self.clients.pop(client, None) or ClientRecord()
        self.clients[client] = record  # most recent last
        self._expire(record, now)
        record.errors.append(now)
        record.last_status = status
        while len(record.errors) > self.max_errors:
            record.errors.popleft()
        while len(self.clients) > self.max_clients:
            self.clients.popitem(last=False)

    def _expire(self, record: ClientRecord, now: float) -> None:
        while record.errors and record.errors[0] <= now - self.window_s:
            record.errors.popleft()
