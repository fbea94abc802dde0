"""How files name a model, and when two names are the same model (importable without torch)."""

from __future__ import annotations

from pathlib import Path

from specplan.core.choices import PRESET_MODELS, TINY_MODEL_PREFIX


def model_name(source: str) -> str:
    """A preset or a tiny test model by its own name; a local .gguf file, Hugging Face directory or config.json by
    its resolved path, so that the files made from one model agree however its path was typed, and a plan finds its
    models from any directory."""
    if source in PRESET_MODELS or source.startswith(TINY_MODEL_PREFIX):
        return source
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two files' model names (or a user's and a file's) name the same model."""
    return a is not None and b is not None and model_name(a) == model_name(b)
