"""bench_serving's HTTP driver against the real server: the requests spread over several
client processes come back as the same per-request outcomes as from one process."""

from __future__ import annotations

from benchmarks.bench_serving import arrival_delays, http_drive, json_one_workload, summarize

MODEL = "SmolLM2-135M-Instruct"


def test_client_processes_return_the_outcomes_of_one_process_in_request_order(server_url: str) -> None:
    requests = json_one_workload(6)
    one = http_drive(server_url, MODEL, requests, None, 48, 300.0, processes=1)
    three = http_drive(server_url, MODEL, requests, None, 48, 300.0, processes=3)
    assert [o.error for o in three.outcomes] == [""] * len(requests)
    assert [o.text for o in three.outcomes] == [o.text for o in one.outcomes]
    assert [o.valid for o in three.outcomes] == [o.valid for o in one.outcomes]
    assert summarize(three)["valid"] == summarize(one)["valid"] > 0
    assert three.client_cpu_s is not None and three.client_cpu_s > 0


def test_poisson_arrivals_keep_their_times_when_spread_over_processes(server_url: str) -> None:
    requests = json_one_workload(4)
    res = http_drive(server_url, MODEL, requests, 20.0, 8, 300.0, processes=2)
    assert not any(o.error for o in res.outcomes)
    assert res.wall_s >= arrival_delays(len(requests), 20.0)[-1]


def test_arrival_delays_are_all_zero_for_a_burst_and_increasing_for_a_rate() -> None:
    assert arrival_delays(3, None) == [0.0, 0.0, 0.0]
    delays = arrival_delays(5, 10.0)
    assert delays[0] == 0.0 and delays == sorted(delays) and delays[-1] > 0
