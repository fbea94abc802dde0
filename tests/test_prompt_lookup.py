"""Engines' prompt lookup (planner/prompt_lookup.py): their matching rule, its replay, the knobs' solver, the plan."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from specplan.core.acceptance_schema import LookaheadRecord
from specplan.core.method_settings import PromptLookupSettings
from specplan.core.plan_schema import load_plan
from specplan.planner.prompt_lookup import LOOKUP_RULES, lookup_draft, replay_lookup

from toy import one_error

ACCEPTANCE = "acceptance/smollm2-135m.lookahead.specbench-sum-rag-code.fp32.yaml"
PROFILE = "profiles/smollm2-135m.cpu-2c.fp32.yaml"
SMOLLM2_STOP = "2"  # smollm2-135m-instruct's <|im_end|>, its generation config's EOS


def random_sequences(count: int = 300):
    rng = np.random.default_rng(0)
    for _ in range(count):
        yield rng.integers(0, 6, int(rng.integers(2, 40)))  # a small vocabulary: many n-gram matches


@pytest.mark.parametrize("max_ngram, num_tokens", [(1, 3), (2, 10), (3, 4)])
def test_the_search_is_transformers_and_llama_cpp_pythons(max_ngram, num_tokens):
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    generator = PromptLookupCandidateGenerator(num_output_tokens=num_tokens, max_matching_ngram_size=max_ngram,
                                               max_length=10_000)
    try:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        LlamaPromptLookupDecoding = None
    for sequence in random_sequences():
        ours = lookup_draft(sequence, max_ngram, num_tokens)
        candidates, _ = generator.get_candidates(torch.from_numpy(sequence)[None])
        assert ours.tolist() == candidates[0, len(sequence):].tolist()
        if LlamaPromptLookupDecoding is not None:
            theirs = LlamaPromptLookupDecoding.find_candidate_pred_tokens(sequence.astype(np.intc), max_ngram,
                                                                          num_tokens)
            assert ours.tolist() == theirs.tolist()


def test_the_replay_follows_each_engines_steps():
    record = LookaheadRecord("r", "c", [5, 1, 2, 3, 9, 1, 2], [3, 9, 1, 2, 3, 7])
    settings = PromptLookupSettings(2, 3)
    hf = replay_lookup([record], LOOKUP_RULES["hf"], settings, (9,))
    llama = replay_lookup([record], LOOKUP_RULES["llama.cpp"], settings, ())
    # transformers drafts [3, 9, 1] after the prompt's first "1 2", cut at the stop token 9 to [3], and verifies it
    # in the prefill forward (2 tokens); llama.cpp takes the prefill's 3, then drafts [9, 1, 2] after "2 3": all
    # accepted plus 3 (4 tokens), then a draft of 9 where 7 follows (1 token)
    assert hf.tokens == 6 and llama.tokens == 5
    assert llama.step_tokens.tolist() == [4, 1]
    assert hf.step_drafts[0] == 1 and hf.step_tokens[0] == 2


@pytest.mark.slow
def test_a_solved_plan_loads_runs_nowhere_but_its_engine_and_exports(few_outputs, run_cli, tmp_path):
    plan = tmp_path / "hf.yaml"
    code, stdout, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--profile", PROFILE,
                                   "--engine", "hf", "--stop-tokens", SMOLLM2_STOP, "--max-ngrams", "1,2,3",
                                   "--draft-lengths", "2,4,8", "-o", plan)
    assert code == 0, stderr
    assert "hf's prompt lookup" in stdout
    loaded = load_plan(plan)
    assert loaded.kind == "plan/prompt-lookup" and loaded.engine == "hf"
    assert loaded.settings.max_ngram in (1, 2, 3) and loaded.settings.num_tokens in (2, 4, 8)
    assert loaded.prediction.speedup > 1 and loaded.prediction.details["beats_one_token"] is True
    assert loaded.settings.enabled  # on our fp32 forward a short lookup pays
    code, stdout, _ = run_cli("export", plan, "--format", "hf")
    assert code == 0 and json.loads(stdout) == {"prompt_lookup_num_tokens": loaded.settings.num_tokens,
                                                "max_matching_ngram_size": loaded.settings.max_ngram}
    code, _, stderr = run_cli("export", plan, "--format", "llama.cpp")
    assert code == 2 and "--engine llama.cpp" in stderr
    code, _, stderr = run_cli("generate", "--plan", plan, "--prompt", "hi")
    assert code == 2 and "runs in hf" in stderr


def test_bad_input_is_one_line(few_outputs, run_cli, write_yaml_file, tmp_path):
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--engine", "hf", "-o", out)
    assert code == 2 and "--stop-tokens" in stderr and not out.exists()  # the file records no stop tokens
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--profile", PROFILE,
                              "--engine", "llama.cpp", "-o", out)
    assert code == 2 and "plan profile --engine llama.cpp" in stderr and not out.exists()
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--engine", "tensorrt", "-o", out)
    assert code == 2 and "'tensorrt' is not one of" in stderr
    assert one_error(stderr)


@pytest.mark.slow
def test_a_llama_cpp_plan_says_when_nothing_beats_one_token(few_outputs, run_cli, write_yaml_file, tmp_path):
    """On a profile where every extra token costs a whole forward, no lookup setting pays: the plan says so."""
    steep = write_yaml_file("steep.yaml", {
        "kind": "profile/latency", "backend": "llama.cpp", "models": {"target": "smollm2-135m"},
        "target": {"t_seconds": {n: 0.01 * n for n in (1, 2, 3, 5, 9, 17)}}})
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--profile", steep,
                              "--engine", "llama.cpp", "--draft-lengths", "1,2,4", "-o", out)
    assert code == 0, stderr
    assert "no setting beats llama.cpp's one-token decoding" in stderr and "turns the lookup off" in stderr
    plan = yaml.safe_load(out.read_text())
    assert plan["prediction"]["beats_one_token"] is False and plan["prompt-lookup"]["enabled"] is False
    assert plan["prediction"]["speedup"] == 1.0 and plan["prediction"]["lookup_speedup"] < 1.0
    code, stdout, stderr = run_cli("export", out, "--format", "llama.cpp")
    assert code == 0 and json.loads(stdout) == {} and "without prompt lookup" in stderr


def vllm_rule_by_brute_force(sequence, min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's documented rule (planner/prompt_lookup.py: VLLM_NGRAM), by brute force: among all earlier
    occurrences of a suffix of length min_n..max_n, the longest, then the earliest; the k tokens after it."""
    tokens = list(sequence)
    best = None  # (length, -start)
    for n in range(min_n, max_n + 1):
        suffix = tokens[len(tokens) - n:] if n <= len(tokens) else None
        for start in range(0, len(tokens) - n):
            if suffix is not None and tokens[start:start + n] == suffix:
                if best is None or (n, -start) > best:
                    best = (n, -start)
    if best is None:
        return []
    begin = -best[1] + best[0]
    return tokens[begin:begin + k]


