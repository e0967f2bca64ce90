"""Typed extraction: pull validated pydantic records out of free text, one per document.

Field descriptions and constraints (`Field(description=..., pattern=..., ge=...)`) go into
the grammar's JSON schema, so even a small model writes the right kind of value in each field.

    python examples/extraction.py
"""

from datetime import date
from typing import Literal

from pydantic import BaseModel, Field

import structgen


class Invoice(BaseModel):
    number: str = Field(pattern=r"^INV-[0-9]{4}$", description="invoice number, INV-dddd")
    customer: str
    issued: date
    total: float = Field(ge=0, description="amount due")
    currency: Literal["EUR", "USD", "GBP"]
    paid: bool


DOCUMENTS = [
    "Invoice INV-0042 for Acme Corp, issued 2024-03-05, currency USD, total 129.50. Paid in full.",
    "Invoice INV-0107 for Blue Bakery, issued 2024-06-21, currency EUR, total 2400. Payment still pending.",
]


def main() -> None:
    llm = structgen.LLM()
    for text in DOCUMENTS:
        invoice = llm.generate(Invoice, f"Extract the invoice as JSON: {text}", max_tokens=100)
        assert isinstance(invoice, Invoice)  # validated by pydantic, typed for your editor
        print(repr(invoice))


if __name__ == "__main__":
    main()
