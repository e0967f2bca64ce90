"""`ClientThrottle`: what it counts, when it refuses, and that its memory is bounded."""

from __future__ import annotations

import pytest

from structgen_server.throttle import ClientThrottle, client_key


def test_refuses_after_max_errors_within_the_window_and_forgives_after_it() -> None:
    throttle = ClientThrottle(max_errors=3, window_s=10.0)
    for t in (0.0, 1.0, 2.0):
        assert throttle.refusal("a", now=t) is None
        throttle.record("a", 400, now=t)
    refusal = throttle.refusal("a", now=3.0)
    assert refusal is not None and refusal.status == 429
    assert refusal.headers == {"retry-after": "7"}  # the oldest error leaves the window at 10 s
    assert throttle.refusal("b", now=3.0) is None  # other clients are not touched
    assert throttle.refusal("a", now=10.5) is None  # one error left the window


def test_only_client_errors_count() -> None:
    throttle = ClientThrottle(max_errors=2, window_s=10.0)
    for status in (200, 404, 429, 499 + 1, 503):
        throttle.record("a", status, now=0.0)
    assert throttle.refusal("a", now=0.0) is None
    throttle.record("a", 413, now=0.0)
    throttle.record("a", 401, now=0.0)
    assert throttle.refusal("a", now=0.0) is not None


def test_memory_is_bounded_by_clients_and_errors() -> None:
    throttle = ClientThrottle(max_errors=4, window_s=10.0, max_clients=100)
    for i in range(1_000):
        throttle.record(f"10.0.{i // 256}.{i % 256}", 400, now=0.0)
    assert len(throttle.clients) == 100
    for _ in range(1_000):
        throttle.record("a", 400, now=1.0)
    assert len(throttle.clients["a"].errors) == 4


def test_a_zero_limit_turns_it_off() -> None:
    assert not ClientThrottle(max_errors=0).enabled


@pytest.mark.parametrize(("address", "key"), [
    ("203.0.113.7", "203.0.113.7"),
    ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),  # the same host's other address: the same client
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("::ffff:10.0.0.1", "10.0.0.1"),  # an IPv4 client on a dual-stack socket
    ("testclient", "testclient"),
])  # fmt: skip
def test_a_client_is_its_ipv4_address_or_its_ipv6_64(address: str, key: str) -> None:
    """Per-client limits (this throttle, fair admission and compiles) key an IPv6 client by its
    /64: a host is commonly given a whole /64, so rotating addresses must not make it many clients."""
    assert client_key(address) == key
