from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from specplan.cli import main
from specplan.core.fileio import plain
from specplan.core.models import load_model
from specplan.decoder.model import LeanModel

from toy import toy_model


@pytest.fixture
def run_cli(capsys):
    """Run `plan ARGS` in-process; returns (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture
def write_yaml_file(tmp_path: Path):
    def write(name: str, data) -> Path:
        path = tmp_path / name
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(plain(data)))  # plain: no aliases
        return path

    return write


ACCEPTANCE = {
    "kind": "acceptance/sequoia",
    "models": {"target": "toy-target", "draft": "toy-draft"},
    "temperature": 0.6,
    "positional": [0.634, 0.108, 0.057, 0.022, 0.015, 0.01, 0.005, 0.003, 0.012, 0.002],
}
TINY_PAIR = {"target": "tiny-random-llama", "draft": "tiny-random-llama-draft"}
PROFILE = {
    "kind": "profile/latency",
    "target": {"t_seconds": {1: 0.035, 16: 0.070, 64: 0.125, 128: 0.186}},
    "draft": {"step_seconds": 0.004},
}


@pytest.fixture
def bench_tiny_sequoia(run_cli, write_yaml_file, tmp_path):
    """`plan bench` of a small solved Sequoia plan on the tiny pair over two short prompts; returns the
    report's path."""

    def bench(max_new_tokens: int, baselines: str, *extra: str, profile: Path | None = None) -> Path:
        """`profile`: solve the plan on it (else the tree of most tokens per step)."""
        acceptance = write_yaml_file("acc.yaml", {**ACCEPTANCE, "temperature": 0.0, "models": TINY_PAIR})
        plan = tmp_path / "plan.yaml"
        code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acceptance, "--max-size", 8,
                                  "--max-depth", 3, *(("--profile", profile) if profile else ()), "-o", plan)
        assert code == 0, stderr
        dataset = tmp_path / "prompts.jsonl"
        dataset.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"count {i} 1 2 3 4"]})
                                     for i in range(2)))
        report_path = tmp_path / "report.json"
        code, _, stderr = run_cli("bench", "--plan", plan, "--target", "tiny-random-llama", "--draft",
                                  "tiny-random-llama-draft", "--dataset", dataset, "--prompts", 2,
                                  "--max-new-tokens", max_new_tokens, "--baselines", baselines, *extra,
                                  "-o", report_path)
        assert code == 0, stderr
        return report_path

    return bench


@pytest.fixture(scope="session")
def tiny_pair():
    target, draft = load_model("tiny-random-llama"), load_model("tiny-random-llama-draft")
    return target, LeanModel(target.model), LeanModel(draft.model)


@pytest.fixture(scope="session")
def tiny_qwen_pair():
    target, draft = load_model("tiny-random-qwen2"), load_model("tiny-random-qwen2-draft")
    return target, LeanModel(target.model), LeanModel(draft.model)


@pytest.fixture(scope="session")
def toy_pair():
    target_hf, target = toy_model(10)
    _, draft = toy_model(10, noise=0.6)
    return target_hf, target, draft


LOOKAHEAD_ACCEPTANCE = "acceptance/smollm2-135m.lookahead.specbench-sum-rag-code.fp32.yaml"


@pytest.fixture(scope="session")
def few_outputs(tmp_path_factory) -> Path:
    """The committed smollm2 greedy outputs cut to their first 8 prompts: a solver's replay over every setting of an
    engine's grid takes seconds instead of a minute, on the same real outputs."""
    document = yaml.safe_load(Path(LOOKAHEAD_ACCEPTANCE).read_text())
    document["records"] = document["records"][:8]
    path = tmp_path_factory.mktemp("outputs") / "few-outputs.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path
