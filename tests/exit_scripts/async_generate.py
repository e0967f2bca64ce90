import asyncio

from _shared import MAX_TOKENS, SMALL_OBJECT, THREE_DIGITS, load


async def main() -> None:
    llm = load("llguidance")
    print(await llm.agenerate(SMALL_OBJECT, "Pick a digit n.", max_tokens=MAX_TOKENS))
    async for delta in llm.astream(THREE_DIGITS, "Three digits:", max_tokens=MAX_TOKENS):
        print(delta)
        break  # left early: the stream aborts its request


asyncio.run(main())
