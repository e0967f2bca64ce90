"""Speculative decoding: drafters (n-gram / prompt lookup, draft model, self-draft, your own)
propose tokens; the target verifies them all in one forward under the grammar mask."""

from structgen.engine.speculative.drafter import Drafter
from structgen.engine.speculative.ngram import NgramDrafter

__all__ = ["Drafter", "NgramDrafter"]
