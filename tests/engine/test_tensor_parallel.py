"""Tensor parallelism (engine/parallel.py, models/sharding.py): a model split over two ranks
generates what one process generates, under the grammar and jump-forward, and its worker
rank is stopped on close. On the CPU the ranks are two processes meeting over gloo; the
`gpu` test runs NCCL and the decode graphs on two GPUs.

The default model's 9 heads / 3 KV heads do not split in two, so these tests use the tiny
random-weight Llama of conftest (`tiny_llama_dir`: 4 heads, 2 KV heads)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

from structgen import LLM
from structgen.engine.config import EngineConfig
from structgen.engine.engine import Engine
from structgen.engine.models.loader import load_model_config
from structgen.errors import EngineError, InvalidParameterError, StructgenError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Invoice number"]


class Reading(BaseModel):
    sensor: str
    ok: bool
    value: int


def _config(tensor_parallel: int) -> EngineConfig:
    return EngineConfig(tensor_parallel=tensor_parallel, max_batch_size=4, max_seq_len=256)


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir: Path):
    with LLM(tiny_llama_dir, config=_config(1)) as llm:
        yield llm


@pytest.fixture(scope="module")
def two_ranks(tiny_llama_dir: Path):
    """The module's one tensor-parallel LLM (spawning a rank costs seconds on two cores); the
    last test of the module closes it."""
    llm = LLM(tiny_llama_dir, config=_config(2))
    yield llm
    llm.close()


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_process_starts(model_dir):
    with pytest.raises(InvalidParameterError, match=r"does not divide the model's 9 attention heads.*1, 3"):
        Engine(load_model_config(model_dir), EngineConfig(tensor_parallel=2), model_dir)


def test_the_output_projection_bias_is_added_once_over_the_ranks():
    """o_proj is row-parallel: each rank's output is a partial sum, and the all-reduce adds
    them, so rank 0 alone holds the bias (Llama's `attention_bias`) and the sum equals the
    whole projection."""
    from structgen.engine.models.sharding import WeightShard

    torch.manual_seed(0)
    w, b, x = torch.randn(8, 6), torch.randn(8), torch.randn(3, 6)
    name = "model.layers.0.self_attn.o_proj."
    total = torch.zeros(3, 8)
    for rank in range(2):
        shard = WeightShard(rank, 2)
        w_r, b_r = shard(name + "weight", w), shard(name + "bias", b)
        assert torch.equal(b_r, b if rank == 0 else torch.zeros(8))
        total += torch.nn.functional.linear(x[:, rank * 3:(rank + 1) * 3], w_r, b_r)
    torch.testing.assert_close(total, torch.nn.functional.linear(x, w, b))


def test_each_rank_holds_its_share_of_the_heads_and_vocabulary(two_ranks):
    runner = two_ranks.engine.runner
    assert runner.rank_config.num_attention_heads == 2 and runner.rank_config.num_key_value_heads == 1
    assert runner.kv.k[0].shape[2] == 1  # this rank's KV heads only
    assert runner.model.lm_head.weight.shape[0] == 49152 // 2


def test_greedy_text_under_two_ranks_equals_one_process(one_process, two_ranks):
    one = [one_process.complete(str, p, max_tokens=12, chat=False).token_ids for p in PROMPTS]
    two = [two_ranks.complete(str, p, max_tokens=12, chat=False).token_ids for p in PROMPTS]
    assert two == one


def test_typed_generation_under_two_ranks_is_valid_and_jumps_forward_as_one_process(one_process, two_ranks):
    prompt = "Report the reading of sensor A as JSON."
    one = one_process.complete(Reading, prompt, max_tokens=40)
    two = two_ranks.complete(Reading, prompt, max_tokens=40)
    assert isinstance(two.value, Reading)
    assert two.stats.forced_tokens > 0  # the keys came from jump-forward, not the model
    assert (two.text, two.stats.forced_tokens) == (one.text, one.stats.forced_tokens)


def test_a_batch_of_requests_under_two_ranks_matches_one_process(one_process, two_ranks):
    one = [c.token_ids for c in one_process.complete_batch(str, PROMPTS, max_tokens=8, chat=False)]
    two = [c.token_ids for c in two_ranks.complete_batch(str, PROMPTS, max_tokens=8, chat=False)]
    assert two == one


def test_a_second_split_engine_in_the_same_process_is_refused(two_ranks, tiny_llama_dir):
    with pytest.raises(EngineError, match="close that LLM first"):
        Engine(load_model_config(tiny_llama_dir), _config(2), tiny_llama_dir)


def test_close_stops_the_worker_rank(two_ranks):
    workers = two_ranks.engine.tensor_parallel.workers.processes
    two_ranks.close()
    assert [p.exitcode for p in workers] == [0]  # it left its loop on the stop, not by a signal


def test_a_dead_worker_fails_requests_with_an_engine_error_instead_of_hanging(tiny_llama_dir):
    with LLM(tiny_llama_dir, config=_config(2)) as llm:
        worker = llm.engine.tensor_parallel.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="worker rank 1 exited"):
            llm.generate(str, "hello", max_tokens=4, chat=False)
        assert time.monotonic() - t0 < 30
    assert not worker.is_alive()


def test_closing_mid_stream_stops_the_worker_within_seconds(tiny_llama_dir, two_ranks):
    two_ranks.close()  # one split engine per process at a time
    llm = LLM(tiny_llama_dir, config=_config(2))
    worker = llm.engine.tensor_parallel.workers.processes[0]
    stream = llm.stream(str, "Count to a hundred:", max_tokens=200, chat=False)
    next(stream), next(stream)
    t0 = time.monotonic()
    llm.close()
    assert time.monotonic() - t0 < 10
    assert worker.exitcode == 0  # it took the stop; nothing had to kill it
    with pytest.raises(StructgenError):
        list(stream)  # the stream ends: its request was aborted by the close


def test_closing_after_a_worker_died_returns_within_seconds_and_frees_the_group(tiny_llama_dir, two_ranks):
    two_ranks.close()
    llm = LLM(tiny_llama_dir, config=_config(2))
    worker = llm.engine.tensor_parallel.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    t0 = time.monotonic()
    llm.close()
    assert time.monotonic() - t0 < 5
    assert not torch.distributed.is_initialized()  # a new split engine may start in this process



def test_a_slow_teardown_goes_on_in_the_background_and_holds_off_the_next_split_engine(tiny_llama_dir, two_ranks, monkeypatch):
    # NCCL's teardown can take a minute after graph capture; here gloo's waits for an event.
    from structgen.engine import parallel

    two_ranks.close()
    llm = LLM(tiny_llama_dir, config=_config(2))
    release = threading.Event()
    destroy = torch.distributed.destroy_process_group
    monkeypatch.setattr(parallel, "LEAVE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda *args, **kwargs: release.wait())
    t0 = time.monotonic()
    llm.close()
    assert time.monotonic() - t0 < 5
    try:
        with pytest.raises(EngineError, match="still leaving"):
            Engine(load_model_config(tiny_llama_dir), _config(2), tiny_llama_dir)
    finally:
        release.set()
        parallel._pending_teardown.join(5)
        destroy()
    assert not parallel._pending_teardown.is_alive()
    assert not torch.distributed.is_initialized()
    parallel._finish_teardown_at_exit()  # nothing left to wait for: returns at once


def test_leaving_releases_the_graphs_before_the_process_groups(tiny_llama_dir, two_ranks, monkeypatch):
    # NCCL (2.26 on) frees no communicator while a CUDA graph that captured one of its
    # collectives lives: a teardown before the release never returns.
    two_ranks.close()
    llm = LLM(tiny_llama_dir, config=_config(2))
    events: list[str] = []

    class Graphs:
        def release_graphs(self) -> None:
            events.append("graphs released")

    destroy = torch.distributed.destroy_process_group
    llm.engine.tensor_parallel.graph_holders.append(Graphs())
    monkeypatch.setattr(torch.distributed, "destroy_process_group",
                        lambda *args, **kwargs: (events.append("groups left"), destroy())[-1])
    llm.close()
    assert events == ["graphs released", "groups left"]
    assert not llm.engine.tensor_parallel.graph_holders


def test_a_script_without_a_main_guard_is_told_to_add_one(tiny_llama_dir, tmp_path):
    """Each worker rank is a spawned process that imports the script; a script that builds
    its split engine as it is imported would start one in every worker."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("from structgen import LLM\n"
                      "from structgen.engine.config import EngineConfig\n"
                      f"llm = LLM({str(tiny_llama_dir)!r}, config=EngineConfig(tensor_parallel=2, max_seq_len=64))\n"
                      "llm.close()\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr and "worker" in done.stderr

# Both ranks build the decode graphs' step functions (uncaptured, so they run on the CPU under
# TRITON_INTERPRET=1): rank 0 announces each graph forward, and each forward takes rank 0's rows.
GRAPH_STEPS_SCRIPT = """
import os, sys
from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import Request
from structgen.sampling import SamplingParams
model_dir = sys.argv[1]
config = EngineConfig(tensor_parallel=int(os.environ.get("WORLD_SIZE", "1")), max_batch_size=4, max_seq_len=128,
                      tuning=EngineTuning(prefill_in_graphs=False, cuda_graph_batch_sizes=(1, 2, 4)))
if int(os.environ.get("RANK", "0")) > 0:
    from structgen.engine.model_runner import ModelRunner
    from structgen.engine.parallel import Rendezvous, TensorParallel, rank_device
    rendezvous = Rendezvous.from_torchrun()
    tp = TensorParallel(rendezvous, rank_device(config, rendezvous.local_rank))
    runner = ModelRunner(load_model_config(model_dir), config, model_dir, tensor_parallel=tp)
    runner.capture_decode_graphs(capture=False)
    tp.serve(runner)
    tp.close()
    sys.exit(0)
from structgen.engine.engine import Engine
engine = Engine(load_model_config(model_dir), config, model_dir)
engine.runner.capture_decode_graphs(capture=False)
reqs = [Request([1, 2, 3, 4 + i], SamplingParams(max_tokens=6)) for i in range(3)]
engine.run(reqs)
print("GRAPH STEPS", engine.runner.graphs.steps, [r.output_ids for r in reqs])
engine.close()
"""


@pytest.mark.slow
def test_decode_graph_steps_under_torchrun_match_one_process(tiny_llama_dir, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "graph_steps.py"
    script.write_text(GRAPH_STEPS_SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    runs = [[sys.executable, str(script), str(tiny_llama_dir)],
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(script), str(tiny_llama_dir)]]
    outputs = []
    for cmd in runs:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        lines = [line for line in done.stdout.splitlines() if line.startswith("GRAPH STEPS")]
        assert done.returncode == 0 and lines, done.stderr[-3000:]
        outputs.append(lines[0])
    assert outputs[1] == outputs[0]
    assert int(outputs[0].split()[2]) >= 4  # the decoding went through the graph steps


@pytest.mark.gpu
def test_greedy_text_with_nccl_and_decode_graphs_on_two_gpus_equals_one_gpu(tiny_llama_dir):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    outputs = []
    for tp in (1, 2):
        config = EngineConfig(tensor_parallel=tp, device="cuda", dtype="float32", max_batch_size=4, max_seq_len=256)
        with LLM(tiny_llama_dir, config=config) as llm:
            assert llm.engine.runner.graphs is not None
            texts = [llm.complete(str, p, max_tokens=24, chat=False).token_ids for p in PROMPTS]
            texts += [c.token_ids for c in llm.complete_batch(str, PROMPTS, max_tokens=16, chat=False)]
            typed = llm.complete(Reading, "Report the reading of sensor A as JSON.", max_tokens=40)
            outputs.append((texts, typed.text))
    assert outputs[1] == outputs[0]



# One split engine per process, in its own process: NCCL's teardown after graph capture may
# hang, and then this process could not start the next one (parallel.py, `leave`).
PEER_SUM_SCRIPT = """
import json, sys
from structgen import LLM
from structgen.engine.config import EngineConfig, EngineTuning
if __name__ == "__main__":  # the worker rank is a spawned process, which imports this file
    config = EngineConfig(tensor_parallel=2, device="cuda", dtype="bfloat16", max_batch_size=4, max_seq_len=256,
                          tuning=EngineTuning(tensor_parallel_all_reduce=sys.argv[2]))
    prompts = json.loads(sys.argv[3])
    with LLM(sys.argv[1], config=config) as llm:
        summed_by_peers = llm.engine.tensor_parallel.peer_sum is not None
        texts = [llm.complete(str, p, max_tokens=24, chat=False).token_ids for p in prompts]
        texts += [c.token_ids for c in llm.complete_batch(str, prompts * 3, max_tokens=16, chat=False)]
    # Closing released the graphs, so NCCL's teardown ended within the bound, not at exit.
    from structgen.engine import parallel
    assert parallel._pending_teardown is None, "NCCL's teardown outlasted close"
    print("OUTPUT", json.dumps([summed_by_peers, texts]))
"""


@pytest.mark.gpu
def test_bf16_greedy_text_with_the_peer_sum_equals_nccl_on_two_gpus(tiny_llama_dir, tmp_path):
    """The peer sum (kernels/peer_sum.py) adds two ranks' parts as NCCL does and normalises as
    the norm kernel does, so bf16 greedy output is the same bits either way."""
    import json
    import subprocess
    import sys

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    script = tmp_path / "peer_sum.py"
    script.write_text(PEER_SUM_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    outputs = []
    for mode in ("nccl", "auto"):
        done = subprocess.run([sys.executable, str(script), str(tiny_llama_dir), mode, json.dumps(PROMPTS)],
                              env=env, capture_output=True, text=True, timeout=300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("OUTPUT")]
        assert done.returncode == 0 and lines, done.stderr[-3000:]
        summed_by_peers, texts = json.loads(lines[0][len("OUTPUT "):])
        assert summed_by_peers == (mode == "auto")
        outputs.append(texts)
    assert outputs[1] == outputs[0]


def test_an_llm_dropped_unclosed_stops_its_worker_rank(tiny_llama_dir, two_ranks):
    # Its ranks would otherwise hold their GPUs (and this process its split engine) until exit.
    import gc

    two_ranks.close()  # one split engine per process at a time
    for use_it in (True, False):  # the engine thread ran, or never started
        llm = LLM(tiny_llama_dir, config=_config(2))
        worker = llm.engine.tensor_parallel.workers.processes[0]
        if use_it:
            llm.generate(str, "hello", max_tokens=4, chat=False)
        del llm
        gc.collect()
        # Polled, not joined: the engine's own close joins the worker from its loop thread, and
        # a second join here could find it reaped by that one before its exit code is set.
        deadline = time.monotonic() + 20
        while worker.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.exitcode == 0, "the worker rank kept running after its LLM was dropped"
        deadline = time.monotonic() + 10
        while torch.distributed.is_initialized() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not torch.distributed.is_initialized()  # a new split engine may start in this process
