from _shared import load

llm = load("llguidance")
print(llm.model_name)
