from _shared import MAX_TOKENS, THREE_DIGITS, load

llm = load("llguidance")
print(llm.generate(THREE_DIGITS, "Three digits:", max_tokens=MAX_TOKENS))
