"""A `plan bench` report's table over two subsets of its prompts: the first N and the rest.

A plan's acceptance is measured on a dataset's first prompts; a bench over more prompts than that holds the
rest out. This prints the report's table for each part:

    python bench/prompt_subsets.py reports/bench.json --seen 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specplan.bench import markdown_table, summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--seen", type=int, required=True, help="prompts the plan's acceptance run used")
    args = parser.parse_args()
    report = json.loads(args.report.read_text())
    rows = report["per_prompt"]
    for label, part in (("seen by the acceptance run", rows[:args.seen]), ("held out", rows[args.seen:])):
        if part:
            names = list(part[0]["methods"])
            print(f"{label}: {', '.join(row['id'] for row in part)}")
            print(markdown_table({**report, "prompts": len(part), "summary": summarize(part, names),
                                  "prediction": {}}) + "\n")


if __name__ == "__main__":
    main()