@pytest.mark.parametrize("min_n, max_n, k", [(1, 1, 3), (2, 3, 5), (3, 4, 2)])
def test_vllms_rule_is_the_search_stopped_at_its_minimum(min_n, max_n, k):
    for sequence in random_sequences():
        assert lookup_draft(sequence, max_n, k, min_n).tolist() == vllm_rule_by_brute_force(sequence, min_n, max_n, k)


@pytest.mark.slow
def test_a_vllm_lookup_plan_exports_its_config_and_is_not_benched_here(few_outputs, run_cli, tmp_path):
    plan = tmp_path / "vllm.yaml"
    code, stdout, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--profile", PROFILE,
                                   "--engine", "vllm", "--max-ngrams", "2,3", "--draft-lengths", "2,4", "-o", plan)
    assert code == 0, stderr
    settings = load_plan(plan).settings
    assert 1 <= settings.min_ngram <= settings.max_ngram
    code, stdout, _ = run_cli("export", plan, "--format", "vllm")
    assert code == 0 and json.loads(stdout) == {"method": "ngram", "num_speculative_tokens": settings.num_tokens,
                                                "prompt_lookup_max": settings.max_ngram,
                                                "prompt_lookup_min": settings.min_ngram}
    code, _, stderr = run_cli("bench", "--plan", plan, "--dataset", "specbench", "--baselines", "hf",
                              "-o", tmp_path / "r.json")
    assert code == 2 and "cannot run here" in stderr

