"""Mutation fuzzer over every file format specplan reads, run through every command that reads it.

Each committed plan, profile and acceptance file is mutated (a structural change to the parsed document, or a
textual one: deep nesting, an alias bomb or cycle, a truncation, a flipped character), written to a scratch
directory, and given to the commands that read its format: `show`, `show --plot`, `show --compare`, `export`,
`solve sequoia|lookahead|triforce`. A run is clean when it exits 0, or exits 2 with one short stderr line; it
fails on a traceback, a run past the time limit, a temporary file left behind, or a written file that the
project's own loader rejects.

    .venv/bin/python tests/fuzz.py --files 1500 --seed 1      # the full run (BENCHMARKS.md)

tests/test_fuzz.py runs a CI-sized sample through the same code.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
TIME_LIMIT_SECONDS = 10
MAX_ERROR_LINE = 400  # one readable line, never the user's megabyte echoed back

SEQUOIA_ACCEPTANCE = "acceptance/qwen2.5-coder-1.5b+0.5b.sequoia.specbench.t0.bf16.yaml"
SEQUOIA_PROFILE = "profiles/qwen2.5-coder-1.5b+0.5b.cpu-2c.bf16.yaml"
LOOKAHEAD_ACCEPTANCE = "acceptance/smollm2-135m.lookahead.specbench-sum-rag-code.fp32.yaml"
LOOKAHEAD_PROFILE = "profiles/smollm2-135m.cpu-2c.fp32.yaml"
TRIFORCE_ACCEPTANCE = "acceptance/smollm2-135m.triforce.haystack.fp32.yaml"
TRIFORCE_PROFILE = "profiles/smollm2-135m.cpu-2c.fp32-7680.yaml"
SOLVE_SEQUOIA = ["solve", "sequoia", "--max-size", "32", "--max-depth", "8"]
SOLVE_LOOKAHEAD = ["solve", "lookahead", "--decoding-lengths", "4,16", "--branch-lengths", "2,8"]
SOLVE_TRIFORCE = ["solve", "triforce"]
# an engine's n-gram knobs, a small grid each: the replays stay within the time limit on a slow 2-core host
LOOKUP_GRIDS = {"sglang": ["--draft-lengths", "4", "--bfs-breadths", "2", "--trie-depths", "6", "--match-types", "BFS"],
                **{engine: ["--max-ngrams", "2", "--draft-lengths", "4"] for engine in ("hf", "llama.cpp", "vllm")}}

ODD_VALUES: list[Any] = [
    None, "4k", "", "null", -1, 0, 1, 2, 10**7, 2**63, 2**64, -(2**63) - 1, 1e308, -1e308, 1e-320, float("nan"),
    float("inf"), True, False, [], {}, [1, 2, 3], {"a": 1}, [[1, 2], [3]], 0.5, -0.5, 123, "x" * 200_000,
    "\ud800", "é\u202e", "plan/sequoia", "acceptance/triforce", "profile", "trie", "streaming",
]
ODD_KEYS: list[Any] = ["4k", None, 10**7, -1, 0, "0", "1e3", 2**64, "kind", "context", 1.5]


@dataclass
class Outcome:
    command: str
    file: str
    mutation: str
    verdict: str  # ok | rejected | crash | hang | partial | invalid-output | bad-message
    detail: str = ""


class _Timeout(BaseException):
    pass


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into the document, lists sampled (a trace holds thousands of numbers)."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index in sorted(random.sample(range(len(value)), min(3, len(value)))):
            out += _paths(value[index], prefix + (index,))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


PLACEHOLDER = "FUZZ_PLACEHOLDER_VALUE"


def _deep_nesting(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _alias_bomb(levels: int) -> str:
    layers = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    layers += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(layers) + "]"


TEXT_SNIPPETS = {
    "deep-nesting": lambda: _deep_nesting(1000),
    "deep-mapping": lambda: "{a: " * 300 + "1" + "}" * 300,
    "alias-bomb": lambda: _alias_bomb(9),
    "self-alias": lambda: "&loop [1, *loop]",
    "self-alias-map": lambda: "&loop {a: *loop}",
    "surrogate": lambda: '"\\ud800"',
    "big-int": lambda: "123456789012345678901234567890",
    "binary-tag": lambda: "!!binary aGVsbG8=",
    "python-tag": lambda: "!!python/object/apply:os.system ['true']",
    "timestamp": lambda: "2026-11-25",
    "set-tag": lambda: "!!set {a, b}",
}


def mutate(text: str, rng: random.Random, as_json: bool = False) -> tuple[str, str]:
    """One mutation of a YAML (or, `as_json`, JSON) document's text: (mutated text, its name)."""
    doc = yaml.safe_load(text)
    random.seed(rng.random())
    paths = _paths(doc)
    path = rng.choice(paths)
    choice = rng.random()
    if choice < 0.08:
        cut = rng.randrange(len(text))
        return text[:cut], f"truncate@{cut}"
    if choice < 0.14:
        index = rng.randrange(len(text))
        char = rng.choice(":-[]{}&*!|>'\"%@`\t\n# ")
        return text[:index] + char + text[index + 1:], f"flip@{index}"
    if choice < 0.30 and path:
        name = rng.choice(list(TEXT_SNIPPETS))
        doc = _set(doc, path, PLACEHOLDER)
        dumped = yaml.safe_dump(doc, sort_keys=False, width=120)
        return dumped.replace(PLACEHOLDER, TEXT_SNIPPETS[name](), 1), f"{name}@{_name(path)}"
    if choice < 0.40 and path and isinstance(_get(doc, path[:-1]), dict):
        parent = _get(doc, path[:-1])
        if rng.random() < 0.5:
            del parent[path[-1]]
            label = f"delete@{_name(path)}"
        else:
            key = rng.choice(ODD_KEYS)
            parent[key] = parent.pop(path[-1])
            label = f"rename@{_name(path)}->{key!r}"
        return _dump(doc, as_json), label
    if choice < 0.50:
        numbers = [p for p in paths if p and isinstance(_get(doc, p), int) and not isinstance(_get(doc, p), bool)]
        siblings = [p for p in numbers if any(q != p and q[:-1] == p[:-1] for q in numbers)]
        if siblings:
            first = rng.choice(siblings)
            second = rng.choice([q for q in numbers if q != first and q[:-1] == first[:-1]])
            doc = _set(doc, first, _get(doc, second))
            return _dump(doc, as_json), f"copy@{_name(second)}->{_name(first)}"
    if choice < 0.58:
        value = _get(doc, path)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scaled = rng.choice([0, -value, value * 1000, value + 1, value - 1, value / 3])
            return _dump(_set(doc, path, scaled), as_json), f"scale@{_name(path)}={scaled!r}"
    value = rng.choice(ODD_VALUES)
    return _dump(_set(doc, path, value), as_json), f"set@{_name(path)}={_short(value)}"


