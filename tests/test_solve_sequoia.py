"""`plan solve sequoia`, `plan show`, `plan export`: plan files, the optimizer, and bad input."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import yaml

from specplan.core.errors import UserError
from specplan.core.plan_schema import Plan, PlanModels, Prediction, TokenTree, load_plan
from specplan.core.profile_schema import LatencyCurve, LatencyProfile
from specplan.planner.export import export_plan, import_tree
from specplan.planner.sequoia import SequoiaTables, rank_candidates, solve_sequoia, tree_value

from conftest import ACCEPTANCE, PROFILE
from toy import one_error


def test_solve_writes_a_valid_plan(run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", ACCEPTANCE)
    prof = write_yaml_file("prof.yaml", PROFILE)
    out = tmp_path / "plans" / "toy.sequoia.cpu.fp32.yaml"
    code, stdout, stderr = run_cli("solve", "sequoia", "--acceptance", acc, "--profile", prof,
                                   "--max-size", 128, "--max-depth", 12, "-o", out)
    assert code == 0, stderr
    assert "speedup" in stdout
    plan = load_plan(out)
    assert plan.models == PlanModels(target="toy-target", draft="toy-draft", backend="lean")  # the profile's default
    assert plan.sampling == {"temperature": 0.6}
    p = np.array(ACCEPTANCE["positional"])
    assert plan.prediction.tokens_per_step == pytest.approx(tree_value(np.array(plan.tree.parents), p))
    assert plan.solver["seconds"] > 0
    assert set(plan.provenance["inputs"]) == {str(acc), str(prof)}
    assert plan.inputs["acceptance"]["positional"] == ACCEPTANCE["positional"]  # all entries, none dropped
    # The chosen plan is the best speedup over the whole grid.
    t = LatencyCurve({1: 0.035, 16: 0.070, 64: 0.125, 128: 0.186})
    G = SequoiaTables(p, 128, 12).G
    best = max(G[n, d] * t(1) / (t(n) + d * 0.004) for n in range(1, 129) for d in range(13) if np.isfinite(G[n, d]))
    assert plan.prediction.speedup == pytest.approx(best)


def test_without_profile_maximises_tokens_per_step(write_yaml_file):
    acc = write_yaml_file("acc.yaml", ACCEPTANCE)
    plan, ranked = solve_sequoia(acc, 40, 5)
    G = SequoiaTables(np.array(ACCEPTANCE["positional"]), 40, 5).G
    assert plan.prediction.tokens_per_step == pytest.approx(np.nanmax(G[np.isfinite(G)]))
    assert plan.prediction.speedup is None
    assert plan.tree.size == 40


def test_speedup_is_tokens_per_step_times_t1_over_the_step():
    """speedup(n, d) = G(n, d) t(1) / (t(n) + d c_draft): the paper's formula, on the profile's interpolated t(n)."""
    p = np.array([0.7, 0.1])
    tables = SequoiaTables(p, 16, 4)
    profile = LatencyProfile.from_dict({**PROFILE}, "p")
    curve = profile.target_curve()
    for c in rank_candidates(tables, profile)[:5]:
        assert c.speedup == pytest.approx(c.tokens_per_step * curve(1) / (curve(c.size) + c.depth * 0.004))


def test_latency_interpolation_is_monotone():
    curve = LatencyCurve({1: 0.035, 16: 0.070, 64: 0.125, 128: 0.186})
    values = curve(np.arange(1, 129))
    assert np.all(np.diff(values) >= 0)
    assert values[0] == pytest.approx(0.035) and values[15] == pytest.approx(0.070)
    with pytest.raises(ValueError):
        curve(129)


def test_show_prints_tree_and_plots(run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", ACCEPTANCE)
    prof = write_yaml_file("prof.yaml", PROFILE)
    out = tmp_path / "plan.yaml"
    assert run_cli("solve", "sequoia", "--acceptance", acc, "--profile", prof, "--max-size", 32,
                   "--max-depth", 6, "-o", out)[0] == 0
    png = tmp_path / "plan.png"
    code, stdout, stderr = run_cli("show", out, "--plot", png)
    assert code == 0, stderr
    assert "[0] root" in stdout and "rank 1" in stdout and "provenance" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_formats_content():
    plan = Plan(method="sequoia", models=PlanModels(target="t"), prediction=Prediction(1.5),
                tree=TokenTree.from_parents([-1, 0, 0, 1]))
    assert json.loads(export_plan(plan, "medusa", heads=2).content) == [[0], [1], [0, 0]]
    trtllm = yaml.safe_load(export_plan(plan, "trtllm", draft_path="d").content)
    assert trtllm["speculative_config"]["eagle_choices"] == [[0], [1], [0, 0]]
    growmap = torch.load(io.BytesIO(export_plan(plan, "sequoia").content), weights_only=True)
    assert growmap["roots"] == [[0], [1, 2], [3]]
    assert growmap["branches"] == [[2], [1, 0], [0]]
    assert growmap["Successors"] == [[1, 2], [3], [], []]
    assert growmap["mask"].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert growmap["depth"].tolist() == [0, 1, 1, 2] and growmap["size"] == 4


def test_export_cli(run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", ACCEPTANCE)
    out = tmp_path / "plan.yaml"
    assert run_cli("solve", "sequoia", "--acceptance", acc, "--max-size", 12, "--max-depth", 3, "-o", out)[0] == 0
    code, stdout, _ = run_cli("export", out, "--format", "trtllm", "--draft-path", "d")
    assert code == 0
    assert import_tree(stdout, "trtllm") == load_plan(out).tree


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 2], [-1, 0, 0, 2, 1], []])
def test_invalid_trees_are_rejected(parents):
    with pytest.raises(UserError):
        TokenTree.from_parents(parents)


def test_choices_need_parents():
    with pytest.raises(UserError):
        TokenTree.from_paths([[0, 0]])
    with pytest.raises(UserError):
        TokenTree.from_paths([[1]])


BAD_ACCEPTANCE = {
    "negative": {**ACCEPTANCE, "positional": [0.5, -0.1]},
    "above_one": {**ACCEPTANCE, "positional": [1.2]},
    "nan": "kind: acceptance/sequoia\npositional: [0.5, .nan]\n",
    "sum_above_one": {**ACCEPTANCE, "positional": [0.6, 0.3, 0.2]},
    "empty": {**ACCEPTANCE, "positional": []},
    "wrong_kind": {**ACCEPTANCE, "kind": "acceptance/lookahead"},
    "not_a_list": {**ACCEPTANCE, "positional": "0.5"},
    "unreadable": "kind: acceptance/sequoia\npositional: [0.5, 0.2\n",
    "not_a_mapping": "- 1\n- 2\n",
}


@pytest.mark.parametrize("case", sorted(BAD_ACCEPTANCE))
def test_bad_acceptance_exits_2_with_one_line(case, run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", BAD_ACCEPTANCE[case])
    out = tmp_path / "plan.yaml"
    code, stdout, stderr = run_cli("solve", "sequoia", "--acceptance", acc, "--max-size", 8, "--max-depth", 3,
                                   "-o", out)
    assert code == 2
    assert one_error(stderr) and stderr.startswith("plan: error:")
    assert not out.exists()
    assert list(tmp_path.glob(".plan.yaml*")) == []


@pytest.mark.parametrize("args", [
    ["--max-size", 0, "--max-depth", 3],
    ["--max-size", 8, "--max-depth", -1],
    ["--max-size", "eight", "--max-depth", 3],
    ["--max-size", 8, "--max-depth", 3, "--batch", 2],  # batches are not planned yet
])
def test_bad_arguments_exit_2(args, run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", ACCEPTANCE)
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acc, *args, "-o", out)
    assert code == 2 and one_error(stderr)
    assert not out.exists()


def test_missing_files_exit_2(run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", ACCEPTANCE)
    out = tmp_path / "plan.yaml"
    for args in (["--acceptance", tmp_path / "nope.yaml"], ["--acceptance", acc, "--profile", tmp_path / "nope.yaml"]):
        code, _, stderr = run_cli("solve", "sequoia", *args, "--max-size", 8, "--max-depth", 3, "-o", out)
        assert code == 2 and "no such file" in stderr and one_error(stderr)
    assert not out.exists()


@pytest.mark.parametrize("profile", [
    {"kind": "profile/latency", "target": {"t_seconds": {2: 0.04}}, "draft": {"step_seconds": 0.01}},
    {"kind": "profile/latency", "target": {"t_seconds": {1: 0.04, 4: float("nan")}}},
    {"kind": "profile/latency", "target": {"t_seconds": {1: 0.04}}},  # no draft cost for Sequoia
    {"kind": "plan/sequoia"},
])
def test_bad_profile_exits_2(profile, run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", ACCEPTANCE)
    prof = write_yaml_file("prof.yaml", profile)
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acc, "--profile", prof, "--max-size", 8,
                              "--max-depth", 3, "-o", out)
    assert code == 2 and one_error(stderr)
    assert not out.exists()


def test_draft_vocabulary_reaches_the_plan_and_the_decoder(run_cli, write_yaml_file, tmp_path):
    from specplan.decoder.api import load_decoder

    acc = write_yaml_file("acc.yaml", {**ACCEPTANCE, "draft_vocab": 64})
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acc, "--profile", write_yaml_file("p.yaml", PROFILE),
                              "--max-size", 8, "--max-depth", 3, "-o", out)
    assert code == 2 and "draft vocabulary (64) differs" in stderr and not out.exists()
    prof = write_yaml_file("prof.yaml", {**PROFILE, "draft_vocab": 64})
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acc, "--profile", prof, "--max-size", 8,
                              "--max-depth", 3, "-o", out)
    assert code == 0, stderr
    assert load_plan(out).models.draft_vocab == 64
    decoder = load_decoder(out, "tiny-random-llama", "tiny-random-llama-draft", device="cpu")
    assert decoder.engine.drafter.model.output_ids.tolist() == list(range(64)) + [258]
    bad = write_yaml_file("bad.yaml", {**yaml.safe_load(out.read_text()),
                                       "models": {"target": "toy-target", "draft_vocab": 0}})
    code, _, stderr = run_cli("generate", "--plan", bad, "--prompt", "hi")
    assert code == 2 and "draft_vocab" in stderr and one_error(stderr)


def test_tampered_plan_is_rejected_on_load(run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", ACCEPTANCE)
    out = tmp_path / "plan.yaml"
    assert run_cli("solve", "sequoia", "--acceptance", acc, "--max-size", 12, "--max-depth", 3, "-o", out)[0] == 0
    data = yaml.safe_load(out.read_text())
    data["tree"]["size"] = 11
    bad = write_yaml_file("bad.yaml", data)
    code, _, stderr = run_cli("show", bad)
    assert code == 2 and "size" in stderr


def test_console_script_exit_code(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "specplan.cli", "show", str(tmp_path / "missing.yaml")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"plan: error: {tmp_path / 'missing.yaml'}: no such file"]
