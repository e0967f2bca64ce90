"""What the exit scripts share: the default model and the constraints they generate with.

Each script in this folder is a whole program run by tests/test_exit.py in a fresh interpreter;
its first line may say the exit code it asks for (`# expect-exit: 3`), else 0 is expected."""

from __future__ import annotations

from typing import Literal

import structgen

YES_NO = Literal["yes", "no"]
SMALL_OBJECT = structgen.JsonSchema(
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
)
THREE_DIGITS = structgen.Regex(r"[0-9]{3}")
LARK_WORD = structgen.CFG(r'start: "x" /[a-z]{2,4}/', syntax="lark")
EBNF_PAIR = structgen.CFG('root ::= "(" [0-9] "," [0-9] ")"', syntax="ebnf")
# Enough tokens for every constraint above to complete.
MAX_TOKENS = 16


def load(backend: str = "auto") -> structgen.LLM:
    """The default model (SmolLM2-135M on CPU) with `backend` grammars."""
    return structgen.LLM(backend=backend)
