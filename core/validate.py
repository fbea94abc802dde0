"""Field checks shared by the schema modules; each failure is a one-line UserError naming file and field."""

from __future__ import annotations

import math
from typing import Any

from specplan.core.errors import UserError
from specplan.core.fileio import shown

# Ranges a specplan file's numbers must lie in. Token counts (tree sizes n, context lengths, budgets) stop at
# 2^24, beyond any model's context; times at a day per forward; both keep every solver's loops and
# interpolations finite.
MAX_TOKENS = 1 << 24
MAX_FORWARD_TOKENS = 1 << 16  # new tokens n in one forward (a profile's t(n) keys): far above any draft tree
MAX_SECONDS = 86_400.0
MAX_VOCABULARY = 1 << 24  # token ids are int32 in every engine; the largest vocabularies hold ~262k
MAX_NAME_CHARS = 4096  # a name, a dtype, a path: PATH_MAX
# The version of specplan's file formats (plans, profiles, acceptance files), written as `version:` after `kind:`.
# A change a reader of the current version cannot read raises it; the loaders read every older version.
FORMAT_VERSION = 1


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
        """The file's kind, one of `expected`, after its format version (see `version`)."""
        kind = self.data.get("kind")
        allowed = (expected,) if isinstance(expected, str) else expected
        if kind not in allowed:
            raise self.fail(f"kind is {shown(kind)}, expected {' or '.join(repr(k) for k in allowed)}")
        self.version()
        return kind

    def version(self) -> int:
        """The file format's version: every specplan file carries one; a file written before versions were recorded
        reads as version 1, and one newer than FORMAT_VERSION (a newer specplan's) is refused."""
        if not self.has("version"):
            return 1
        version = self.integer("version", low=1)
        if version > FORMAT_VERSION:
            raise self.fail(f"format version {version} is newer than this specplan reads ({FORMAT_VERSION}): "
                            "upgrade specplan")
        return version

    def number(self, key: str, *, required: bool = True, low: float | None = None, high: float | None = None,
               default: float | None = None) -> float | None:
        if not self.has(key):
            if required:
                raise self.fail(f"missing field '{key}'")
            return default
        return check_number(self.data[key], f"{self.where}: {key}", low, high)

    def integer(self, key: str, *, required: bool = True, low: int | None = None, high: int | None = None,
                default: int | None = None) -> int | None:
        if not self.has(key):
            if required:
                raise self.fail(f"missing field '{key}'")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"'{key}' must be an integer, got {shown(value)}")
        if low is not None and value < low:
            raise self.fail(f"'{key}' must be >= {low}, got {value}")
        if high is not None and value > high:
            raise self.fail(f"'{key}' must be <= {high}, got {value}")
        return value

    def seconds(self, key: str, *, required: bool = True) -> float | None:
        """A time: positive (a zero time would promise an infinite speedup), finite, at most MAX_SECONDS."""
        value = self.number(key, required=required, low=0.0, high=MAX_SECONDS)
        if value is not None and value <= 0:
            raise self.fail(f"'{key}' must be > 0, got {value}")
        return value

    def token_count(self, key: str, *, required: bool = True, low: int = 1, default: int | None = None
                    ) -> int | None:
        return self.integer(key, required=required, low=low, high=MAX_TOKENS, default=default)

    def by_token_count(self, key: str) -> dict[int, Fields]:
        """A mapping keyed by token counts (contexts: {4096: {...}}), each value a mapping, in key order."""
        section = self.sub(key)
        entries = {token_count_key(k, section.where): Fields(v, f"{section.where}: {k}")
                   for k, v in section.data.items()}
        return dict(sorted(entries.items()))

    def by_token_count_numbers(self, key: str, **checks) -> dict[int, dict[int, float]]:
        """A mapping keyed by token counts whose values are `int_keyed_numbers` mappings ({4: {1: 0.002}}), in key
        order; `checks` as int_keyed_numbers takes them."""
        section = self.sub(key)
        return dict(sorted((token_count_key(k, section.where), section.int_keyed_numbers(k, **checks))
                           for k in section.data))

    def string(self, key: str, *, required: bool = True, default: str | None = None,
               choices: tuple[str, ...] | None = None) -> str | None:
        if not self.has(key):
            if required:
                raise self.fail(f"missing field '{key}'")
            return default
        value = self.data[key]
        if not isinstance(value, str):
            raise self.fail(f"'{key}' must be a string, got {shown(value)}")
        if len(value) > MAX_NAME_CHARS:
            raise self.fail(f"'{key}' is {len(value)} characters long; at most {MAX_NAME_CHARS}")
        if choices is not None and value not in choices:
            raise self.fail(f"'{key}' must be one of {', '.join(choices)}, got {shown(value)}")
        return value

    def boolean(self, key: str, *, default: bool | None) -> bool | None:
        if not self.has(key):
            return default
        value = self.data[key]
        if not isinstance(value, bool):
            raise self.fail(f"'{key}' must be true or false, got {shown(value)}")
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

    def int_keyed_numbers(self, key: str, *, low: float | None = None, high: float | None = None,
                          seconds: bool = False, max_key: int = MAX_TOKENS) -> dict[int, float]:
        """A mapping like {1: 0.035, 16: 0.07}, keyed by token counts (YAML may give the keys as ints or digit
        strings); `seconds`: every value a time (see `seconds`)."""
        if not self.has(key):
            raise self.fail(f"missing field '{key}'")
        raw = self.data[key]
        if not isinstance(raw, dict) or not raw:
            raise self.fail(f"'{key}' must be a non-empty mapping of integers to numbers")
        out: dict[int, float] = {}
        for k, v in raw.items():
            n = token_count_key(k, f"{self.where}: {key}", max_key)
            value = check_number(v, f"{self.where}: {key}[{k}]", 0.0 if seconds else low,
                                 MAX_SECONDS if seconds else high)
            if seconds and value <= 0:
                raise UserError(f"{self.where}: {key}[{k}]: must be > 0, got {value}")
            out[n] = value
        return dict(sorted(out.items()))


def token_count_key(key: object, where: str, high: int = MAX_TOKENS) -> int:
    """A mapping key that counts tokens: an integer (or its digits) in [1, high]."""
    if isinstance(key, bool) or not isinstance(key, (int, str)) or not str(key).isdigit():
        raise UserError(f"{where}: key {shown(key)} is not a positive integer")
    value = int(key)
    if not 1 <= value <= high:
        raise UserError(f"{where}: key {value} is outside [1, {high}]")
    return value


def check_number(value: Any, where: str, low: float | None = None, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: expected a number, got {shown(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise UserError(f"{where}: must be finite, got {value}")
    if low is not None and value < low:
        raise UserError(f"{where}: must be >= {low}, got {value}")
    if high is not None and value > high:
        raise UserError(f"{where}: must be <= {high}, got {value}")
    return value
