"""Streaming and asyncio: text deltas as they are decoded, and concurrent async requests.

`llm.stream` yields deltas (the typed value is checked when the stream ends); `llm.astream`
is the async iterator, `.completion` holding the final result; `llm.agenerate` awaits one
value, and concurrent tasks share the engine's batches.

    python examples/streaming.py
"""

import asyncio

from pydantic import BaseModel

import structgen


class Person(BaseModel):
    name: str
    age: int


async def concurrent(llm: structgen.LLM) -> None:
    texts = ["Bob Stone is 7 years old.", "Eve Adams is 52 years old."]
    people = await asyncio.gather(*(llm.agenerate(Person, f"Extract: {t}", max_tokens=40) for t in texts))
    print("gathered:", people)

    stream = llm.astream(Person, "Extract: Alan Turing is 41 years old.", max_tokens=40)
    print("astream: ", end="")
    async for delta in stream:
        print(delta, end="|", flush=True)
    print()
    assert stream.completion is not None
    print("final value:", repr(stream.completion.value))


def main() -> None:
    llm = structgen.LLM()
    print("stream:  ", end="")
    for delta in llm.stream(Person, "Extract: Grace Hopper is 85 years old.", max_tokens=40):
        print(delta, end="|", flush=True)  # "|" marks where each delta ends
    print()
    asyncio.run(concurrent(llm))


if __name__ == "__main__":
    main()
