"""The shortest-output lengths `analyse` refuses never-ending grammars with: the worklist gives
what the plain fixpoint (every rule again until nothing changes) gives."""

from __future__ import annotations

import json
from pathlib import Path

from structgen.grammar.backends.xgrammar import build_grammar
from structgen.grammar.termination import NEVER, _Exprs, _shortest, _shortest_lengths
from structgen.types import Regex, to_constraint


def _plain_fixpoint(g: _Exprs) -> list[int]:
    shortest = [NEVER] * len(g.rules)
    changed = True
    while changed:
        changed = False
        for r in range(len(g.rules)):
            n = _shortest(g, g.body(r), shortest)
            if n < shortest[r]:
                shortest[r], changed = n, True
    return shortest


def _exprs(output_type) -> _Exprs:
    return _Exprs(build_grammar(to_constraint(output_type)).serialize_json())


def test_worklist_lengths_equal_the_plain_fixpoint_on_maskbench_schemas(maskbench_dir: Path):
    from structgen.types import JsonSchema

    lines = [line for line in (maskbench_dir / "Github_easy.jsonl").read_text().splitlines() if line.strip()]
    grammars = []
    for line in lines[:20]:
        try:
            grammars.append(_exprs(JsonSchema(json.loads(line)["schema"])))
        except RuntimeError:  # a schema xgrammar cannot read: `analyse` skips it too
            continue
    assert len(grammars) >= 10
    assert [_shortest_lengths(g) for g in grammars] == [_plain_fixpoint(g) for g in grammars]


def test_worklist_lengths_of_recursive_and_never_ending_grammars():
    from structgen.types import CFG

    for grammar in ('root ::= "(" root ")" | "x"', 'root ::= "ab" root', 'root ::= a\na ::= b "1" | "2"\nb ::= a "3"'):
        g = _exprs(CFG(grammar))
        assert _shortest_lengths(g) == _plain_fixpoint(g)
    assert _shortest_lengths(_exprs(CFG('root ::= "ab" root')))[0] == NEVER
    assert _shortest_lengths(_exprs(Regex("a{3}b?")))[0] == 3
