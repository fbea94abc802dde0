"""The file formats against hostile input: every committed file loads and re-dumps to the same document; a CI-sized
sample of the mutation fuzzer (tests/fuzz.py) runs clean; and each crash the fuzzer once found stays fixed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from fuzz import committed_files, fuzz, summary

from specplan.core.acceptance_schema import LookaheadAcceptance, SequoiaAcceptance, TriForceAcceptance
from specplan.core.fileio import plain, read_yaml
from specplan.core.plan_schema import Plan, load_plan
from specplan.core.profile_schema import LatencyProfile

ROOT = Path(__file__).resolve().parents[1]
FUZZ_SAMPLE_FILES = 8  # the full run is `python tests/fuzz.py --files 800` (BENCHMARKS.md)


def _redumped(document: dict, where: str) -> dict:
    """The document read by its format's loader and written back."""
    kind = document["kind"]
    if kind.startswith("plan/"):
        return Plan.from_dict(document, where).to_dict()
    if kind == "profile/latency":
        return LatencyProfile.from_dict(document, where).raw
    loader = {"acceptance/sequoia": SequoiaAcceptance, "acceptance/lookahead": LookaheadAcceptance,
              "acceptance/triforce": TriForceAcceptance}[kind]
    return loader.from_dict(document, where).to_dict()


def _as_written_today(document: dict) -> dict:
    """Older files leave out optional sections that newer ones write as null or [], and the format version (read as
    version 1): the same document."""
    return {"version": 1} | {key: value for key, value in document.items() if value is not None and value != []}


def _one_file_per_kind_in_the_edit_loop(paths: list[Path]) -> list:
    """Every committed file; beyond the first of each folder (its kind), a `slow` sweep."""
    seen: set[str] = set()
    params = []
    for path in paths:
        first = path.parent.name not in seen
        seen.add(path.parent.name)
        params.append(pytest.param(path, id=f"{path.parent.name}/{path.name}",
                                   marks=() if first else pytest.mark.slow))
    return params


@pytest.mark.parametrize("path", _one_file_per_kind_in_the_edit_loop([p for p in committed_files()
                                                                       if p.suffix == ".yaml"]))
def test_committed_file_loads_and_redumps_equivalently(path):
    document = read_yaml(path)
    assert _as_written_today(plain(_redumped(copy.deepcopy(document), str(path)))) == _as_written_today(document)


@pytest.mark.parametrize("path", [p for p in committed_files() if p.suffix == ".json"], ids=lambda p: p.name)
def test_committed_bench_report_loads(path):
    from specplan.bench import load_report

    report = load_report(path)
    assert report["summary"] and report["models"]["target"]


@pytest.mark.slow
def test_fuzz_sample_is_clean():
    outcomes = fuzz(FUZZ_SAMPLE_FILES, seed=11)
    bad = [o for o in outcomes if o.verdict not in ("ok", "rejected")]
    assert len(outcomes) >= 2 * FUZZ_SAMPLE_FILES
    assert not bad, summary(outcomes, FUZZ_SAMPLE_FILES, 0) + "\n" + "\n".join(
        f"{o.verdict}: {o.command} [{o.mutation}] {o.detail}" for o in bad[:10])


SEQUOIA_PLAN = "plans/qwen2.5-coder-1.5b.sequoia.cpu-2c.bf16.yaml"
REPORT = "docs/reports/qwen2.5-coder-1.5b.sequoia.cpu-2c.fp32.json"
SMOLLM_PROFILE = "profiles/smollm2-135m.cpu-2c.fp32-7680.yaml"
TRIFORCE_ACCEPTANCE = "acceptance/smollm2-135m.triforce.haystack.fp32.yaml"
LOOKAHEAD_ACCEPTANCE = "acceptance/smollm2-135m.lookahead.specbench-sum-rag-code.fp32.yaml"


def _edited(path: str, tmp_path: Path, edit) -> Path:
    document = yaml.load((ROOT / path).read_text(), Loader=yaml.CSafeLoader)
    edited = edit(document)
    out = tmp_path / Path(path).name
    if isinstance(edited, str):
        out.write_text(edited)
    else:
        out.write_text(json.dumps(document) if out.suffix == ".json" else _dumped(document))
    return out


def _dumped(document: dict) -> str:
    return yaml.dump(document, Dumper=yaml.CSafeDumper, sort_keys=False)


