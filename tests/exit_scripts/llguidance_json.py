from _shared import MAX_TOKENS, SMALL_OBJECT, YES_NO, load

llm = load("llguidance")
print(llm.generate(YES_NO, "Is the sky blue?", max_tokens=MAX_TOKENS))
print(llm.generate(SMALL_OBJECT, "Pick a digit n.", max_tokens=MAX_TOKENS))
