# The request is still decoding when the interpreter exits.
from _shared import load

llm = load("llguidance")
for delta in llm.stream(str, "Write a long story about the sea.", max_tokens=400):
    print(delta)
    break