def _text_at(key: str, snippet: str):
    """Replace the top-level `key`'s value by raw YAML text."""
    def edit(document: dict) -> str:
        document[key] = "PLACEHOLDER_VALUE"
        return _dumped(document).replace("PLACEHOLDER_VALUE", snippet)
    return edit


def _set(*path_and_value):
    *path, value = path_and_value

    def edit(document: dict) -> None:
        node = document
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


def _rename_context(old: int, new):
    def edit(document: dict) -> None:
        contexts = document["target"]["contexts"]
        contexts[new] = contexts.pop(old)
    return edit


def _solve_triforce(profile: Path, out: Path) -> list:
    return ["solve", "triforce", "--acceptance", ROOT / TRIFORCE_ACCEPTANCE, "--profile", profile, "-o", out]


# Each case: the file mutated as the fuzzer once did, the command that crashed on it, what the one line says.
REGRESSIONS = {
    "1000-deep nesting (RecursionError)": (SEQUOIA_PLAN, _text_at("provenance", "[" * 1000 + "1" + "]" * 1000),
                                           "show", ("nested more than", "malformed YAML")),  # ours, or libyaml's
    "self-referencing alias (RecursionError)": (SEQUOIA_PLAN, _text_at("provenance", "&a [1, *a]"), "show",
                                                "aliases"),
    "billion-laughs alias bomb (hang)": (
        SEQUOIA_PLAN, _text_at("inputs", "[&a [1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], "
                                         "&c [*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]]"),
        "show", "aliases"),
    "profile context key 4k (ValueError)": (SMOLLM_PROFILE, _rename_context(4096, "4k"), "solve-triforce",
                                            "not a positive integer"),
    "profile context key null (TypeError)": (SMOLLM_PROFILE, _rename_context(4096, None), "solve-triforce",
                                             "keys are names or integers"),
    "context without n = 1 (ValueError)": (
        SMOLLM_PROFILE, lambda d: d["target"]["contexts"][4096]["t_seconds"].pop(1), "solve-triforce",
        "must include n = 1"),
    "t(n) = 1e308 (PCHIP raises)": (SMOLLM_PROFILE, _set("target", "contexts", 4096, "t_seconds", 2, 1e308),
                                    "solve-triforce", "must be <="),
    "huge n key 1e7 (hang)": (SMOLLM_PROFILE, lambda d: d["target"]["contexts"][4096]["t_seconds"].update(
        {10**7: 1.0}), "solve-triforce", "outside"),
    "t(n) = 0 (speedup .inf)": (SMOLLM_PROFILE, _set("target", "t_seconds", 1, 0.0), "solve-triforce", "> 0"),
    "chunk == budget (ZeroDivisionError)": (TRIFORCE_ACCEPTANCE, lambda d: d["entries"][0].update(chunk=256),
                                            "solve-triforce-acceptance", "must divide the budget"),
    "a section that is a list (AttributeError)": (TRIFORCE_ACCEPTANCE, _set("bottom_cache", [1, 2]),
                                                  "solve-triforce-acceptance", "expected a mapping"),
    "a section that is an int (TypeError)": (SMOLLM_PROFILE, _set("target", "contexts", 7), "solve-triforce",
                                             "expected a mapping"),
    "token id >= 2^63 (OverflowError)": (LOOKAHEAD_ACCEPTANCE, lambda d: d["records"][0]["output"].__setitem__(
        0, 2**63), "solve-lookahead", "out of range"),
    "token id beyond the vocabulary": (LOOKAHEAD_ACCEPTANCE, lambda d: d["records"][0]["output"].__setitem__(
        0, 49152), "solve-lookahead", "below the vocabulary size"),
    "lone surrogate (UnicodeEncodeError)": (SEQUOIA_PLAN, _text_at("provenance", '"\\ud800"'), "show",
                                            ("not valid Unicode", "malformed YAML")),  # ours, or libyaml's
    "a date where a number belongs (TypeError)": (TRIFORCE_ACCEPTANCE, _text_at("bottom_cache", "{sinks: 2026-11-25}"),
                                                  "solve-triforce-acceptance", "a date is not a value"),
    "a report's tokens/s a string (TypeError)": (REPORT, _set("summary", "ours", "tokens_per_second", ""),
                                                  "show", "tokens_per_second must be a number"),
    "a report's sampling null (TypeError)": (REPORT, _set("sampling", None), "show", "sampling.temperature"),
}


