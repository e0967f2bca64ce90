from _shared import MAX_TOKENS, SMALL_OBJECT, load

llm = load("xgrammar")
print(llm.generate(SMALL_OBJECT, "Pick a digit n.", max_tokens=MAX_TOKENS))
