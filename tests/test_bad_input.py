"""Bad input to the decoder and planner commands: one line on stderr, exit code 2, nothing written."""

from __future__ import annotations

import pytest

from conftest import ACCEPTANCE
from toy import one_error

TINY_PAIR = ["--target", "tiny-random-llama", "--draft", "tiny-random-llama-draft"]


@pytest.fixture
def sequoia_plan(run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", ACCEPTANCE)
    plan = tmp_path / "plan.yaml"
    assert run_cli("solve", "sequoia", "--acceptance", acc, "--max-size", 8, "--max-depth", 3, "-o", plan)[0] == 0
    return plan


def assert_one_line_exit_2(result, message):
    code, _, stderr = result
    assert code == 2, stderr
    assert message in stderr and one_error(stderr)


@pytest.mark.e2e
def test_draft_with_another_vocabulary(run_cli, sequoia_plan):
    assert_one_line_exit_2(run_cli("generate", "--plan", sequoia_plan, "--target", "tiny-random-llama", "--draft",
                                   "smollm2-135m", "--prompt", "hi"), "does not share the vocabulary")


def test_prompt_over_the_context(run_cli, sequoia_plan, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("x" * 5000)
    assert_one_line_exit_2(run_cli("generate", "--plan", sequoia_plan, *TINY_PAIR, "--prompt-file", long), "exceeds")


def test_tree_larger_than_the_cache(run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", ACCEPTANCE)
    plan = tmp_path / "big.yaml"
    assert run_cli("solve", "sequoia", "--acceptance", acc, "--max-size", 600, "--max-depth", 8, "-o", plan)[0] == 0
    prompt = tmp_path / "p.txt"
    prompt.write_text("y" * 3400)
    assert_one_line_exit_2(run_cli("generate", "--plan", plan, *TINY_PAIR, "--prompt-file", prompt,
                                   "--max-new-tokens", 100), "does not fit")


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--prompt-file", "x.txt"], "exactly one"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "0"], "top_p"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    (["--prompt", "hi", "--temperature", "0.5", "--verify", "greedy"], "greedy verification rule needs temperature 0"),
])
def test_generate_bad_arguments(args, message, run_cli, sequoia_plan):
    assert_one_line_exit_2(run_cli("generate", "--plan", sequoia_plan, *TINY_PAIR, *args), message)


def test_missing_and_malformed_plans(run_cli, write_yaml_file, tmp_path):
    assert_one_line_exit_2(run_cli("generate", "--plan", tmp_path / "none.yaml", "--prompt", "hi"), "no such file")
    bad = write_yaml_file("bad.yaml", "kind: plan/sequoia\ntree: [1, 2\n")
    assert_one_line_exit_2(run_cli("generate", "--plan", bad, "--prompt", "hi"), "malformed YAML")


@pytest.mark.parametrize("grid, message", [
    (["--decoding-lengths", "0,4"], "L_d"),
    (["--branch-lengths", "0"], "L_b"),
])
def test_lookahead_lengths_below_one(grid, message, run_cli, write_yaml_file, tmp_path):
    acc = write_yaml_file("acc.yaml", {"kind": "acceptance/lookahead", "models": {"target": "tiny-random-llama"},
                                       "tokenizer": {"vocab_size": 259, "sha256": "0" * 64},
                                       "records": [{"prompt": [1, 2, 3], "output": [4, 5]}]})
    out = tmp_path / "plan.yaml"
    assert_one_line_exit_2(run_cli("solve", "lookahead", "--acceptance", acc, *grid, "-o", out), message)
    assert not out.exists()


TRIFORCE_PLAN = {"kind": "plan/triforce", "models": {"target": "tiny-random-llama"},
                 "prediction": {"tokens_per_step": 2.0, "speedup": 1.5},
                 "triforce": {"gamma1": 2, "gamma2": 6, "budget": 256, "chunk": 8, "stride": 64, "context": 1024,
                              "rebuild_below": 0.0, "bottom": "none", "sinks": 4, "window": 64}}


@pytest.mark.parametrize("change, message", [
    ({"budget": 250}, "does not divide the budget 250"),
    ({"gamma1": 4, "gamma2": 2}, "gamma1 <= gamma2"),
    ({"budget": 4096}, "not below the context"),
])
def test_triforce_plan_bad_settings(change, message, run_cli, write_yaml_file):
    plan = write_yaml_file("plan.yaml", {**TRIFORCE_PLAN, "triforce": {**TRIFORCE_PLAN["triforce"], **change}})
    assert_one_line_exit_2(run_cli("generate", "--plan", plan, "--prompt", "a short prompt"), message)


def test_triforce_context_over_the_model_maximum(run_cli, tmp_path):
    out = tmp_path / "acc.yaml"
    assert_one_line_exit_2(run_cli("accept", "triforce", "--target", "tiny-random-llama", "--dataset",
                                   "haystack", "--contexts", "8192", "--budgets", "256",
                                   "--chunks", "8", "--strides", "64", "-o", out), "exceeds")
    assert not out.exists()


@pytest.mark.parametrize("cache, message", [(["--window", "0"], "'--window': 0 is not in the range x>=1"),
                                            (["--sinks", "-1"], "'--sinks': -1 is not in the range x>=0")])
def test_triforce_streaming_cache_bad_sizes(cache, message, run_cli, tmp_path):
    out = tmp_path / "acc.yaml"
    assert_one_line_exit_2(run_cli("accept", "triforce", "--target", "tiny-random-llama", "--dataset",
                                   "haystack", "--contexts", "300", "--budgets", "64",
                                   "--chunks", "8", "--strides", "16", *cache, "-o", out), message)
    assert not out.exists()


def test_triforce_plan_bad_bottom(run_cli, write_yaml_file):
    plan = write_yaml_file("plan.yaml", {**TRIFORCE_PLAN, "triforce": {**TRIFORCE_PLAN["triforce"], "bottom": "x"}})
    assert_one_line_exit_2(run_cli("generate", "--plan", plan, "--prompt", "a short prompt"),
                           "'bottom' must be one of trie, model, none, streaming")


def saved_directory(config, directory):
    """A local Hugging Face directory of a random-weight model from `config`, with the byte tokenizer."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specplan.core.models import byte_tokenizer

    hf_logging.disable_progress_bar()
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def test_an_architecture_neither_backend_runs(run_cli, tmp_path):
    """A Mamba model (no attention, no positions): the lean forward does not run it and transformers' own forward
    cannot score a token tree with it; refused in one line."""
    from transformers import MambaConfig

    directory = saved_directory(MambaConfig(vocab_size=260, hidden_size=32, num_hidden_layers=1, state_size=4),
                                tmp_path / "tiny-mamba")
    assert_one_line_exit_2(run_cli("generate", "--target", str(directory), "--prompt", "hello"),
                           "architecture 'mamba' takes no position ids")
    assert_one_line_exit_2(run_cli("generate", "--target", str(directory), "--prompt", "hello", "--backend", "lean"),
                           "architecture 'mamba' is not supported by the lean decoder")


def test_a_model_larger_than_the_memory(run_cli, tmp_path, monkeypatch):
    """Refused from the safetensors headers, before any weight is read."""
    from transformers import LlamaConfig

    from specplan.core import models

    directory = saved_directory(LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2), tmp_path / "tiny-llama")
    monkeypatch.setattr(models, "available_memory", lambda: 1000)
    assert_one_line_exit_2(run_cli("generate", "--target", str(directory), "--prompt", "hello"),
                           "tiny-llama needs about 0.1 MiB for its weights in fp32, and this machine has 0.0 MiB "
                           "available")


def test_llama_cpp_baselines_without_the_extra_or_without_a_gguf(run_cli, tmp_path, monkeypatch):
    """llama.cpp needs llama-cpp-python (the llamacpp extra) and a GGUF file (a tiny model has none)."""
    import builtins

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"question_id": 1, "category": "c", "turns": ["count 1 2 3"]}')
    args = ("bench", "--target", "tiny-random-llama", "--dataset", dataset, "--prompts", 1, "--max-new-tokens", 4,
            "--baselines", "llama.cpp", "-o", tmp_path / "report.json")
    real_import = builtins.__import__

    def no_llama_cpp(name, *rest, **kwargs):
        if name == "llama_cpp":
            raise ImportError(name)
        return real_import(name, *rest, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "__import__", no_llama_cpp)
        assert_one_line_exit_2(run_cli(*args), "the llama.cpp baselines need llama-cpp-python: pip install")
    import specplan.llamacpp

    monkeypatch.setattr(specplan.llamacpp, "llama_cpp", lambda: None)  # as if installed
    assert_one_line_exit_2(run_cli(*args), "tiny-random-llama: the llama.cpp baselines run a GGUF file")
    assert not (tmp_path / "report.json").exists()


def test_dtype_gguf_of_a_model_without_a_gguf(run_cli, tmp_path):
    from transformers import LlamaConfig

    directory = saved_directory(LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2), tmp_path / "tiny-llama")
    assert_one_line_exit_2(run_cli("generate", "--target", str(directory), "--prompt", "hello", "--dtype", "gguf"),
                           "dtype gguf runs a GGUF file's own quantized weights; a Hugging Face directory has none")
