"""Batches: many prompts decoded together on one engine, in-process.

`generate_batch` submits every prompt at once; the engine decodes them in shared steps, so a
batch takes far fewer forward passes than the same prompts one after another.

    python examples/batch.py
"""

import time

from pydantic import BaseModel, Field

import structgen


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=130)


PEOPLE = [
    "Ada Lovelace is 36 years old.",
    "Alan Turing is 41 years old.",
    "Grace Hopper is 85 years old.",
    "Katherine Johnson is 101 years old.",
]


def main() -> None:
    llm = structgen.LLM()
    prompts = [f"Extract the person: {text}" for text in PEOPLE]

    t0 = time.perf_counter()
    one_by_one = [llm.complete(Person, p, max_tokens=40) for p in prompts]
    sequential_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    batched = llm.complete_batch(Person, prompts, max_tokens=40)
    batch_s = time.perf_counter() - t0

    for done in batched:
        print(repr(done.value))
    passes = sum(d.stats.forward_passes for d in one_by_one)
    print(f"one by one: {passes} forward passes, {sequential_s:.2f} s")
    print(f"as a batch: {max(d.stats.forward_passes for d in batched)} forward passes, {batch_s:.2f} s")


if __name__ == "__main__":
    main()
