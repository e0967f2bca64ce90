from _shared import EBNF_PAIR, MAX_TOKENS, load

llm = load()
print(llm.generate(EBNF_PAIR, "A pair of digits:", max_tokens=MAX_TOKENS))
