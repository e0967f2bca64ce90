"""Launch shapes timed on the device, kept on disk so that the next process reads them.

`gemv.plan`, `fused_gemv.plan` and `moe.expert_tiles` time candidate block shapes on first use
per matrix shape. A model has tens of such shapes, so every process spent seconds of its first
`LLM()` timing them (docs/performance.md, "The first LLM() in a process"), and since near-tied
candidates fall either way, two processes could pick different kernels for the same 2-16-row
step, and a greedy output could differ in its last bits between runs.

Each choice is written to `$STRUCTGEN_CACHE/plans` (else `~/.cache/structgen/plans`), one JSON
file per kernel family and per *what decides a kernel's speed*: the GPU's name and compute
capability, the torch and Triton versions, and the family's own source (an edited kernel times
afresh). A file that cannot be read or written is left alone: the plans are then timed as
before, kept in memory only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import triton

from structgen.csrc import cache_root

log = logging.getLogger(__name__)
V = TypeVar("V")


def plans_dir() -> Path:
    return cache_root() / "plans"


def device_identity(device: torch.device) -> str:
    """What about `device` decides which launch shape is fastest (not its index: two cards of
    one model time alike)."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


class TimedPlans(Generic[V]):
    """One kernel family's plans: `plan_for(key, device, time, during_capture)`. `key` is a
    tuple of ints, strings, bools and tuples of them (a matrix's shape, its dtype's name...);
    `encode` / `decode` turn a plan into JSON values and back."""

    def __init__(self, family: str, source_file: str, encode: Callable[[V], Any], decode: Callable[[Any], V]):
        self.family = family
        self.source = hashlib.sha256(Path(source_file).read_bytes()).hexdigest()
        self.encode, self.decode = encode, decode
        self._known: dict[torch.device, dict[str, V]] = {}

    def plan_for(self, key: tuple, device: torch.device, time: Callable[[], V], during_capture: V) -> V:
        """The plan for `key` on `device`: remembered, else read from disk, else timed now by
        `time()` and kept; never timed while a CUDA graph is being captured, where
        `during_capture` stands in (and is not kept)."""
        known = self._known.get(device)
        if known is None:
            known = self._known[device] = self._read(device)
        name = json.dumps(key)
        if name not in known:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return during_capture
            known[name] = self._keep(device, name, time())
        return known[name]

    def remembers(self, key: tuple, device: torch.device) -> bool:
        """Whether this process holds a plan for `key` on `device` (timed or read)."""
        return json.dumps(key) in self._known.get(device, {})

    def path(self, device: torch.device) -> Path:
        versions = "|".join((device_identity(device), torch.__version__, triton.__version__, self.source))
        return plans_dir() / f"{self.family}-{hashlib.sha256(versions.encode()).hexdigest()[:16]}.json"

    def _read(self, device: torch.device) -> dict[str, V]:
        """The file's plans, less any that do not decode (a damaged file is timed over)."""
        try:
            stored = json.loads(self.path(device).read_text())["plans"]
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.info("ignoring the timed plans in %s: %s", self.path(device), exc)
            return {}
        plans: dict[str, V] = {}
        for name, value in stored.items() if isinstance(stored, dict) else ():
            try:
                plans[name] = self.decode(value)
            except (ValueError, KeyError, TypeError, IndexError):
                log.info("ignoring the timed plan %s in %s", name, self.path(device))
        return plans

    def _keep(self, device: torch.device, name: str, plan: V) -> V:
        """Add one plan to the file and return the plan to use: the file's where another
        process (a replica started beside this one) wrote one meanwhile, so that both run the
        same kernels; what else they wrote is kept (a race may lose a plan, which is then timed
        again: never a wrong one)."""
        path = self.path(device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            stored = self._read(device)
            if name in stored:
                return stored[name]
            plans = {n: self.encode(p) for n, p in stored.items()}
            plans[name] = self.encode(plan)
            body = json.dumps({"device": device_identity(device), "torch": torch.__version__,
                               "triton": triton.__version__, "plans": plans}, indent=1)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
                tmp.write(body)
            os.replace(tmp.name, path)
        except OSError as exc:
            log.info("cannot keep timed plans in %s: %s", path, exc)
        return plan
