"""JSON-schema requests with the official `openai` client against `structgen serve`.

Without an argument the script starts a server itself (the default model, on a free port) and
stops it at the end; with a URL it uses that server.

    python examples/openai_client.py                          # starts its own server
    structgen serve --port 8000 &  python examples/openai_client.py http://127.0.0.1:8000/v1
"""

import json
import sys

from openai import OpenAI

from structgen_server.process import ServerProcess

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
    "additionalProperties": False,
}


def ask(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused")  # `structgen serve --api-key` checks it
    model = client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris, France as JSON: is it the capital?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}},
        max_tokens=60,
        temperature=0,
    )
    choice = response.choices[0]
    if choice.finish_reason == "length":  # cut at max_tokens: the JSON is incomplete
        sys.exit(f"truncated at max_tokens: {choice.message.content!r}")
    city = json.loads(choice.message.content)  # valid against CITY_SCHEMA
    print(f"{model}: {city} ({response.usage.completion_tokens} tokens)")


def main() -> None:
    if len(sys.argv) > 1:
        ask(sys.argv[1])
        return
    with ServerProcess(["--log-level", "warning"]) as server:  # stopped when the block ends
        print("started", server.url)
        ask(server.url)


if __name__ == "__main__":
    main()
