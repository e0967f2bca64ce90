"""Tokenizer conformance, checked when a model loads: the grammar masks are only right if the
byte table the grammar backends build (`grammar.backends.base.token_bytes`) says what the
tokenizer really writes. A model that fails is refused (`ModelLoadError` naming the token and
the fix), never run with silently wrong masks.

Checked:
- every text token's bytes, decoded after a plain anchor token by the tokenizer itself, equal
  the table's (partial UTF-8 bytes compared as the replacement character they decode to);
- a probe text encodes to tokens whose table bytes spell it back exactly;
- control tokens are never grammar text: stop tokens lie inside the model's vocabulary, and
  every added token the chat template writes (turn markers) is a control token;
- the chat template, where there is one, renders a conversation;
- logits rows wider than the tokenizer (padded vocabularies) are reported, so the engine masks
  the ids no token has (`TokenizerReport.text_vocab_size`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from structgen.errors import ModelLoadError
from structgen.grammar.backends.base import control_token_ids, token_bytes

PROBE_TEXT = 'Hello, world! {"name": "Zoë", "n": [1, 2.5e-3]}\n\t  ü€𝄞 日本語 </s>'
PROBE_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]
_SHOWN = 3  # mismatching tokens named in an error


@dataclass(frozen=True)
class TokenizerReport:
    """What the check found about a tokenizer that passed."""

    text_vocab_size: int  # ids below this are the tokenizer's; the model's rows past it are padding
    model_vocab_size: int
    control_tokens: int
    has_chat_template: bool
    seconds: float

    @property
    def padded(self) -> bool:
        return self.model_vocab_size > self.text_vocab_size


def check_tokenizer(tokenizer: Any, model_vocab_size: int, stop_token_ids: Iterable[int]) -> TokenizerReport:
    """Check `tokenizer` against the byte table the grammar backends will use for a model of
    `model_vocab_size` logits; raise `ModelLoadError` with the reason and the fix if it fails."""
    t0 = time.perf_counter()
    stops = sorted(set(stop_token_ids))
    size = min(len(tokenizer), model_vocab_size)
    outside = [t for t in stops if not 0 <= t < model_vocab_size]
    if outside:
        raise ModelLoadError(f"stop token id {outside[0]} is outside the model's {model_vocab_size} logits; "
                             "fix eos_token_id in config.json / generation_config.json")
    table = token_bytes(tokenizer, size)  # the backends' own table (cached: built once)
    control = control_token_ids(tokenizer, size, stops)
    _check_token_bytes(tokenizer, table, control)
    _check_probe(tokenizer, table)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if has_template:
        _check_chat_template(tokenizer, control)
    return TokenizerReport(text_vocab_size=size, model_vocab_size=model_vocab_size, control_tokens=len(control),
                           has_chat_template=has_template, seconds=time.perf_counter() - t0)


def _anchor_id(tokenizer: Any, table: tuple[bytes, ...]) -> int:
    """A token spelled "a" that is a piece of its own (not a byte-fallback token, which the
    decoder would merge with the next one)."""
    for t, b in enumerate(table):
        if b == b"a" and tokenizer.convert_ids_to_tokens(t) == "a":
            return t
    raise ModelLoadError('the tokenizer has no token "a"; structgen checks tokenizers whose vocabulary '
                         "spells ASCII letters, pass a model with a byte-level BPE or SentencePiece tokenizer")


def _check_token_bytes(tokenizer: Any, table: tuple[bytes, ...], control: set[int]) -> None:
    """Every text token, decoded by the tokenizer after the anchor, reads as the table's bytes.
    The anchor keeps decoders that drop a leading space on the first token honest."""
    fast = getattr(tokenizer, "backend_tokenizer", None)
    if fast is None:
        raise ModelLoadError(f"{type(tokenizer).__name__} is not a fast tokenizer; structgen needs one "
                             "(a tokenizer.json next to the weights)")
    anchor = _anchor_id(tokenizer, table)
    ids = [t for t in range(len(table)) if t not in control]
    texts = fast.decode_batch([[anchor, t] for t in ids], skip_special_tokens=False)
    bad = [(t, text) for t, text in zip(ids, texts, strict=True)
           if (b"a" + table[t]).decode("utf-8", errors="replace") != text]
    if bad:
        shown = ", ".join(f"id {t} decodes to {text[1:]!r} but the grammar sees {table[t]!r}" for t, text in bad[:_SHOWN])
        raise ModelLoadError(
            f"{len(bad)} tokens' bytes disagree between the tokenizer and the grammar's byte table ({shown}); "
            "masks would allow the wrong text. Use the model's original tokenizer.json (a GGUF's rebuilt "
            "tokenizer may miss its pre-tokenizer or decoder)")


def _check_probe(tokenizer: Any, table: tuple[bytes, ...]) -> None:
    """A probe text's tokens spell it back through the table, and decode back to it."""
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    spelled = b"".join(table[t] if 0 <= t < len(table) else b"?" for t in ids)
    if spelled != PROBE_TEXT.encode() or tokenizer.decode(ids) != PROBE_TEXT:
        raise ModelLoadError(
            f"the tokenizer does not round-trip text: {PROBE_TEXT!r} encodes to tokens spelling {spelled!r}; "
            "its normalizer or pre-tokenizer changes text, so grammar masks would not match what it "
            "writes. Use the model's original tokenizer.json")


def _check_chat_template(tokenizer: Any, control: set[int]) -> None:
    """The template renders a conversation, and the added tokens it writes are control tokens:
    a turn marker the grammar took for text could be written inside a JSON string."""
    try:
        text = tokenizer.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template's own raise_exception or a Jinja error: both mean "broken"
        try:  # templates without a system role are fine
            text = tokenizer.apply_chat_template(PROBE_CHAT[1:], add_generation_prompt=True, tokenize=False)
        except Exception:
            raise ModelLoadError(f"the chat template fails to render a conversation ({e}); fix chat_template "
                                 "in tokenizer_config.json, or remove it and pass prompts as strings") from e
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = tokenizer.encode(text, add_special_tokens=False)
    leaked = sorted({t for t in ids if t in added and t not in control and added[t].content.strip()
                     and added[t].content in text and _looks_like_marker(added[t].content)})
    if leaked:
        names = ", ".join(repr(added[t].content) for t in leaked[:_SHOWN])
        raise ModelLoadError(f"the chat template writes {names}, which the tokenizer does not mark special, so "
                             "grammars would allow it as text; mark it \"special\": true in tokenizer.json's "
                             "added_tokens")


def _looks_like_marker(content: str) -> bool:
    """An added token shaped like a control marker (`<...>`, `[...]`), not added text such as
    Gemma's runs of newlines."""
    return len(content) > 2 and (content[0], content[-1]) in (("<", ">"), ("[", "]"))
