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


def test_paired_bursts_alternate_their_order_and_report_the_medians_and_their_ratio(monkeypatch) -> None:
    """`--paired A,B`: a cold burst of each, then warm bursts A B, B A, A B ...; each workload's
    row holds the median of its warm bursts, A's the ratio of the TTFT medians and each
    round's ratio."""
    import argparse

    from benchmarks import bench_serving
    from benchmarks.bench_serving import Outcome, Results, RunResult, ServingRequest, run_paired

    order: list[str] = []
    ttft = {"agent": iter([0.300, 0.120, 0.100, 0.140, 0.110]), "short": iter([0.090, 0.050, 0.060, 0.070, 0.040])}

    async def fake_drive(run, requests, rate, timeout_s):
        name = requests[0].messages[0]["content"]
        order.append(name)
        t = next(ttft[name])
        return RunResult([Outcome(latency_s=t + 0.2, ttft_s=t, output_tokens=21)] * 2, wall_s=1.0)

    monkeypatch.setattr(bench_serving, "drive", fake_drive)
    monkeypatch.setattr(bench_serving, "inprocess_runner", lambda llm, max_tokens: None)
    requests = {name: [ServingRequest([{"role": "user", "content": name}], {})] for name in ("agent", "short")}
    results = Results({}, write=False)
    args = argparse.Namespace(max_tokens=16, timeout=60.0)
    run_paired(None, requests, 4, args, None, results)
    assert order == ["agent", "short", "agent", "short", "short", "agent", "agent", "short", "short", "agent"]
    cold_a, cold_b, a, b = results.rows
    assert (cold_a["burst"], cold_a["ttft_p50_ms"], cold_b["ttft_p50_ms"]) == ("cold", 300.0, 90.0)
    assert a["burst"] == "median of 4 warm" and a["bursts_ttft_p50_ms"] == [120.0, 100.0, 140.0, 110.0]
    assert (a["ttft_p50_ms"], b["ttft_p50_ms"], a["requests"], a["output_tokens"]) == (115.0, 55.0, 8, 168)
    assert a["ttft_p50_ratio"] == round(115 / 55, 3)
    assert a["rounds_ttft_p50_ratio"] == [round(x / y, 3) for x, y in ((120, 50), (100, 60), (140, 70), (110, 40))]


def test_a_third_paired_workload_gets_its_own_row_and_share_of_the_bound(monkeypatch) -> None:
    """`--paired agent,short,one`: every workload's bursts alternate in order and reverse; the
    third has its own medians, and only the first a ratio (to the second). The bound is
    measured before the cold bursts and after each round, and the warm rows' share is of the
    rounds' median bound. The host's speed is timed just before each warm burst and each
    round's bound, and reported beside them."""
    import argparse

    from benchmarks import bench_serving
    from benchmarks.bench_serving import Outcome, Results, RunResult, ServingRequest, run_paired

    order: list[str] = []
    ttft = {"agent": 0.100, "short": 0.050, "one": 0.070}

    async def fake_drive(run, requests, rate, timeout_s):
        name = requests[0].messages[0]["content"]
        order.append(name)
        return RunResult([Outcome(latency_s=ttft[name] + 0.2, ttft_s=ttft[name], output_tokens=50)] * 4, wall_s=0.5)

    monkeypatch.setattr(bench_serving, "drive", fake_drive)
    monkeypatch.setattr(bench_serving, "inprocess_runner", lambda llm, max_tokens: None)
    requests = {name: [ServingRequest([{"role": "user", "content": name}], {})] for name in ("agent", "short", "one")}
    results = Results({}, write=False)
    bounds = iter([1000.0, 800.0, 1000.0])

    def bound() -> float:
        order.append("bound")
        return next(bounds)

    speeds = iter([30.0, 31.0, 32.0, 50.0, 33.0, 34.0, 35.0, 60.0])

    def host_speed_ms() -> float:
        order.append("speed")
        return next(speeds)

    monkeypatch.setattr(bench_serving, "host_speed_ms", host_speed_ms)
    run_paired(None, requests, 2, argparse.Namespace(max_tokens=16, timeout=60.0), bound, results)
    assert [x for x in order if x != "speed"] == ["bound", "agent", "short", "one", "agent", "short", "one", "bound",
                                                  "one", "short", "agent", "bound"]
    assert order[4:] == ["speed", "agent", "speed", "short", "speed", "one", "speed", "bound",
                         "speed", "one", "speed", "short", "speed", "agent", "speed", "bound"]
    cold = {row["workload"]: row for row in results.rows if row.get("burst") == "cold"}
    rows = {row["workload"]: row for row in results.rows if row.get("burst") != "cold"}
    assert cold["one"]["share_of_bound"] == 0.4  # 400 tok/s of the first bound
    assert rows["agent"]["ttft_p50_ratio"] == 2.0 and "ttft_p50_ratio" not in rows["one"]
    assert (rows["one"]["ttft_p50_ms"], rows["one"]["tok_per_s"]) == (70.0, 400.0)
    assert rows["one"]["rounds_decode_bound_tok_per_s"] == [800.0, 1000.0]
    assert (rows["one"]["decode_bound_tok_per_s"], rows["one"]["share_of_bound"]) == (900.0, 0.444)
    assert rows["one"]["bursts_host_speed_ms"] == [32.0, 33.0] and rows["one"]["host_speed_ms"] == 32.5
    assert rows["agent"]["bursts_host_speed_ms"] == [30.0, 35.0]
    assert rows["agent"]["rounds_bound_host_speed_ms"] == [50.0, 60.0]


