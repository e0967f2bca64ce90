"""Typed partial objects while a JSON output streams: `llm.stream(Model, prompt, partial=True)`
yields `Partial[Model]` snapshots (see tracker.py for what a snapshot holds)."""

from structgen.partial.json_stream import JsonEvent, JsonStreamParser, Path
from structgen.partial.stream import PartialStream, partial_tracker
from structgen.partial.tracker import Partial, PartialTracker

__all__ = ["Partial", "PartialStream", "PartialTracker", "JsonStreamParser", "JsonEvent", "Path", "partial_tracker"]
