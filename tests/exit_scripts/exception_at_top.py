# expect-exit: 1
from _shared import MAX_TOKENS, YES_NO, load

llm = load("llguidance")
print(llm.generate(YES_NO, "Is the sky blue?", max_tokens=MAX_TOKENS))
raise RuntimeError("raised at top level on purpose")
