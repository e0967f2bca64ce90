"""Classification: the output is exactly one label, as an `Enum` member or a `Literal` string.

The grammar allows only the labels' texts, so no answer needs parsing or can be off the list;
`generate_batch` classifies every text in one batch.

    python examples/classification.py
"""

from enum import Enum
from typing import Literal

import structgen


class Sentiment(Enum):
    positive = "positive"
    negative = "negative"


Language = Literal["English", "French", "German"]

REVIEWS = ["Loved it, will buy again.", "Terrible quality, it broke after one day."]
GREETINGS = ["Bonjour, comment allez-vous ?", "Good morning, how are you?", "Guten Morgen, wie geht es Ihnen?"]


def main() -> None:
    llm = structgen.LLM()
    prompts = [f"Is this review positive or negative? '{review}'" for review in REVIEWS]
    for review, sentiment in zip(REVIEWS, llm.generate_batch(Sentiment, prompts), strict=True):
        assert isinstance(sentiment, Sentiment)
        print(f"{sentiment.value:>8} | {review}")

    prompts = [f"Which language is this: '{text}'?" for text in GREETINGS]
    for text, language in zip(GREETINGS, llm.generate_batch(Language, prompts), strict=True):
        assert language in ("English", "French", "German")
        print(f"{language:>8} | {text}")


if __name__ == "__main__":
    main()
