"""A `plan bench` report's rates over two subsets of its prompts: the first N and the rest.

A plan's acceptance is measured on a dataset's first prompts; a bench over more prompts than that holds the
rest out. This prints decode tokens/s, tokens/step, HF identity and the ratios between methods for each part:

    python bench/prompt_subsets.py reports/bench.json --seen 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def subset_lines(rows: list[dict], label: str) -> list[str]:
    names = list(rows[0]["methods"])
    entries = {name: [row["methods"][name] for row in rows] for name in names}
    rate = {name: sum(e["decode_tokens"] for e in found) / sum(e["decode_seconds"] for e in found)
            for name, found in entries.items()}
    lines = [f"{label} ({', '.join(row['id'] for row in rows)}):"]
    for name, found in entries.items():
        facts = [f"{rate[name]:6.2f} tok/s"]
        if all("steps" in e for e in found):
            facts.append(f"{sum(e['new_tokens'] for e in found) / sum(e['steps'] for e in found):.2f} tokens/step")
        if all("identical_to_hf" in e for e in found):
            facts.append(f"identical to hf {sum(bool(e['identical_to_hf']) for e in found)}/{len(found)}")
        ratios = "  ".join(f"vs {other} {rate[name] / rate[other]:.2f}x" for other in names if other != name)
        lines.append(f"  {name:10s} {', '.join(facts)}   {ratios}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--seen", type=int, required=True, help="prompts the plan's acceptance run used")
    args = parser.parse_args()
    rows = json.loads(args.report.read_text())["per_prompt"]
    parts = (("seen by the acceptance run", rows[:args.seen]), ("held out", rows[args.seen:]), ("all", rows))
    for label, part in parts:
        if part:
            print("\n".join(subset_lines(part, label)))


if __name__ == "__main__":
    main()