def test_host_speed_is_the_time_of_a_fixed_loop() -> None:
    from benchmarks.common import host_speed_ms

    short, long = host_speed_ms(20_000), host_speed_ms(400_000)
    assert 0 < short < long


def test_tuning_values_are_parsed_by_their_form() -> None:
    from benchmarks.bench_serving import _tuning_value

    assert _tuning_value("grammar_threads=4") == ("grammar_threads", 4)
    assert _tuning_value("cuda_graph_batch_sizes=1,2,4") == ("cuda_graph_batch_sizes", (1, 2, 4))
    assert _tuning_value("cascade_attention=false") == ("cascade_attention", False)
    assert _tuning_value("mask_prefetch=on") == ("mask_prefetch", "on")


def test_paired_needs_two_known_workloads(capsys) -> None:
    import sys

    import pytest

    from benchmarks import bench_serving

    for bad in ("agent", "agent,nope"):
        sys.argv = ["bench_serving", "--paired", bad]
        with pytest.raises(SystemExit):
            bench_serving._parse_args()
        assert "--paired" in capsys.readouterr().err


def test_the_step_timeline_records_each_step_and_groups_the_burst_by_requests() -> None:
    """StepTimeline wraps an engine's step and schedule: each step's requests, rows and prompt
    tokens (a request counted as in its prompt while the step ran part of it), grouped by
    request count after the prompt steps; `close` puts the engine's own methods back."""
    import types

    from benchmarks.step_timeline import StepTimeline

    class Req:
        def __init__(self, num_prompt: int, num_cached: int):
            self.num_prompt, self.num_cached = num_prompt, num_cached

    plan = [[(Req(10, 10), 10), (Req(10, 4), 4)],  # one prompt done this step, one half-way
            [(Req(10, 11), 1)] * 20, [(Req(10, 12), 1)] * 3, [(Req(10, 13), 1)] * 3]

    class Scheduler:
        def schedule(self, token_budget=None):
            return plan.pop(0)

    class Engine:
        def __init__(self):
            self.scheduler = Scheduler()
            self.runner = types.SimpleNamespace(graphs=None)

        def step(self):
            return self.scheduler.schedule(token_budget=None)

    engine = Engine()
    timeline = StepTimeline(engine)
    for _ in range(4):
        engine.step()
    assert [(s.requests, s.rows, s.prompt_tokens, s.ahead) for s in timeline.steps] == [
        (2, 14, 14, False), (20, 20, 0, False), (3, 3, 0, False), (3, 3, 0, False)]
    summary = timeline.summary()
    assert (summary["steps"], summary["prompt_steps"]) == (4, 1) and summary["first_step_ms"] >= 0
    assert summary["<=4"]["steps"] == 2 and summary["<=64"]["steps"] == 1 and "<=16" not in summary
    timeline.close()
    assert engine.step.__func__ is Engine.step and engine.scheduler.schedule.__func__ is Scheduler.schedule
    timeline.reset()
    assert timeline.summary()["steps"] == 0


def test_server_cpu_counts_the_main_thread_the_process_and_its_children_apart() -> None:
    import os
    import subprocess
    import sys
    import threading
    import time

    import pytest

    from benchmarks.bench_serving import ServerCpu

    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        pytest.skip("this kernel has no /proc/PID/task/TID/children")

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    cpu = ServerCpu(os.getpid())
    before = cpu.seconds()
    burn(0.3)  # this (main) thread: the loop's share
    worker = threading.Thread(target=burn, args=(0.3,))
    worker.start()
    worker.join()
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.4\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while cpu.seconds()["fronts"] - before["fronts"] < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        spent = cpu.spent_since(before, wall_s=1.0)
    finally:
        child.kill()
        child.wait()
    assert 0.25 <= spent["server_loop_cpu_s"] < spent["server_cpu_s"]  # the worker thread counts for the process only
    assert spent["server_cpu_s"] >= 0.55
    assert spent["fronts_cpu_s"] >= 0.4
