"""The public API's types, as an editor sees them: mypy checks tests/typing/usage.py, whose
`assert_type` lines say what `generate(Customer, ...)` and the rest must be inferred as."""

from __future__ import annotations

from pathlib import Path

import pytest

TYPING = Path(__file__).parent / "typing"


def test_mypy_infers_the_output_type_of_every_generation_method(tmp_path):
    mypy_api = pytest.importorskip("mypy.api", reason="mypy is in the dev extra; pip install mypy")
    args = ["--config-file", str(TYPING / "mypy.ini"), "--cache-dir", str(tmp_path), str(TYPING / "usage.py")]
    stdout, stderr, status = mypy_api.run(args)
    assert status == 0, stdout + stderr
