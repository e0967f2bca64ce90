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
requests fail instead of waiting on a collective that never completes.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

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
SHUTDOWN_TIMEOUT_S = 15.0
# all_gather_into_tensor's newer name (the old one warns from torch 2.10 on).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


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
        else loopback and a free port."""
        address = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "0")) or _free_port(address)
        return cls(address, port, world_size, 0, 0)

    def of_rank(self, rank: int) -> Rendezvous:
        return replace(self, rank=rank, local_rank=rank)


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device a rank runs on: GPU `local_rank` where the engine runs on CUDA."""
    from structgen.engine.model_runner import pick_device

    device = pick_device(config)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


class TensorParallel:
    """One rank's membership: its rank, device and groups, the collectives the sharded model
    runs, and (rank 0) the announcements that start the worker ranks' forwards."""

    def __init__(self, rendezvous: Rendezvous, device: torch.device, workers: WorkerProcesses | None = None):
        self.rank, self.world_size, self.device = rendezvous.rank, rendezvous.world_size, device
        self.workers = workers  # the processes rank 0 spawned (None under torchrun, and on workers)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # NVLink SHARP needs multicast memory, which containers and some drivers refuse.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=rendezvous.init_method,
                                rank=self.rank, world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT)
        self.commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._header = torch.zeros(HEADER_INTS, dtype=torch.int64)
        self.ready = False  # every rank has loaded its shard: the ranks now follow announcements
        self.broken: str | None = None  # why the ranks may no longer run the same collectives
        self.closed = False
        self.pages: PageTable | None = None  # the runner's KV pages, which rank 0 sends with forwards
        self._pages_sent = -1  # the version of rank 0's table the workers have

    # -- the model's side ---------------------------------------------------------------------
    def shard_config(self, cfg: ModelConfig) -> ModelConfig:
        return rank_config(cfg, self.world_size)

    def weight_shard(self) -> WeightShard:
        return WeightShard(self.rank, self.world_size)

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
            self._announce(EXTEND, len(seqs), len(ids))
            rows = [v for s in seqs for v in (s.slot, s.start, len(s.token_ids), s.num_logits)]
            self._send(torch.tensor(rows + ids, dtype=torch.int64))
            self._send_pages()
        try:
            yield
        except BaseException as e:
            self.broken = f"a forward failed on rank {self.rank} ({e!r})"
            raise

    def announce_graph_forward(self, bucket: int) -> None:
        """Workers: replay the decode graphs' forward of `bucket` rows (with rank 0's page
        table first where it changed since the last forward)."""
        changed = self.pages is not None and self.pages.version != self._pages_sent
        self._announce(GRAPH_FORWARD, bucket, int(changed))
        if changed:
            self._send_pages()

    def _send_pages(self) -> None:
        """Rank 0's KV page table to the workers: they have no scheduler, so they follow it."""
        assert self.pages is not None
        self._send(self.pages.host)
        self._pages_sent = self.pages.version

    def _receive_pages(self) -> None:
        assert self.pages is not None
        table = torch.empty_like(self.pages.host)
        dist.broadcast(table, 0, group=self.commands)
        self.pages.replace_table(table)

    def _announce(self, command: int, a: int, b: int) -> None:
        if self.closed:
            raise EngineError("the tensor-parallel group is closed; create a new LLM to generate again")
        if self.broken:
            raise EngineError(f"the tensor-parallel ranks are out of step since {self.broken}; "
                              "restart the engine (close this LLM and create a new one)")
        if self.workers is not None:
            self.workers.check()
        self._header[0], self._header[1], self._header[2] = command, a, b
        self._send(self._header)

    def _send(self, tensor: torch.Tensor) -> None:
        try:
            dist.broadcast(tensor, 0, group=self.commands)
        except RuntimeError as e:
            raise EngineError(f"a tensor-parallel worker rank is gone ({e}); restart the engine") from e

    def smallest(self, value: int) -> int:
        """The smallest of the ranks' `value`s (the KV slots every rank's memory fits); it also
        waits for every rank to have loaded its shard, before the collectives of graph capture."""
        if self.workers is not None:
            self.workers.check()
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.commands)
        except RuntimeError as e:
            if self.workers is not None:
                self.workers.check()
            raise EngineError(f"a tensor-parallel rank failed while loading ({e}); see its log above") from e
        self.ready = True
        return int(t.item())

    def close(self) -> None:
        """Stop the worker ranks (rank 0) and leave the process groups; idempotent."""
        if self.closed:
            return
        stopping = self.rank == 0 and self.ready and not self.broken  # else the workers are terminated
        if stopping:
            try:
                self._announce(STOP, 0, 0)
            except EngineError:
                stopping = False  # a worker is gone already; the others are terminated
        self.closed = True
        stopped = True
        if self.workers is not None:
            stopped = self.workers.join(SHUTDOWN_TIMEOUT_S if stopping else 0.0)
        if stopped:  # tearing NCCL down beside a peer that was killed mid-collective can block
            dist.destroy_process_group()

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

        context = mp.get_context("spawn")
        worker_config = replace(config, speculative=None)  # drafts are rank 0's alone
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
        """Wait up to `timeout` seconds for each to stop, then terminate it; False where one
        had to be terminated."""
        stopped = True
        for p in self.processes:
            p.join(timeout)
            if p.exitcode is None:
                if timeout:
                    log.warning("tensor-parallel worker %s did not stop; terminating it", p.name)
                p.terminate()
                p.join(SHUTDOWN_TIMEOUT_S)
                stopped = False
        return stopped


