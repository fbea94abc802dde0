"""Prompt datasets: Spec-Bench's question.jsonl (with a category filter), other JSONL files, plain text files.

`--dataset` takes a path or one of the sets the project carries (data/README.md), by short name."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specplan.core.errors import UserError

DEMO_PROMPTS = Path(str(resources.files("specplan") / "prompts" / "demo.jsonl"))
DATA_DIR = Path(str(resources.files("specplan.data")))  # data/ in a checkout, specplan/data in a wheel
DATASETS = {"specbench": DATA_DIR / "specbench" / "question.jsonl", "haystack": DATA_DIR / "haystack"}


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def resolve_dataset(spec: str | os.PathLike) -> tuple[Path, str | None]:
    """`NAME[:categories]` or `PATH[:categories]` -> (path, categories); a path that exists as given wins over a
    category suffix, and a path over a short name."""
    spec = str(spec)
    if os.path.exists(spec):
        return Path(spec), None
    name, category = spec.rsplit(":", 1) if ":" in spec else (spec, "")
    if os.path.exists(name):
        return Path(name), category or None
    if name in DATASETS:
        if not DATASETS[name].exists():
            raise UserError(f"dataset {name!r}: this install lacks the carried data ({DATASETS[name]})")
        return DATASETS[name], category or None
    raise UserError(f"unknown dataset {name!r}: no such file or folder, and not one of the carried sets "
                    f"({', '.join(DATASETS)}; see data/README.md)")


def read_dataset(spec: str) -> list[Prompt]:
    path, category = resolve_dataset(spec)
    if path.is_dir():
        if (path / "question.jsonl").is_file():
            path = path / "question.jsonl"
        else:
            texts = sorted(path.glob("*.txt"))
            if not texts:
                raise UserError(f"{path}: no question.jsonl and no .txt files")
            prompts = [Prompt(p.stem, "text", p.read_text(errors="replace")) for p in texts]
            return _filter(prompts, category, path)
    if path.suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                turns = record.get("turns") or [record.get("prompt") or record.get("text")]
                text = turns[0]
                if not isinstance(text, str):
                    raise TypeError
            except (json.JSONDecodeError, TypeError, AttributeError, IndexError):
                raise UserError(f"{path}:{number}: expected a JSON object with 'turns' (or 'prompt'/'text')") from None
            prompts.append(Prompt(str(record.get("question_id", number)), str(record.get("category", "default")),
                                  text))
        return _filter(prompts, category, path)
    return _filter([Prompt(path.stem, "text", path.read_text(errors="replace"))], category, path)


def _filter(prompts: list[Prompt], category: str | None, path: Path) -> list[Prompt]:
    if category is None:
        return prompts
    wanted = set(category.split(","))
    known = {p.category for p in prompts}
    unknown = wanted - known
    if unknown:
        raise UserError(f"{path}: no category {', '.join(sorted(unknown))} (it has {', '.join(sorted(known))})")
    return [p for p in prompts if p.category in wanted]


def spread_sample(prompts: list[Prompt], count: int | None) -> list[Prompt]:
    """The first `count` prompts taken round-robin across categories (deterministic)."""
    if count is None or count >= len(prompts):
        return prompts
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    queues = list(by_category.values())
    out: list[Prompt] = []
    while len(out) < count:
        for queue in queues:
            if queue and len(out) < count:
                out.append(queue.pop(0))
    return out