def _dump(doc: Any, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(doc, allow_nan=True)
    return yaml.safe_dump(doc, sort_keys=False, width=120, allow_unicode=True)


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "<document>"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


def _kind_and_target(path: Path) -> tuple[str, str]:
    doc = yaml.safe_load(path.read_text())
    models = doc.get("models") or {}
    return doc["kind"], str(models.get("target"))


def commands_for(original: Path, mutated: Path, out: Path, index: int = 0) -> list[list[str]]:
    """The commands that read a file of this format (the mutated file in the place of the original). Every plan kind
    goes through every export format; solves run with `--engine` cycled by `index` over every engine they take."""
    from specplan.core.choices import ENGINES, EXPORT_FORMATS, LOOKUP_ENGINES

    m = str(mutated)
    if original.suffix == ".json":  # a plan bench report
        return [["show", m], ["show", m, "--plot", str(out / "show.png")]]
    kind, target = _kind_and_target(original)
    runs: list[list[str]] = [["show", m], ["show", m, "--plot", str(out / "show.png")]]
    sequoia_engine = ["--engine", ENGINES[index % len(ENGINES)], "--heads", "4"]
    engine = (("specplan",) + LOOKUP_ENGINES)[index % (len(LOOKUP_ENGINES) + 1)]
    lookup_engine = ["--engine", engine] + LOOKUP_GRIDS.get(engine, [])
    if kind.startswith("plan/"):
        written = "knobs" if kind == "plan/prompt-lookup" else "tree"  # an engine's n-gram knobs hold no tree
        runs += [["export", m, "--format", fmt, "--draft-path", "draft", "--heads", "4",
                  "-o", str(out / f"{written}_{fmt}.out")] for fmt in EXPORT_FORMATS]
    elif kind == "profile/latency":
        runs.append(["show", str(ROOT / LOOKAHEAD_PROFILE), "--compare", m])
        if target.startswith("qwen"):
            runs.append(SOLVE_SEQUOIA + sequoia_engine + ["--acceptance", str(ROOT / SEQUOIA_ACCEPTANCE),
                                                          "--profile", m])
        else:
            runs.append(SOLVE_LOOKAHEAD + lookup_engine + ["--acceptance", str(ROOT / LOOKAHEAD_ACCEPTANCE),
                                                           "--profile", m])
            runs.append(SOLVE_TRIFORCE + ["--acceptance", str(ROOT / TRIFORCE_ACCEPTANCE), "--profile", m])
    elif kind == "acceptance/sequoia":
        runs.append(SOLVE_SEQUOIA + sequoia_engine + ["--acceptance", m, "--profile", str(ROOT / SEQUOIA_PROFILE)])
        runs.append(SOLVE_SEQUOIA + ["--acceptance", m])
    elif kind == "acceptance/lookahead":
        runs.append(SOLVE_LOOKAHEAD + lookup_engine + ["--acceptance", m, "--profile", str(ROOT / LOOKAHEAD_PROFILE)])
    elif kind == "acceptance/triforce" and target.startswith("smollm2"):
        runs.append(SOLVE_TRIFORCE + ["--acceptance", m, "--profile", str(ROOT / TRIFORCE_PROFILE)])
    for run in runs:
        if run[0] == "solve":
            run += ["-o", str(out / "plan.yaml")]
    return runs


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout()


def run_command(argv: list[str]) -> tuple[int | None, str, str, float]:
    """The CLI in this process: (exit code or None on a crash, stderr, traceback, seconds)."""
    from specplan.cli import main

    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # strict, as a real UTF-8 terminal is
    stderr = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    started = time.perf_counter()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(TIME_LIMIT_SECONDS)
    code: int | None
    trace = ""
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
            stdout.flush()
            stderr.flush()
    except _Timeout:
        code, trace = None, "timeout"
    except BaseException:  # noqa: BLE001 - a crash is what the fuzzer looks for
        code, trace = None, traceback.format_exc()
    finally:
        signal.alarm(0)
    seconds = time.perf_counter() - started
    with contextlib.suppress(ValueError):
        stderr.flush()
    text = stderr.buffer.getvalue().decode("utf-8", "replace")
    return code, text, trace, seconds


def _one_error_line(lines: list[str]) -> bool:
    """A failure prints one short error line, the last (progress lines may precede it)."""
    errors = [line for line in lines if line.startswith("plan: error:")]
    return len(errors) == 1 and lines[-1] == errors[0] and len(errors[0]) <= MAX_ERROR_LINE


def _check_outputs(out: Path) -> str:
    """'' when every file under `out` is whole and loads with the project's own loader; else what is wrong."""
    from specplan.core.plan_schema import load_plan
    from specplan.planner.export import import_tree

    leftovers = [p.name for p in out.iterdir() if p.name.startswith(".")]
    if leftovers:
        return f"partial: {leftovers}"
    plan = out / "plan.yaml"
    if plan.exists():
        try:
            load_plan(plan)
        except Exception as exc:  # noqa: BLE001
            return f"invalid-output: {exc}"[:300]
    for tree in out.glob("tree_*.out"):
        try:
            import_tree(tree.read_bytes(), tree.stem.split("_", 1)[1])
        except Exception as exc:  # noqa: BLE001
            return f"invalid-output: {exc}"[:300]
    for knobs in out.glob("knobs_*.out"):
        text = knobs.read_text(encoding="utf-8")
        if knobs.stem != "knobs_sglang":  # SGLang takes flags, the others a JSON object
            try:
                if not isinstance(json.loads(text), dict):
                    return f"invalid-output: {knobs.name} is not a JSON object"
            except json.JSONDecodeError as exc:
                return f"invalid-output: {knobs.name}: {exc}"[:300]
    return ""


def fuzz(files: int, seed: int, sources: list[Path] | None = None, log: Any = None) -> list[Outcome]:
    rng = random.Random(seed)
    sources = sources or committed_files()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="specplan-fuzz-") as scratch:
        for index in range(files):
            original = sources[index % len(sources)] if index < len(sources) else rng.choice(sources)
            text, mutation = mutate(original.read_text(), rng, as_json=original.suffix == ".json")
            work = Path(scratch) / f"{index:05d}"
            work.mkdir()
            mutated = work / original.name
            mutated.write_text(text, errors="surrogatepass")
            out = work / "out"
            out.mkdir()
            for argv in commands_for(original, mutated, out, index):
                code, stderr, trace, seconds = run_command(argv)
                label = " ".join(a.replace(str(ROOT) + "/", "").replace(scratch + "/", "") for a in argv)
                outcome = Outcome(label, original.name, mutation, "ok" if code == 0 else "rejected")
                lines = stderr.strip().splitlines()
                if trace == "timeout" or seconds > TIME_LIMIT_SECONDS:
                    outcome.verdict, outcome.detail = "hang", f"{seconds:.1f} s"
                elif code is None:
                    outcome.verdict = "crash"
                    outcome.detail = trace.strip().splitlines()[-1][:300]
                elif code not in (0, 2):
                    outcome.verdict, outcome.detail = "crash", f"exit {code}: {stderr[-300:]}"
                elif code == 2 and not _one_error_line(lines):
                    outcome.verdict = "bad-message"
                    outcome.detail = f"{len(lines)} lines, {len(stderr)} chars: {stderr[:200]!r}"
                else:
                    problem = _check_outputs(out)
                    if problem:
                        outcome.verdict, outcome.detail = problem.split(":", 1)[0], problem
                    elif code == 2:
                        outcome.detail = lines[-1]
                outcomes.append(outcome)
                if log is not None and outcome.verdict not in ("ok", "rejected"):
                    print(f"{outcome.verdict}: {outcome.command} [{outcome.mutation}] {outcome.detail}", file=log,
                          flush=True)
                for produced in out.iterdir():
                    produced.unlink()
    return outcomes


def committed_files() -> list[Path]:
    """Every committed plan, profile and acceptance file (every kind specplan reads) and the bench reports."""
    files = sorted(p for folder in ("plans", "profiles", "acceptance") for p in (ROOT / folder).glob("*.yaml"))
    return files + sorted((ROOT / "docs" / "reports").glob("*.json"))


def summary(outcomes: list[Outcome], files: int, seconds: float) -> str:
    verdicts = Counter(o.verdict for o in outcomes)
    failures = [o for o in outcomes if o.verdict not in ("ok", "rejected")]
    distinct = Counter((o.verdict, o.detail.split(":")[0][:80]) for o in failures)
    lines = [f"{files} mutated files, {len(outcomes)} runs in {seconds:.0f} s: "
             + ", ".join(f"{verdicts[v]} {v}" for v in sorted(verdicts))]
    lines += [f"  {count:4d} x {verdict}: {what}" for (verdict, what), count in distinct.most_common()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    sys.setrecursionlimit(1000)
    started = time.perf_counter()
    outcomes = fuzz(args.files, args.seed, log=sys.stdout)
    print(summary(outcomes, args.files, time.perf_counter() - started))
    return 0 if all(o.verdict in ("ok", "rejected") for o in outcomes) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
