"""Tensor parallelism across processes: the process group, the worker ranks and the step
broadcast that keeps them in step with the engine.

Rank 0 is the engine (scheduler, grammar, jump-forward, drafter, sampler): nothing of the
grammar runs anywhere else. Ranks 1..N-1 hold their shard of the model (models/sharding.py)
and only run forwards. Before each forward rank 0 announces it on a host-side gloo group: an
eager `extend` with its rows (slot, start, token ids, logits wanted), or a decode-graph replay
by bucket, whose token ids, positions and slots the graph broadcasts itself from rank 0's
device buffers (cuda_graphs.py). Every rank then runs the same forward, whose all-reduces and
logits gather meet on the device group (NCCL on CUDA, gloo on the CPU).

Ranks are processes the engine spawns (one host, `EngineConfig.tensor_parallel=N`) or that
`torchrun` launched (any hosts: the rendezvous is MASTER_ADDR:MASTER_PORT, and ranks above 0
run `run_worker`). A rank that dies makes rank 0's next announcement raise `EngineError`, so
requests fail instead of waiting on a collective that never completes. Every host-side wait
(meeting, loading, announcing, stopping) has a deadline and polls the spawned ranks' liveness,
so start-up and `close` end within seconds of a rank dying or hanging.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from structgen.engine.kernels.peer_sum import PeerSum
from structgen.engine.models.sharding import WeightShard, rank_config
from structgen.errors import EngineError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from structgen.engine.config import EngineConfig, ModelConfig
    from structgen.engine.model_runner import ExtendSeq, ModelRunner
    from structgen.engine.page_table import PageTable

log = logging.getLogger("structgen.engine")

EXTEND, GRAPH_FORWARD, STOP = 1, 2, 3  # the commands rank 0 announces
HEADER_INTS = 3  # command, then two integers whose meaning depends on it
# A device collective whose peer is gone fails after this (NCCL aborts the process).
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# The worker ranks wait for the next step for as long as the engine stays idle.
IDLE_TIMEOUT = timedelta(days=365)
# Meeting and loading: a rank reads its shard of the checkpoint from disk meanwhile.
STARTUP_TIMEOUT_S = 600.0
# An announcement is a few bytes into each worker's socket; only a stuck worker delays it.
ANNOUNCE_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 10.0
# Leaving the process groups: NCCL's teardown waits for every CUDA graph that captured one of
# its collectives to be destroyed (commDestroySync, NCCL 2.26 on), so `leave` releases the
# graphs first; the teardown still runs in a thread given this long, in case it stalls anyway.
LEAVE_TIMEOUT_S = 5.0
# At exit, a teardown still running is waited for this long: a daemon thread that returns from
# C++ while the interpreter finalizes aborts the process ("terminate called").
EXIT_WAIT_S = 60.0
POLL_S = 0.02
# all_gather_into_tensor's newer name (the old one warns from torch 2.10 on).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_pending_teardown: threading.Thread | None = None  # a `leave` that outlasted LEAVE_TIMEOUT_S


class ReleasesGraphs(Protocol):
    def release_graphs(self) -> None:
        """Destroy the CUDA graphs; nothing may replay them afterwards."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet (rank 0's address and a free port) and which rank this is."""

    address: str
    port: int
    world_size: int
    rank: int
    local_rank: int
    torchrun: bool = False  # the launcher's own store serves the rendezvous (env://)

    @property
    def init_method(self) -> str:
        return "env://" if self.torchrun else f"tcp://{self.address}:{self.port}"

    @classmethod
    def from_torchrun(cls) -> Rendezvous | None:
        """This process's place in a `torchrun` launch (None: not launched by torchrun)."""
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        return cls(env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")),
                   int(env["WORLD_SIZE"]), int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"])), torchrun=True)

    @classmethod
    def on_this_host(cls, world_size: int) -> Rendezvous:
        """Rank 0 of `world_size` processes on this host; MASTER_ADDR/MASTER_PORT if set,
        else loopback and a port the store picks (0 until then)."""
        address = os.environ.get("MASTER_ADDR", "127.0.0.1")
        return cls(address, int(os.environ.get("MASTER_PORT", "0")), world_size, 0, 0)

    def of_rank(self, rank: int) -> Rendezvous:
        return replace(self, rank=rank, local_rank=rank)

    def open_store(self) -> dist.TCPStore:
        """The key-value store the ranks meet through (rank 0 serves it; port 0 picks one)."""
        try:
            return dist.TCPStore(self.address, self.port, self.world_size, is_master=self.rank == 0,
                                 timeout=timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False)
        except (RuntimeError, ValueError) as e:
            raise EngineError(f"tensor-parallel rank {self.rank} could not reach the rendezvous at "
                              f"{self.address}:{self.port} ({e}); check MASTER_ADDR/MASTER_PORT and that the "
                              "port is open between the hosts") from e


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device a rank runs on: GPU `local_rank` where the engine runs on CUDA."""
    from structgen.engine.model_runner import pick_device

    device = pick_device(config)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


class TensorParallel:
    """One rank's membership: its rank, device and groups, the collectives the sharded model
    runs, and (rank 0) the announcements that start the worker ranks' forwards."""

    def __init__(self, rendezvous: Rendezvous, device: torch.device, workers: WorkerProcesses | None = None,
                 store: dist.Store | None = None):
        self.rank, self.world_size, self.device = rendezvous.rank, rendezvous.world_size, device
        self.workers = workers  # the processes rank 0 spawned (None under torchrun, and on workers)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # NVLink SHARP needs multicast memory, which containers and some drivers refuse;
            # the peer sum (kernels/peer_sum.py) maps peers' memory without it.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self._join(rendezvous, store)
        self.commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._header = torch.zeros(HEADER_INTS, dtype=torch.int64)
        self._announcing = threading.Lock()  # the loop's steps and close's stop, one at a time
        self.ready = False  # every rank has loaded its shard: the ranks now follow announcements
        self.broken: str | None = None  # why the ranks may no longer run the same collectives
        self.closed = False  # no more forwards: stopped, or closing
        self.left = False  # this rank has left the process groups
        # CUDA graphs that captured this rank's collectives: NCCL (2.26 on) does not free a
        # communicator while a graph that used it lives, so `leave` releases them first.
        self.graph_holders: list[ReleasesGraphs] = []
        self.pages: PageTable | None = None  # the runner's KV pages, which rank 0 sends with forwards
        self._pages_sent = -1  # the version of rank 0's table the workers have
        self.peer_sum: PeerSum | None = None  # small sums + norm in one kernel, where the GPUs map each other

    def _join(self, rendezvous: Rendezvous, store: dist.Store | None) -> None:
        """Meet the other ranks: through torchrun's store, or through rank 0's, where rank 0
        first waits (polling its spawned ranks' liveness) until every rank has reached it."""
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        where = {"init_method": "env://"}
        if not rendezvous.torchrun:
            store = store or rendezvous.open_store()
            if self.rank:
                store.set(f"structgen/joined/{self.rank}", "1")
            else:
                joined = [f"structgen/joined/{r}" for r in range(1, self.world_size)]
                self._wait_for(lambda: store.check(joined), "reach the rendezvous", STARTUP_TIMEOUT_S)
            where = {"store": store}
        try:
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                    timeout=COLLECTIVE_TIMEOUT, **where)
        except (RuntimeError, ValueError) as e:
            raise EngineError(f"tensor-parallel rank {self.rank} could not join the group at {rendezvous.address}:"
                              f"{rendezvous.port} ({e}); check that every rank started and the port is open") from e

    def _wait_for(self, done: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Poll `done` until it holds; raise `EngineError` once a spawned rank exits or after
        `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.workers is not None:
                self.workers.check()
            if time.monotonic() > deadline:
                raise EngineError(f"the tensor-parallel ranks did not {what} within {timeout_s:.0f} s; a rank is "
                                  "stuck or unreachable: see the ranks' logs, then restart the engine")
            time.sleep(POLL_S)

    def _finish(self, work: dist.Work, what: str, timeout_s: float, watch_workers: bool = False) -> None:
        """Wait, bounded, for a host-side collective of the command group; where the wait may
        be long (`watch_workers`), a spawned rank that exits meanwhile ends it at once. A
        failure leaves the group refusing further steps."""
        try:
            if watch_workers:
                self._wait_for(work.is_completed, what, timeout_s)
            work.wait(timedelta(seconds=timeout_s))
        except (RuntimeError, EngineError) as e:
            self.broken = self.broken or f"the ranks did not {what} ({e})"
            if self.workers is not None:
                self.workers.check()
            if isinstance(e, EngineError):
                raise
            raise EngineError(f"the tensor-parallel ranks did not {what} within {timeout_s:.0f} s, or a rank is gone "
                              f"({e}); restart the engine (close this LLM and create a new one)") from e

    # -- the model's side ---------------------------------------------------------------------
    def shard_config(self, cfg: ModelConfig) -> ModelConfig:
        return rank_config(cfg, self.world_size)

    def weight_shard(self) -> WeightShard:
        return WeightShard(self.rank, self.world_size)

    def prepare_peer_sum(self, dtype: torch.dtype, cols: int, mode: str) -> None:
        """Map the peer sum's buffers (`mode` "auto") where every rank can; else, or with
        "nccl", every sum runs through NCCL (gloo on the CPU) and the norm after it apart."""
        usable = mode == "auto" and PeerSum.usable(self.device, self.world_size, dtype, cols)
        if self.smallest(int(usable), "agree on how to sum activations"):
            self.peer_sum = PeerSum.build(self.device, dtype, cols)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[rows, vocab_size] from every rank's [rows, vocab shard] logits."""
        rows, shard = logits.shape
        parts = torch.empty((self.world_size * rows, shard), dtype=logits.dtype, device=logits.device)
        _all_gather_single(parts, logits.contiguous())
        whole = parts.view(self.world_size, rows, shard).permute(1, 0, 2).reshape(rows, -1)
        return whole if whole.shape[1] == vocab_size else whole[:, :vocab_size].contiguous()

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor`, into every rank's (a decode graph's inputs)."""
        dist.broadcast(tensor, 0)
        return tensor

    # -- rank 0: announcing forwards ------------------------------------------------------------
    @contextmanager
    def extending(self, seqs: list[ExtendSeq]) -> Iterator[None]:
        """Around an eager forward: tells the workers to run `ModelRunner.extend(seqs)` (on
        rank 0), and where the forward fails, leaves the group refusing further steps: the
        ranks' collectives would no longer pair up."""
        if self.rank == 0:
            ids = [t for s in seqs for t in s.token_ids]
            rows = [v for s in seqs for v in (s.slot, s.start, len(s.token_ids), s.num_logits)]
            self._announce(EXTEND, len(seqs), len(ids), torch.tensor(rows + ids, dtype=torch.int64), self._pages())
        try:
            yield
        except RuntimeError as e:  # a collective whose peer is gone
            self.broken = f"a forward failed on rank {self.rank} ({e!r})"
            raise EngineError(f"a tensor-parallel forward failed on rank {self.rank} ({e}); a rank is gone or out "
                              "of step: restart the engine (close this LLM and create a new one)") from e
        except BaseException as e:
            self.broken = f"a forward failed on rank {self.rank} ({e!r})"
            raise

    def announce_graph_forward(self, bucket: int) -> None:
        """Workers: replay the decode graphs' forward of `bucket` rows (with rank 0's page
        table first where it changed since the last forward)."""
        changed = self.pages is not None and self.pages.version != self._pages_sent
        self._announce(GRAPH_FORWARD, bucket, int(changed), *([self._pages()] if changed else []))

    def _pages(self) -> torch.Tensor:
        """Rank 0's KV page table, for the workers: they have no scheduler, so they follow it."""
        assert self.pages is not None
        self._pages_sent = self.pages.version
        return self.pages.host

    def _receive_pages(self) -> None:
        """Rank 0's table, straight into this rank's host copy (the device copy follows on sync)."""
        assert self.pages is not None
        dist.broadcast(self.pages.host_to_replace(), 0, group=self.commands)

    def _announce(self, command: int, a: int, b: int, *payload: torch.Tensor) -> None:
        """Send the workers a command and its payload, as one message no other thread's
        announcement interleaves with."""
        if not self._announcing.acquire(timeout=ANNOUNCE_TIMEOUT_S):
            raise EngineError("another thread's tensor-parallel announcement did not finish; restart the engine")
        try:
            if self.closed:
                raise EngineError("the tensor-parallel group is closed; create a new LLM to generate again")
            if self.broken:
                raise EngineError(f"the tensor-parallel ranks are out of step since {self.broken}; "
                                  "restart the engine (close this LLM and create a new one)")
            if self.workers is not None:
                self.workers.check()
            self._header[0], self._header[1], self._header[2] = command, a, b
            for tensor in (self._header, *payload):
                work = dist.broadcast(tensor, 0, group=self.commands, async_op=True)
                self._finish(work, "take the next step", ANNOUNCE_TIMEOUT_S)
            self.closed = command == STOP
        finally:
            self._announcing.release()

    def smallest(self, value: int, what: str = "load their shards") -> int:
        """The smallest of the ranks' `value`s (the KV slots every rank's memory fits); it also
        waits for every rank to have loaded its shard, before the collectives of graph capture."""
        t = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.commands, async_op=True)
        self._finish(work, what, STARTUP_TIMEOUT_S, watch_workers=True)
        self.ready = True
        return int(t.item())

    def close(self) -> None:
        """Stop the worker ranks (rank 0) and leave the process groups; idempotent, and
        bounded: a worker that does not stop within seconds is killed."""
        if self.left:
            return
        stopped = self.rank == 0 and self.ready and not self.broken  # else the workers are killed
        if stopped:
            try:
                self._announce(STOP, 0, 0)
            except EngineError:
                stopped = False  # a worker is gone already; the others are killed
        self.closed = True
        if self.workers is not None:
            stopped = self.workers.join(SHUTDOWN_TIMEOUT_S if stopped else 0.0) and stopped
        self.leave(clean=stopped)

    def leave(self, clean: bool) -> None:
        """Leave the process groups, within LEAVE_TIMEOUT_S. NCCL's orderly teardown waits on
        peers that may be gone, so on CUDA, and after a failure, the groups are aborted, after
        the CUDA graphs that captured collectives are released (NCCL frees no communicator a
        live graph used: the abort never returned). It runs in a daemon thread; one that
        outlasts the bound goes on in the background (until it ends this process cannot start
        another split engine: `start_tensor_parallel` says so), and the process's exit waits for
        it (`_finish_teardown_at_exit`)."""
        global _pending_teardown
        if self.left:
            return
        self.left = True
        self.peer_sum = None
        for holder in self.graph_holders:
            holder.release_graphs()
        self.graph_holders.clear()
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        teardown = dist.destroy_process_group if (clean and self.device.type != "cuda") or abort is None else abort
        thread = threading.Thread(target=_run_teardown, args=(teardown,), name="structgen-tp-leave", daemon=True)
        thread.start()
        thread.join(LEAVE_TIMEOUT_S)
        if thread.is_alive():
            _pending_teardown = thread
            log.info("leaving the tensor-parallel process group goes on in the background (NCCL's teardown "
                     "took more than %.0f s)", LEAVE_TIMEOUT_S)

    # -- worker ranks ------------------------------------------------------------------------------
    @torch.inference_mode()
    def serve(self, runner: ModelRunner) -> None:
        """Run the forwards rank 0 announces until it says stop (worker ranks)."""
        from structgen.engine.model_runner import ExtendSeq

        while True:
            try:
                dist.broadcast(self._header, 0, group=self.commands)
            except RuntimeError as e:
                raise EngineError(f"tensor-parallel rank 0 is gone ({e}); this worker rank stops with it") from e
            command, a, b = self._header.tolist()
            if command == STOP:
                return
            if command == GRAPH_FORWARD:
                if b:
                    self._receive_pages()
                runner.kv.pages.sync()
                runner.graphs.launch_forward(a)
                continue
            payload = torch.empty(4 * a + b, dtype=torch.int64)
            dist.broadcast(payload, 0, group=self.commands)
            self._receive_pages()
            values, ids = payload[: 4 * a].view(a, 4).tolist(), payload[4 * a :].tolist()
            seqs, first = [], 0
            for slot, start, n, num_logits in values:
                seqs.append(ExtendSeq(slot, start, ids[first : first + n], num_logits))
                first += n
            runner.extend(seqs)