def start_tensor_parallel(model_config: ModelConfig, config: EngineConfig, model_dir: Path | None) -> TensorParallel:
    """Rank 0's membership of `config.tensor_parallel` ranks: joins a torchrun launch, or
    spawns the worker ranks on this host. Refuses a size that does not split the model before
    starting anything."""
    rank_config(model_config, config.tensor_parallel)
    if dist.is_initialized():
        raise EngineError("this process already belongs to a tensor-parallel group (another engine with "
                          "tensor_parallel > 1 is open); close that LLM first")
    rendezvous = Rendezvous.from_torchrun()
    workers = None
    if rendezvous is None:
        rendezvous = Rendezvous.on_this_host(config.tensor_parallel)
        workers = WorkerProcesses.spawn(rendezvous, model_config, config, model_dir)
    elif rendezvous.world_size != config.tensor_parallel or rendezvous.rank != 0:
        raise EngineError(
            f"torchrun launched rank {rendezvous.rank} of {rendezvous.world_size} but tensor_parallel="
            f"{config.tensor_parallel}: launch tensor_parallel processes, and call "
            "structgen.engine.parallel.run_worker on every rank but 0")
    try:
        return TensorParallel(rendezvous, rank_device(config, rendezvous.local_rank), workers)
    except Exception:
        if workers is not None:
            for p in workers.processes:
                p.terminate()
        raise


def _spawned_worker(rendezvous: Rendezvous, model_config: ModelConfig, config: EngineConfig,
                    model_dir: Path | None) -> None:
    from structgen.engine.model_runner import ModelRunner

    tp = TensorParallel(rendezvous, rank_device(config, rendezvous.local_rank))
    runner = ModelRunner(model_config, config, model_dir, tensor_parallel=tp)
    tp.serve(runner)
    _leave(runner)


def run_worker(model: str | Path | None, config: EngineConfig) -> None:
    """A worker rank of a torchrun launch (rank > 0): load this rank's shard of `model` and
    run the forwards rank 0 announces until its engine closes."""
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


def _leave(runner: ModelRunner) -> None:
    """A worker rank told to stop: finish its device work and leave. Its captured graphs hold
    the NCCL communicator; the process exits without tearing NCCL down (rank 0 does), which
    could wait on a peer."""
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
