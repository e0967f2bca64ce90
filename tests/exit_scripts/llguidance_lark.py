from _shared import LARK_WORD, MAX_TOKENS, load

llm = load("llguidance")
print(llm.generate(LARK_WORD, "A short word:", max_tokens=MAX_TOKENS))
