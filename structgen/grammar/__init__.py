"""Grammars: compile a `Constraint` for a tokenizer, then match tokens against it.

    compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)   # one per tokenizer
    grammar = compiler.compile(to_constraint(Invoice))                  # cached
    future = compiler.submit(Invoice)            # the same on the compiler's own pool
    matcher = grammar.matcher()                                         # one per request
    matcher.fill_bitmask(bitmask, row); ...; matcher.accept_token(tid)

Backends (xgrammar, llguidance) are imported on first use.
"""

from structgen.grammar.backends.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    allocate_bitmask,
    bitmask_words,
)
from structgen.grammar.batch import GrammarThreads, accept_one, accept_tokens, fill_bitmasks
from structgen.grammar.compiler import BACKENDS, GrammarCompiler, candidate_backends
from structgen.schema.json_format import JSON_SEPARATORS, dump_json
from structgen.schema.limits import ConstraintLimits

__all__ = [
    "BACKENDS",
    "JSON_SEPARATORS",
    "CompiledGrammar",
    "ConstraintLimits",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarMatcher",
    "GrammarThreads",
    "accept_one",
    "accept_tokens",
    "allocate_bitmask",
    "bitmask_words",
    "candidate_backends",
    "dump_json",
    "fill_bitmasks",
]