class WorkerProcesses:
    """The worker ranks rank 0 spawned on this host (torch.multiprocessing, spawn)."""

    def __init__(self, processes: list[BaseProcess]):
        self.processes = processes

    @classmethod
    def spawn(cls, rendezvous: Rendezvous, model_config: ModelConfig, config: EngineConfig,
              model_dir: Path | None) -> WorkerProcesses:
        import torch.multiprocessing as mp

        from structgen.engine.model_runner import batch_size_on

        context = mp.get_context("spawn")
        # Drafts are rank 0's alone; every rank the slots rank 0's scheduler fills.
        worker_config = replace(config, speculative=None, max_batch_size=batch_size_on(config, rank_device(config, 0)))
        processes = []
        for rank in range(1, rendezvous.world_size):
            p = context.Process(target=_spawned_worker, name=f"structgen-tp-rank{rank}", daemon=True,
                                args=(rendezvous.of_rank(rank), model_config, worker_config, model_dir))
            p.start()
            processes.append(p)
        return cls(processes)

    def check(self) -> None:
        """Raise `EngineError` naming the first worker rank that exited."""
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                raise EngineError(f"tensor-parallel worker rank {rank} exited with code {p.exitcode}; "
                                  "its log says why. Restart the engine (close this LLM and create a new one)")

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds in all for them to stop, then terminate (and if need
        be kill) the rest; False where one had to be."""
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        left = [p for p in self.processes if p.exitcode is None]
        for p in left:
            if timeout:
                log.warning("tensor-parallel worker %s did not stop; terminating it", p.name)
            p.terminate()
        for p in left:
            p.join(2.0)
            if p.exitcode is None:  # stopped, or stuck where a termination signal waits
                p.kill()
                p.join(2.0)
        return not left

    def kill(self) -> None:
        self.join(0.0)


def start_tensor_parallel(model_config: ModelConfig, config: EngineConfig, model_dir: Path | None) -> TensorParallel:
    """Rank 0's membership of `config.tensor_parallel` ranks: joins a torchrun launch, or
    spawns the worker ranks on this host. Refuses a size that does not split the model before
    starting anything."""
    rank_config(model_config, config.tensor_parallel)
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # as multiprocessing.spawn tests it
        raise EngineError("this process is a tensor-parallel worker importing the script that started the engine, "
                          "and the script starts an engine as it is imported: create the LLM under "
                          "`if __name__ == \"__main__\":` (each worker rank is a new process that imports the script)")
    if _pending_teardown is not None and _pending_teardown.is_alive():
        raise EngineError("the last tensor-parallel engine of this process is still leaving its NCCL group "
                          "(NCCL's teardown can take a minute after CUDA graphs); try again later, or start "
                          "the new split engine in a new process")
    if dist.is_initialized():
        raise EngineError("this process already belongs to a tensor-parallel group (another engine with "
                          "tensor_parallel > 1 is open); close that LLM first")
    rendezvous = Rendezvous.from_torchrun()
    workers = store = None
    if rendezvous is None:
        rendezvous = Rendezvous.on_this_host(config.tensor_parallel)
        store = rendezvous.open_store()
        rendezvous = replace(rendezvous, port=store.port)
        workers = WorkerProcesses.spawn(rendezvous, model_config, config, model_dir)
    elif rendezvous.world_size != config.tensor_parallel or rendezvous.rank != 0:
        raise EngineError(
            f"torchrun launched rank {rendezvous.rank} of {rendezvous.world_size} but tensor_parallel="
            f"{config.tensor_parallel}: launch tensor_parallel processes, and call "
            "structgen.engine.parallel.run_worker on every rank but 0")
    try:
        return TensorParallel(rendezvous, rank_device(config, rendezvous.local_rank), workers, store)
    except BaseException:
        if workers is not None:
            workers.kill()
        raise


def _spawned_worker(rendezvous: Rendezvous, model_config: ModelConfig, config: EngineConfig,
                    model_dir: Path | None) -> None:
    from structgen.engine.model_runner import ModelRunner

    tp = TensorParallel(rendezvous, rank_device(config, rendezvous.local_rank))
    runner = ModelRunner(model_config, config, model_dir, tensor_parallel=tp)
    tp.serve(runner)
    _leave(runner)
    _exit_now()


def run_worker(model: str | Path | None, config: EngineConfig) -> None:
    """A worker rank of a torchrun launch (rank > 0): load this rank's shard of `model` and
    run the forwards rank 0 announces until its engine closes. On CUDA the process then exits
    at once, with status 0 (`_exit_now`); elsewhere this returns."""
    from structgen.engine.model_runner import ModelRunner
    from structgen.engine.models.loader import load_model_config, resolve_model

    rendezvous = Rendezvous.from_torchrun()
    if rendezvous is None or rendezvous.rank == 0:
        raise EngineError("run_worker is for ranks above 0 of a torchrun launch; rank 0 runs the engine")
    model_dir = resolve_model(model, progress=False)
    tp = TensorParallel(rendezvous, rank_device(config, rendezvous.local_rank))
    runner = ModelRunner(load_model_config(model_dir), replace(config, speculative=None), model_dir, tensor_parallel=tp)
    tp.serve(runner)
    _leave(runner)
    if runner.device.type == "cuda":
        _exit_now()


def _exit_now(status: int = 0) -> None:
    """Exit without Python's teardown, which frees CUDA graphs, NCCL communicators and the
    shard one by one and outlasted rank 0's wait on an H100 host (the operating system frees
    them at once): a worker rank's end, or a process whose NCCL teardown did not end."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _leave(runner: ModelRunner) -> None:
    """A worker rank told to stop: finish its device work and leave the groups without
    waiting on any peer. On CUDA it leaves nothing to tear down: its process exits next, and
    the operating system frees the communicators at once (NCCL's teardown can hang, `leave`)."""
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        runner.tensor_parallel.left = True
        return
    runner.tensor_parallel.leave(clean=True)


@atexit.register
def _finish_teardown_at_exit() -> None:
    """Let a teardown still running end before the interpreter finalizes; one that does not
    end within EXIT_WAIT_S is cut short by leaving the process at once, with status 1."""
    thread = _pending_teardown
    if thread is None or not thread.is_alive():
        return
    thread.join(EXIT_WAIT_S)
    if thread.is_alive():
        log.error("NCCL's teardown did not end within %.0f s of exit; leaving the process without it", EXIT_WAIT_S)
        _exit_now(1)


def _run_teardown(teardown: Callable[[], None]) -> None:
    try:
        teardown()
    except Exception as e:  # a group already gone: nothing is left to leave
        log.debug("tensor-parallel teardown: %s", e)
