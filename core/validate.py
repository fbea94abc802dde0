"""Field checks shared by the schema modules; each failure is a one-line UserError naming file and field."""

from __future__ import annotations

import math
from typing import Any

from core.errors import UserError


class Fields:
    """Reads typed fields out of a loaded YAML mapping, prefixing errors with where the mapping came from."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise UserError(f"{where}: expected a mapping")
        self.data = data
        self.where = where

    def fail(self, message: str) -> UserError:
        return UserError(f"{self.where}: {message}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def sub(self, key: str, required: bool = True) -> Fields | None:
        if not self.has(key):
            if required:
                raise self.fail(f"missing field '{key}'")
            return None
        return Fields(self.data[key], f"{self.where}: {key}")

    def kind(self, expected: str | tuple[str, ...]) -> str:
        kind = self.data.get("kind")
        allowed = (expected,) if isinstance(expected, str) else expected
        if kind not in allowed:
            raise self.fail(f"kind is {kind!r}, expected {' or '.join(repr(k) for k in allowed)}")
        return kind

    def number(self, key: str, *, required: bool = True, low: float | None = None, high: float | None = None,
               default: float | None = None) -> float | None:
        if not self.has(key):
            if required:
                raise self.fail(f"missing field '{key}'")
            return default
        return check_number(self.data[key], f"{self.where}: {key}", low, high)

    def integer(self, key: str, *, required: bool = True, low: int | None = None, default: int | None = None
                ) -> int | None:
        if not self.has(key):
            if required:
                raise self.fail(f"missing field '{key}'")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"'{key}' must be an integer, got {value!r}")
        if low is not None and value < low:
            raise self.fail(f"'{key}' must be >= {low}, got {value}")
        return value

    def string(self, key: str, *, required: bool = True, default: str | None = None) -> str | None:
        if not self.has(key):
            if required:
                raise self.fail(f"missing field '{key}'")
            return default
        value = self.data[key]
        if not isinstance(value, str):
            raise self.fail(f"'{key}' must be a string, got {value!r}")
        return value

    def boolean(self, key: str, *, default: bool) -> bool:
        if not self.has(key):
            return default
        value = self.data[key]
        if not isinstance(value, bool):
            raise self.fail(f"'{key}' must be true or false, got {value!r}")
        return value

    def number_list(self, key: str, *, required: bool = True, low: float | None = None,
                    high: float | None = None) -> list[float] | None:
        if not self.has(key):
            if required:
                raise self.fail(f"missing field '{key}'")
            return None
        values = self.data[key]
        if not isinstance(values, list):
            raise self.fail(f"'{key}' must be a list of numbers")
        return [check_number(v, f"{self.where}: {key}[{i}]", low, high) for i, v in enumerate(values)]

    def int_keyed_numbers(self, key: str, *, low: float | None = None) -> dict[int, float]:
        """A mapping like {1: 0.035, 16: 0.07} (YAML may give the keys as ints or digit strings)."""
        if not self.has(key):
            raise self.fail(f"missing field '{key}'")
        raw = self.data[key]
        if not isinstance(raw, dict) or not raw:
            raise self.fail(f"'{key}' must be a non-empty mapping of integers to numbers")
        out: dict[int, float] = {}
        for k, v in raw.items():
            try:
                n = int(k)
            except (TypeError, ValueError):
                raise self.fail(f"'{key}' has a non-integer key {k!r}") from None
            out[n] = check_number(v, f"{self.where}: {key}[{k}]", low, None)
        return dict(sorted(out.items()))


def check_number(value: Any, where: str, low: float | None = None, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: expected a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise UserError(f"{where}: must be finite, got {value}")
    if low is not None and value < low:
        raise UserError(f"{where}: must be >= {low}, got {value}")
    if high is not None and value > high:
        raise UserError(f"{where}: must be <= {high}, got {value}")
    return value
