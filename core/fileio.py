"""Safe reading and atomic writing of the YAML/JSON documents that pass between profiler, planner and decoder."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from specplan.core.errors import UserError


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc.__class__.__name__}") from None


# Bounds on what a document may hold. specplan's own files nest at most 6 deep, never use anchors or aliases, and
# keep every number finite and every integer well inside int64 (token ids, sizes, contexts).
MAX_DOCUMENT_BYTES = 256 << 20
MAX_DEPTH = 32
MAX_NODES = 20_000_000
MAX_INTEGER = 2**53  # exact in float64, and far beyond any count, length or token id
MAX_STRING_CHARS = 1 << 16  # free-form text (a note, a command line); names are bounded tighter (core.validate)


# libyaml's parser where PyYAML was built with it (the pure-Python one is about 7x slower on a 180 KB acceptance file)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _check_events(text: str) -> None:
    """Refuse anchors and aliases and bound the nesting depth, from the parser's flat event stream, before anything
    is composed. An alias is how a YAML file builds a cycle (`&a [*a]`) or an exponential "billion laughs"
    expansion, and specplan never writes one; the composer recurses once per nesting level, so deep nesting is refused
    before it can exhaust a stack."""
    depth = 0
    for event in yaml.parse(text, Loader=_SAFE_LOADER):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused("anchors and aliases (& and *) are not allowed", event.start_mark)
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise _Refused(f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


class _Refused(Exception):
    def __init__(self, message: str, mark: Any) -> None:
        super().__init__(message)
        self.line = mark.line + 1 if mark is not None else None


def field_name(path: list[Any]) -> str:
    """`target.contexts.512.t_seconds[2]` for a path of mapping keys and list positions."""
    text = ""
    for part in path:
        text += f"[{int(part)}]" if isinstance(part, _Index) else f"{'.' if text else ''}{shown(part, quote=False)}"
    return text or "<document>"


class _Index(int):
    """A list position in a field path (printed as [i], where a mapping key is printed as .key)."""


def shown(value: Any, limit: int = 60, quote: bool = True) -> str:
    """A user's value for an error line: its repr, cut short (a 1 MB string must not become a 1 MB line)."""
    text = repr(value) if quote or not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_plain_values(data: Any, where: str) -> None:
    """Refuse anything in a loaded document that no specplan format holds, naming the field: keys other than
    strings and integers, dates, binary, sets, non-finite numbers, integers beyond MAX_INTEGER, strings that are
    not valid Unicode (a lone surrogate), and documents of more than MAX_NODES values. Iterative: no recursion."""
    stack: list[tuple[Any, list[Any]]] = [(data, [])]
    nodes = 0
    while stack:
        value, path = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise UserError(f"{where}: more than {MAX_NODES} values")
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise UserError(f"{where}: {field_name(path)} has a key {shown(key)}: keys are names or integers")
                if isinstance(key, str):
                    _check_string(key, where, path)
                stack.append((item, path + [key]))
        elif isinstance(value, list):
            stack.extend((item, path + [_Index(i)]) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_string(value, where, path)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if abs(value) > MAX_INTEGER:
                raise UserError(f"{where}: {field_name(path)}: integer {shown(value)} is out of range")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise UserError(f"{where}: {field_name(path)}: must be finite, got {value}")
        else:
            raise UserError(f"{where}: {field_name(path)}: a {type(value).__name__} is not a value specplan reads")


def _check_string(text: str, where: str, path: list[Any]) -> None:
    if len(text) > MAX_STRING_CHARS:
        raise UserError(f"{where}: {field_name(path)}: a string of {len(text)} characters; at most {MAX_STRING_CHARS}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{where}: {field_name(path)}: a string that is not valid Unicode") from None


def _yaml_problem(exc: yaml.reader.ReaderError) -> str:
    """What yaml's reader refused, without the file's contents: e.g. 'non-printable character #x07 at position 16'."""
    code = exc.character if isinstance(exc.character, int) else ord(exc.character)
    return f"non-printable character #x{code:02x} at position {exc.position}"


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Load a YAML mapping safely and within bounds (see _check_events, check_plain_values); every failure
    becomes a one-line UserError naming the file."""
    path = Path(path)
    with contextlib.suppress(OSError):
        if path.stat().st_size > MAX_DOCUMENT_BYTES:
            raise UserError(f"{path}: larger than {MAX_DOCUMENT_BYTES >> 20} MiB; not a specplan file")
    text = read_text(path)
    try:
        _check_events(text)
        data = yaml.load(text, Loader=_SAFE_LOADER)  # a safe loader: plain values only
    except _Refused as exc:
        raise UserError(f"{path}: {exc} (line {exc.line})") from None
    except yaml.reader.ReaderError as exc:
        raise UserError(f"{path}: malformed YAML ({_yaml_problem(exc)})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}: malformed YAML{where}") from None
    except (RecursionError, MemoryError):
        raise UserError(f"{path}: too deeply nested or too large") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a YAML mapping at the top level")
    check_plain_values(data, str(path))
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
    text = yaml.dump(plain(data), Dumper=_SAFE_DUMPER, sort_keys=False, default_flow_style=None, width=120)
    with atomic_output(path) as handle:
        handle.write(text)


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """Load a JSON object; every failure becomes a one-line UserError."""
    path = Path(path)
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: malformed JSON at line {exc.lineno}") from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object at the top level")
    return data


def write_json(path: str | os.PathLike, data: Any, indent: int | None = 2) -> None:
    with atomic_output(path) as handle:
        json.dump(plain(data), handle, indent=indent)
        handle.write("\n")
