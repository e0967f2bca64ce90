"""Regex and context-free grammars: outputs in a format you define, not only JSON.

`Regex` gives text that fully matches a pattern; `CFG` takes an EBNF/GBNF grammar (rules
`name ::= ...`, start rule `root`) or a Lark grammar (start rule `start`).

    python examples/regex_and_grammar.py
"""

import structgen

# A tiny arithmetic language (recursive: parentheses nest), at most three terms a level.
ARITHMETIC_EBNF = r"""
root   ::= expr
expr   ::= term (" " [-+] " " term){0,2}
term   ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
"""

# A key=value line in Lark syntax.
SETTING_LARK = r"""
start: KEY "=" VALUE
KEY: /[a-z_]{1,16}/
VALUE: /[0-9]{1,4}/
"""


def main() -> None:
    llm = structgen.LLM()

    date = llm.generate(structgen.Regex(r"\d{4}-\d{2}-\d{2}"), "When did the Berlin Wall fall? Give an ISO date.")
    print("date:", date)
    phone = llm.generate(structgen.Regex(r"\(\d{3}\) \d{3}-\d{4}"), "Write a US phone number.")
    print("phone:", phone)

    expression = llm.generate(structgen.CFG(ARITHMETIC_EBNF), "Write a sum of three numbers.", max_tokens=30)
    print("expression:", expression, "=", eval(expression))  # safe: the grammar allows only digits, + - ( )

    setting = llm.generate(structgen.CFG(SETTING_LARK), "Set the timeout to 30 seconds, as key=value.", max_tokens=20)
    key, value = setting.split("=")
    print("setting:", key, "->", int(value))

    # compile() gives the grammar itself: accepts() says whether a text is one of its outputs.
    grammar = llm.compile(structgen.CFG(ARITHMETIC_EBNF))
    print("accepts '1 + (2 - 3)':", grammar.accepts("1 + (2 - 3)"), "| accepts '1 +':", grammar.accepts("1 +"))


if __name__ == "__main__":
    main()
