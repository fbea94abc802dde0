"""Safe reading and atomic writing of the YAML/JSON documents that pass between profiler, planner and decoder."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from core.errors import UserError


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc.__class__.__name__}") from None


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Load a YAML mapping with yaml.safe_load; every failure becomes a one-line UserError."""
    path = Path(path)
    text = _read_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}: malformed YAML{where}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a YAML mapping at the top level")
    return data


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Yield a handle to a temporary file next to `path`; rename it into place only on success.

    An exception (or Ctrl-C) inside the block removes the temporary file, so no partial output exists.
    """
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def plain(value: Any) -> Any:
    """Numpy scalars and arrays (and tuples) turned into the built-in types safe_dump and json accept."""
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, str) and type(value) is not str:
        return str(value)
    return value


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_yaml(path: str | os.PathLike, data: dict[str, Any]) -> None:
    text = yaml.safe_dump(plain(data), sort_keys=False, default_flow_style=None, width=120)
    with atomic_output(path) as handle:
        handle.write(text)


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """Load a JSON object; every failure becomes a one-line UserError."""
    path = Path(path)
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: malformed JSON at line {exc.lineno}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object at the top level")
    return data


def write_json(path: str | os.PathLike, data: Any, indent: int | None = 2) -> None:
    with atomic_output(path) as handle:
        json.dump(plain(data), handle, indent=indent)
        handle.write("\n")
