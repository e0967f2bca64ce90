"""A remote engine: the same typed API (`generate`, `generate_batch`, `call`) against an
OpenAI-compatible server, with outputs validated locally.

`structgen.LLM.remote(base_url, model)` turns each output type into a constraint here, sends it
in the request, and parses and validates the reply here, so a value is never invalid even if a
server ignored the constraint. Without an argument the script starts `structgen serve` itself.

    python examples/remote_engine.py                          # starts its own server
    python examples/remote_engine.py http://127.0.0.1:8000/v1 SmolLM2-135M-Instruct
"""

import sys
from typing import Literal

from pydantic import BaseModel

import structgen
from structgen_server.process import ServerProcess


class Person(BaseModel):
    name: str
    age: int


def use(base_url: str, model: str) -> None:
    with structgen.LLM.remote(base_url, model) as remote:
        person = remote.generate(Person, "Extract the person: Alan Turing is 41 years old.", max_tokens=40)
        assert isinstance(person, Person)
        print("generate:", repr(person))
        people = remote.generate_batch(
            Person, ["Extract: Bob Stone is 7 years old.", "Extract: Eve Adams is 52 years old."], max_tokens=40
        )
        print("generate_batch:", people)
        answer = remote.generate(Literal["yes", "no"], "Is Paris the capital of France?", max_tokens=5)
        print("Literal:", answer)
        done = remote.complete(structgen.Regex(r"\d{3}-\d{4}"), "Write a phone number.", max_tokens=12)
        print("Regex:", done.value, f"({done.stats.output_tokens} tokens)")


def main() -> None:
    if len(sys.argv) > 2:
        use(sys.argv[1], sys.argv[2])
        return
    with ServerProcess(["--log-level", "warning"]) as server:  # stopped when the block ends
        print("started", server.url)
        use(server.url, "SmolLM2-135M-Instruct")


if __name__ == "__main__":
    main()
