"""The user guide stays true: every ```python block of docs/guide/*.md (and docs/index.md) runs, page by page, in
order, in one namespace per page, on the real default model; and the site builds with
`mkdocs build --strict`.

Markers (HTML comments, invisible on the site):
- `<!-- skip: REASON -->` on the line(s) just above a block: the block is not run (GPU-only,
  or API pending a merge); REASON must say why.
- `<!-- llm: shared -->` anywhere in a page: its namespace starts with `llm`, one
  `structgen.LLM()` shared by all pages (the page says in prose what `llm` is).
Blocks that talk to `http://127.0.0.1:8000` run against a real `structgen serve` on a free
port (the `server_url` fixture); the address in the text is replaced by that server's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide"
DOC_SERVER = "http://127.0.0.1:8000"
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SKIP = re.compile(r"<!--\s*skip:\s*(.*?)\s*-->\s*$")


@dataclass
class CodeBlock:
    """One ```python block of a page: its code, line number, and why it is skipped (or None)."""

    code: str
    line: int
    skip_reason: str | None


def code_blocks(text: str) -> list[CodeBlock]:
    """The python blocks of a markdown page, each with the skip marker just above it."""
    blocks = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").splitlines()
        marker = _SKIP.search(before[-1]) if before else None
        line = text.count("\n", 0, m.start()) + 2
        blocks.append(CodeBlock(m.group(1), line, marker.group(1) if marker else None))
    return blocks


def guide_pages() -> list[Path]:
    return sorted(GUIDE.glob("*.md"))


def pages_with_code() -> list[Path]:
    """The guide and the site's home page (its example is the first code a reader sees)."""
    return [ROOT / "docs" / "index.md", *guide_pages()]


@pytest.fixture(scope="module")
def shared_llm():
    import structgen

    return structgen.LLM()


def test_code_blocks_are_found_with_their_skip_markers():
    text = "a\n```python\nx = 1\n```\n<!-- skip: needs a GPU -->\n```python\ny = 2\n```\n"
    blocks = code_blocks(text)
    assert [(b.code, b.skip_reason) for b in blocks] == [("x = 1\n", None), ("y = 2\n", "needs a GPU")]


@pytest.mark.parametrize("page", pages_with_code(), ids=lambda p: p.stem)
def test_every_code_block_of_the_guide_runs(page: Path, request: pytest.FixtureRequest):
    text = page.read_text()
    blocks = code_blocks(text)
    # A real module: dataclasses and pydantic look classes' modules up in sys.modules.
    module = types.ModuleType(f"guide_{page.stem.replace('-', '_')}")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    if "<!-- llm: shared -->" in text:
        namespace["llm"] = request.getfixturevalue("shared_llm")
    ran = 0
    for block in blocks:
        if block.skip_reason is not None:
            assert block.skip_reason, f"{page.name}:{block.line}: a skip marker needs a reason"
            continue
        code = block.code
        if DOC_SERVER in code:
            code = code.replace(DOC_SERVER, request.getfixturevalue("server_url").removesuffix("/v1"))
        try:
            exec(compile(code, f"{page.name}:{block.line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page.name}, block at line {block.line} failed: {e!r}") from e
        ran += 1
    if blocks and not ran:
        pytest.skip(f"every code block of {page.name} is marked skip")


def test_every_guide_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in guide_pages() if f"guide/{p.name}" not in nav]
    assert not missing, f"add these pages to mkdocs.yml nav: {missing}"


def test_the_site_builds_with_mkdocs_strict(tmp_path: Path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install mkdocs)")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "guide" / "getting-started" / "index.html").is_file()
