"""A regular (non-editable) install keeps the native paths: the native sources are package data
(structgen/csrc/), so an installed structgen builds the CPU grammar pool from its own copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent("""
    from pathlib import Path
    import structgen
    from structgen.engine.kernels import csrc_ext
    from structgen.grammar import native
    assert Path(structgen.__file__).is_relative_to(Path({venv!r})), structgen.__file__
    missing = [s for s in csrc_ext.SOURCES if not (csrc_ext.CSRC_DIR / s).is_file()]
    assert not missing, missing
    pool = native.load()
    assert pool is not None, "the native grammar pool did not build (see the warning above)"
    print("POOL_THREADS", pool.threads)
""")


@pytest.mark.slow
def test_a_regular_install_builds_the_native_grammar_pool_from_its_own_sources(tmp_path):
    """`pip install .` (not editable) of a clean copy of the sources into a fresh venv that reuses
    this machine's dependencies (its pip and setuptools too: no network); from outside the
    checkout, the installed package finds every native source and builds the grammar pool on
    the CPU (into an empty cache, so it really compiles)."""
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler on PATH: the native pool cannot build here")
    src = tmp_path / "src"  # a clean copy: no build/ or egg-info left from an earlier build
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in ("structgen", "structgen_server"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(src)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {**os.environ, "STRUCTGEN_CACHE": str(tmp_path / "cache"), "STRUCTGEN_GRAMMAR_THREADS": "2"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([python, "-c", CHECK.format(venv=str(venv))], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "POOL_THREADS 2" in run.stdout, run.stdout
