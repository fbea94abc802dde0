"""The transformers backend from the command line: profile, acceptance, plan and generation on an architecture the
lean forward does not run (GPT-NeoX), each recording the backend; and what it refuses, in one line.
(Its logits and greedy identity, per architecture: tests/test_architectures.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from specplan.core.acceptance_schema import load_sequoia_acceptance
from specplan.core.errors import UserError
from specplan.core.models import load_model
from specplan.core.plan_schema import load_plan
from specplan.core.profile_schema import load_profile
from specplan.decoder.transformers_forward import TransformersForward

from toy import hf_greedy, one_error

QUICK = ["--quick", "--contexts", "16,64"]


@pytest.mark.slow
def test_profile_accept_solve_generate_on_gpt_neox(run_cli, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"question_id": i, "category": "writing", "turns": [text]})
                                 for i, text in enumerate(["hello there", "the cat sat on", "one two three"])))
    target, draft = "tiny-random-gpt-neox", "tiny-random-gpt-neox-draft"
    profile_path = tmp_path / "profile.yaml"
    code, stdout, stderr = run_cli("profile", "--target", target, "--draft", draft, *QUICK, "-o", profile_path)
    assert code == 0, stderr
    profile = load_profile(profile_path)
    assert profile.backend == "transformers" and profile.draft_step_seconds > 0
    assert "(measured, transformers backend)" in stdout
    assert set(profile.target_by_context) == {16, 64} and not profile.builds_by_context  # no TriForce builds
    assert yaml.safe_load(profile_path.read_text())["settings"]["engine"] == "specplan, transformers forward"

    acceptance_path = tmp_path / "acceptance.yaml"
    code, _, stderr = run_cli("accept", "sequoia", "--target", target, "--draft", draft, "--dataset", dataset,
                              "--temperature", "0", "--width", 4, "--max-new-tokens", 12, "-o", acceptance_path)
    assert code == 0, stderr
    acceptance = load_sequoia_acceptance(acceptance_path)
    assert acceptance.samples == 36 and 0 < acceptance.positional.sum() <= 1
    assert yaml.safe_load(acceptance_path.read_text())["backend"] == "transformers"

    plan_path = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acceptance_path, "--profile", profile_path,
                              "--max-size", 8, "--max-depth", 3, "-o", plan_path)
    assert code == 0, stderr
    assert load_plan(plan_path).models.backend == "transformers"

    code, stdout, stderr = run_cli("generate", "--plan", plan_path, "--prompt", "the cat sat on", "--no-chat",
                                   "--max-new-tokens", 24, "--json")
    assert code == 0, stderr
    output = json.loads(stdout)
    loaded = load_model(target)
    prompt = loaded.tokenizer("the cat sat on")["input_ids"]
    assert output["backend"] == "transformers"
    assert output["tokens"] == hf_greedy(loaded, prompt, 24)[:len(output["tokens"])]

    report_path = tmp_path / "report.json"
    code, _, stderr = run_cli("bench", "--plan", plan_path, "--dataset", dataset, "--prompts", 2, "--max-new-tokens",
                              12, "--baselines", "hf,hf-assisted,ours-ar", "-o", report_path)
    assert code == 0, stderr
    report = json.loads(report_path.read_text())
    assert report["models"]["backend"] == "transformers"
    assert set(report["summary"]) == {"ours", "hf", "hf-assisted", "ours-ar"}
    assert report["summary"]["ours"]["identical_to_hf"] == 2


def test_llama_runs_on_either_backend_with_the_same_output(run_cli):
    outputs = {}
    for backend in ("lean", "transformers"):
        code, stdout, stderr = run_cli("generate", "--target", "tiny-random-llama", "--prompt", "one two",
                                       "--max-new-tokens", 16, "--json", "--backend", backend)
        assert code == 0, stderr
        outputs[backend] = json.loads(stdout)
        assert outputs[backend]["backend"] == backend
    assert outputs["lean"]["tokens"] == outputs["transformers"]["tokens"]


@pytest.mark.parametrize("args, message", [
    (["--target", "tiny-random-gpt-neox", "--backend", "lean"], "architecture 'gpt_neox' is not supported by the lean"),
    (["--target", "tiny-random-mistral", "--backend", "transformers"], "uses sliding-window attention"),
    (["--target", "tiny-random-llama", "--backend", "compiled", "--device", "cpu"], "needs a GPU"),
])
def test_backend_refusals(args, message, run_cli):
    code, _, stderr = run_cli("generate", *args, "--prompt", "hi", "--max-new-tokens", 4)
    assert code == 2 and message in stderr and one_error(stderr)


def test_triforce_needs_the_lean_backend(run_cli):
    code, _, stderr = run_cli("generate", "--plan", "plans/smollm2-135m.triforce-4096.cpu-2c.fp32.yaml",
                              "--target", "tiny-random-gpt-neox", "--backend", "transformers", "--prompt", "hi",
                              "--max-new-tokens", 4)
    assert code == 2 and "TriForce's retrieval cache needs the lean decoder" in stderr


class MaskIgnoringModel(torch.nn.Module):
    """A causal LM whose forward drops the attention mask it is given: it would score a tree as a chain."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, position_ids=None, attention_mask=None, cache=None, **kwargs):
        return self.model(input_ids=input_ids, position_ids=position_ids, cache=cache, **kwargs)


def test_a_model_that_ignores_the_tree_mask_is_refused():
    loaded = load_model("tiny-random-gpt-neox")
    with pytest.raises(UserError, match="ignores a custom 4D attention mask"):
        TransformersForward(MaskIgnoringModel(loaded.model))
