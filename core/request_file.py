"""A requests file (`plan generate --requests F.jsonl`): one JSON object per line, each a request decoded with the
others. A line that is not a valid request is that request's failure alone, named by its line number."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specplan.core.errors import UserError
from specplan.core.fileio import MAX_STRING_CHARS, read_text

# The fields a request line may set; any other field is echoed back with its output.
REQUEST_FIELDS = ("prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed")
MAX_REQUEST_LINES = 100_000
MAX_PROMPT_CHARS = 64 * MAX_STRING_CHARS  # a long-context prompt (128K tokens is about 512K characters)


@dataclass
class RequestLine:
    line: int  # 1-based line number in the file
    prompt: str
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the line's other fields, echoed back


@dataclass
class BadLine:
    line: int
    error: str


def _field(data: dict[str, Any], name: str, kind: type, low: float, high: float) -> Any:
    value = data.get(name)
    if value is None:
        return None
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not numeric or (kind is int and not float(value).is_integer()) or not math.isfinite(value):
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")
    return kind(value)


def parse_request(line: int, text: str) -> RequestLine | BadLine:
    try:
        data = json.loads(text, parse_constant=lambda name: float("nan"))
    except json.JSONDecodeError as exc:
        return BadLine(line, f"not a JSON object ({exc.msg})")
    if not isinstance(data, dict):
        return BadLine(line, "not a JSON object")
    prompt = data.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        return BadLine(line, 'no "prompt" string')
    if len(prompt) > MAX_PROMPT_CHARS:
        return BadLine(line, f"the prompt is longer than {MAX_PROMPT_CHARS} characters")
    try:
        return RequestLine(line, prompt, _field(data, "max_new_tokens", int, 1, 2**31),
                           _field(data, "temperature", float, 0.0, 100.0), _field(data, "top_p", float, 1e-9, 1.0),
                           _field(data, "top_k", int, 0, 2**31), _field(data, "seed", int, 0, 2**63 - 1),
                           {key: value for key, value in data.items() if key not in REQUEST_FIELDS})
    except ValueError as exc:
        return BadLine(line, str(exc))


def load_requests(path: Path) -> list[RequestLine | BadLine]:
    """Every non-blank line's request or its failure; an unreadable or empty file is an error."""
    text = read_text(path)
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise UserError(f"{path}: no requests (one JSON object per line)")
    if len(lines) > MAX_REQUEST_LINES:
        raise UserError(f"{path}: more than {MAX_REQUEST_LINES} requests")
    return [parse_request(number, line) for number, line in lines]
