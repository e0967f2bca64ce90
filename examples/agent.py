"""A function-calling agent: typed Python functions as tools, and the call -> run -> answer loop.

`@structgen.tool` builds each tool's JSON schema from its type hints and docstring; every call
the model makes is valid against it by construction, and arrives with typed arguments.
`structgen.run_tools` runs the calls and feeds the results back until the model answers
(the tiny default model mostly repeats the tool result as its answer).

    python examples/agent.py
"""

from typing import Literal

import structgen

FORECASTS = {"paris": (18, "sunny"), "london": (12, "raining"), "tokyo": (24, "cloudy")}


@structgen.tool
def get_weather(city: str, unit: Literal["C", "F"] = "C") -> str:
    """Current weather in a city.

    Args:
        city: the city name, e.g. Paris
        unit: C for Celsius, F for Fahrenheit
    """
    celsius, sky = FORECASTS.get(city.lower(), (20, "clear"))
    degrees = celsius if unit == "C" else round(celsius * 9 / 5 + 32)
    return f"{degrees} degrees {unit}, {sky}"


def main() -> None:
    llm = structgen.LLM()

    # One turn: the model's calls, typed and ready to run.
    calls = llm.call("What is the weather in London?", tools=[get_weather], max_tokens=64)
    for c in calls:
        print(f"call: {c.name}(city={c.arguments.city!r}, unit={c.arguments.unit!r}) -> {c.invoke()}")

    # The loop: call, run, feed the result back, answer.
    run = structgen.run_tools(
        llm,
        [
            {"role": "system", "content": "Call the tool, then tell the user the weather in a short sentence."},
            {"role": "user", "content": "What is the weather in Paris today?"},
        ],
        [get_weather],
        tool_choice="required",
        max_rounds=1,
        max_tokens=64,
    )
    for c, result in run.calls:
        print(f"run_tools called {c.name}({c.arguments_json()}) -> {result}")
    print("answer:", run.answer.strip())


if __name__ == "__main__":
    main()
