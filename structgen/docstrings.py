"""Tool descriptions from docstrings: the description (the text before the first section) and
each parameter's description, from Google (`Args:`), NumPy (`Parameters` underlined) and Sphinx
(`:param x:`) docstrings."""

from __future__ import annotations

import re

_PARAM_SECTIONS = {"args", "arguments", "parameters", "params", "keyword args", "keyword arguments", "other parameters"}
_SECTIONS = _PARAM_SECTIONS | {"returns", "return", "yields", "raises", "examples", "example", "notes", "note",
                               "attributes", "see also", "warnings", "warning", "references"}
_SPHINX_FIELD = re.compile(r":(param|parameter|arg|argument|key|keyword|type|returns?|rtype|raises?)\b")
_GOOGLE_ENTRY = re.compile(r"(?P<name>\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<desc>.*)")
_NUMPY_ENTRY = re.compile(r"(?P<name>\w+)(?:\s*:.*)?")
_SPHINX_ENTRY = re.compile(r":(?:param|parameter|arg|argument|key|keyword)\s+(?:[^:]*\s)?(?P<name>\w+)\s*:\s*(?P<desc>.*)")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The description (the text before the first section) and the parameter descriptions of
    a Google (`Args:`), NumPy (`Parameters` underlined) or Sphinx (`:param x:`) docstring."""
    lines = doc.splitlines()
    starts = [i for i in range(len(lines)) if _is_section(lines, i)]
    args: dict[str, str] = {}
    for i in starts:
        head = lines[i].strip()
        if head.startswith(":"):
            args.update(_entries(lines[i:], _SPHINX_ENTRY))
        elif head.rstrip(":").lower() in _PARAM_SECTIONS:
            args.update(_entries(lines[i + 1:], _GOOGLE_ENTRY) if head.endswith(":") else _entries(lines[i + 2:], _NUMPY_ENTRY))
    return "\n".join(lines[: starts[0] if starts else len(lines)]).strip(), args


def _is_section(lines: list[str], i: int) -> bool:
    head = lines[i].strip()
    underlined = i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"}
    return (bool(_SPHINX_FIELD.match(head)) or (head.endswith(":") and head[:-1].lower() in _SECTIONS)
            or (underlined and head.lower() in _SECTIONS))


def _entries(lines: list[str], entry: re.Pattern[str]) -> dict[str, str]:
    """`name: description` entries: an entry starts at the first line's indent and deeper
    lines continue it; a shallower line, or one that is no entry, ends the section."""
    out: dict[str, list[str]] = {}
    base, current = None, None
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        base = indent if base is None else base
        if indent > base and current is not None:
            out[current].append(line.strip())
            continue
        m = entry.fullmatch(line.strip()) if indent == base else None
        if m is None:
            break
        current = m["name"]
        out[current] = [m.groupdict().get("desc") or ""]
    return {name: " ".join(p for p in parts if p) for name, parts in out.items()}