@pytest.mark.parametrize("case", list(REGRESSIONS))
def test_fuzzer_crash_stays_fixed(case, run_cli, tmp_path):
    path, edit, command, message = REGRESSIONS[case]
    mutated = _edited(path, tmp_path, edit)
    out = tmp_path / "plan.yaml"
    argv = {
        "show": ["show", mutated],
        "solve-triforce": _solve_triforce(mutated, out),
        "solve-triforce-acceptance": ["solve", "triforce", "--acceptance", mutated, "--profile", ROOT / SMOLLM_PROFILE,
                                      "-o", out],
        "solve-lookahead": ["solve", "lookahead", "--acceptance", mutated, "--decoding-lengths", "4",
                            "--branch-lengths", "2", "-o", out],
    }[command]
    code, _, stderr = run_cli(*argv)
    lines = stderr.strip().splitlines()
    messages = message if isinstance(message, tuple) else (message,)
    assert code == 2 and len(lines) == 1 and any(m in lines[0] for m in messages) and str(mutated) in lines[0], stderr
    assert not out.exists()


def test_profile_minimal_form_shows(run_cli, write_yaml_file):
    """The schema docstring's minimal profile, which the loader accepts, `plan show` once crashed on."""
    minimal = write_yaml_file("p.yaml", {"kind": "profile/latency", "target": {"t_seconds": {1: 0.035, 16: 0.07}},
                                         "draft": {"step_seconds": 0.004}})
    code, stdout, stderr = run_cli("show", minimal)
    assert code == 0 and "35.00" in stdout and "4.00" in stdout, stderr


def test_huge_tree_is_refused_not_exported_as_a_dense_mask(run_cli, tmp_path):
    plan = load_plan(ROOT / SEQUOIA_PLAN).to_dict()
    plan["tree"] = {"size": 5000, "depth": 1, "parents": [-1] + [0] * 4999}
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(plain(plan)))
    Plan.from_dict(read_yaml(path), str(path))  # a valid plan ...
    code, _, stderr = run_cli("export", path, "--format", "sequoia", "-o", tmp_path / "tree.pt")
    assert code == 2 and "too large for the sequoia growmap" in stderr  # ... whose n x n mask is refused
    assert run_cli("export", path, "--format", "medusa", "--heads", 1, "-o", tmp_path / "tree.json")[0] == 2
    code, _, stderr = run_cli("export", path, "--format", "vllm", "--draft-path", "d", "-o", tmp_path / "tree.json")
    assert code == 2 and "no token trees" in stderr


def test_model_name_of_wrong_type_is_refused(run_cli, tmp_path):
    plan = _edited(SEQUOIA_PLAN, tmp_path, _set("models", "target", 123))
    code, _, stderr = run_cli("generate", "--plan", plan, "--prompt", "hi", "--max-new-tokens", "1")
    assert code == 2 and "'target' must be a string" in stderr and str(plan) in stderr


def test_megabyte_value_is_not_echoed(run_cli, tmp_path):
    plan = _edited(SEQUOIA_PLAN, tmp_path, _set("prediction", "tokens_per_step", "x" * 1_000_000))
    code, _, stderr = run_cli("show", plan)
    assert code == 2 and len(stderr) < 500, len(stderr)


def test_odd_kind_is_not_echoed(run_cli, tmp_path):
    plan = _edited(SEQUOIA_PLAN, tmp_path, _set("kind", {"provenance": ["x" * 100] * 10}))
    code, _, stderr = run_cli("show", plan)
    assert code == 2 and "cannot show a document of kind" in stderr and len(stderr.strip()) <= 400


def test_sequoia_context_the_profile_lacks(run_cli, tmp_path):
    """An unknown --context once escaped as a ValueError traceback."""
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance",
                              ROOT / "acceptance/qwen2.5-coder-1.5b+0.5b.sequoia.specbench.t0.bf16.yaml", "--profile",
                              ROOT / "profiles/qwen2.5-coder-1.5b+0.5b.cpu-2c.bf16.yaml", "--max-size", 8,
                              "--max-depth", 2, "--context", 999, "-o", tmp_path / "plan.yaml")
    assert code == 2 and "the profile has no context 999" in stderr and not (tmp_path / "plan.yaml").exists()
