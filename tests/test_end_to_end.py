"""End to end on the embedded default, smollm2-135m: profile -> accept -> solve -> generate, lossless."""

from __future__ import annotations

import json

import pytest
import torch

from specplan.core.models import load_model
from specplan.core.prompts import encode_prompt
from specplan.decoder.api import load_decoder
from specplan.decoder.sampling import SamplingParams
from specplan.profiler.datasets import DEMO_PROMPTS, read_dataset
from specplan.profiler.haystack import build_prompts

from toy import one_error

MODEL = "smollm2-135m"
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def smollm2():
    return load_model(MODEL, "fp32")


def hf_greedy(loaded, ids: list[int], max_new_tokens: int) -> list[int]:
    tensor = torch.tensor([ids])
    with torch.inference_mode():
        out = loaded.transformers_model().generate(tensor, attention_mask=torch.ones_like(tensor),
                                                   max_new_tokens=max_new_tokens, do_sample=False,
                                                   pad_token_id=loaded.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def test_lookahead_workflow_is_lossless(run_cli, tmp_path, smollm2):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(DEMO_PROMPTS.read_text().splitlines()[:2]))
    profile, acceptance, plan = tmp_path / "p.yaml", tmp_path / "a.yaml", tmp_path / "plan.yaml"
    assert run_cli("profile", "--target", MODEL, "--contexts", "128", "--sizes", "1,2,4,8", "--repeats", "2",
                   "-o", profile)[0] == 0
    assert run_cli("accept", "lookahead", "--target", MODEL, "--dataset", dataset, "--max-new-tokens", 16,
                   "-o", acceptance)[0] == 0
    code, stdout, stderr = run_cli("solve", "lookahead", "--acceptance", acceptance, "--profile", profile,
                                   "--decoding-lengths", "2,4,8", "--branch-lengths", "1,3", "-o", plan)
    assert code == 0, stderr
    decoder = load_decoder(plan)
    decoder.draft_every_step()  # the per-request decisions time the steps: the replay is of the plan's drafting
    replayed = yaml_load(plan)["prediction"]["tokens_per_step"]
    tokens = steps = 0
    for prompt in read_dataset(str(dataset)):
        ids = encode_prompt(decoder.tokenizer, prompt.text, True)
        result = decoder.generate(ids, 16, SamplingParams()).result
        assert result.tokens == hf_greedy(smollm2, ids, 16)
        tokens += len(result.tokens)
        steps += result.steps
    assert tokens / steps == pytest.approx(replayed, rel=1e-9)  # the offline replay is exact
    decoded = tmp_path / "decoded.yaml"
    code, _, stderr = run_cli("accept", "lookahead", "--target", MODEL, "--dataset", dataset, "--max-new-tokens", 16,
                              "--decode-with", plan, "-o", decoded)
    assert code == 0, stderr
    stored, redecoded = yaml_load(acceptance), yaml_load(decoded)
    assert [r["output"] for r in redecoded["records"]] == [r["output"] for r in stored["records"]]  # fp32: lossless
    assert "Lookahead plan" in redecoded["decoding"]
    code, _, stderr = run_cli("accept", "lookahead", "--target", MODEL, "--dataset", dataset, "--dtype", "bf16",
                              "--decode-with", plan, "-o", tmp_path / "bf16.yaml")
    assert code == 2 and "not bf16" in stderr and one_error(stderr)
    assert not (tmp_path / "bf16.yaml").exists()
    code, stdout, _ = run_cli("generate", "--plan", plan, "--prompt", "Name three colors.", "--chat",
                              "--max-new-tokens", 16, "--json")
    assert code == 0 and len(json.loads(stdout)["tokens"]) <= 16
    # `plan bench --reprice`: the plan's forwards re-timed between the prompts price its replay again; on the
    # profile's own times that price is the plan's prediction
    report_path = tmp_path / "report.json"
    code, stdout, stderr = run_cli("bench", "--plan", plan, "--dataset", dataset, "--prompts", 1,
                                   "--max-new-tokens", 16, "--baselines", "ours-ar", "--reprice", "-o", report_path)
    assert code == 0, stderr
    repriced = json.loads(report_path.read_text())["prediction"]["repriced"]
    assert repriced["profiled_speedup"] == pytest.approx(yaml_load(plan)["prediction"]["speedup"], rel=1e-9)
    assert repriced["tokens_per_step"] == pytest.approx(replayed) and repriced["speedup"] > 0
    assert repriced["points"] >= 2 and all(ratio > 0 for ratio in repriced["price_ratios"].values())
    assert "re-priced with its" in stdout


def yaml_load(path):
    import yaml

    return yaml.safe_load(path.read_text())


def test_triforce_on_a_long_prompt_is_lossless(smollm2):
    from specplan.core.method_settings import RetrievalSettings, TrieSettings
    from specplan.decoder.drafters import TrieDrafter
    from specplan.decoder.engine import SpeculativeEngine
    from specplan.decoder.model import LeanModel
    from specplan.decoder.trie import Trie
    from specplan.decoder.triforce import HierarchicalDrafter

    prompt = build_prompts("haystack", smollm2.tokenizer, 1024, 1)[0]
    lean = LeanModel(smollm2.model)
    drafter = HierarchicalDrafter(lean, TrieDrafter(Trie(TrieSettings(decoding_length=4, branch_length=3))), 2, 6,
                                  RetrievalSettings(budget=256, chunk=8, stride=64))
    result = SpeculativeEngine(lean, drafter, smollm2.stop_token_ids).generate(prompt.ids, 48,
                                                                                         SamplingParams())
    assert result.tokens == hf_greedy(smollm2, prompt.ids, 48)[:len(result.tokens)]
    assert result.tokens_per_step > 3  # of at most 7: the middle level agrees with the target most of the time


def test_plan_for_another_tokenizer_is_refused(run_cli, tmp_path, write_yaml_file):
    plan = write_yaml_file("plan.yaml", {
        "kind": "plan/lookahead", "models": {"target": MODEL}, "prediction": {"tokens_per_step": 1.5},
        "lookahead": {"decoding_length": 4, "branch_length": 2, "window": 6, "max_prefix": 4, "capacity": 100,
                      "prompt_weight": 4.0},
        "tokenizer": {"vocab_size": 151665, "sha256": "0" * 64}})
    code, _, stderr = run_cli("generate", "--plan", plan, "--prompt", "hi")
    assert code == 2 and "another tokenizer" in stderr and one_error(stderr)


def test_lookahead_with_token_zero_in_the_prompt_is_lossless(smollm2):
    from specplan.core.method_settings import TrieSettings
    from specplan.decoder.drafters import TrieDrafter
    from specplan.decoder.engine import SpeculativeEngine
    from specplan.decoder.model import LeanModel
    from specplan.decoder.trie import Trie

    tokenizer = smollm2.tokenizer
    document = tokenizer.encode("The committee met on Tuesday and approved the budget for the new library. ")
    ids = document + [0] + document * 2 + [0] + tokenizer.encode("The committee")
    engine = SpeculativeEngine(LeanModel(smollm2.model),
                               TrieDrafter(Trie(TrieSettings(decoding_length=8, branch_length=4))),
                               smollm2.stop_token_ids)
    result = engine.generate(ids, 40, SamplingParams())
    assert result.tokens == hf_greedy(smollm2, ids, 40)[:len(result.tokens)] and len(result.tokens) > 0
    assert result.tokens_per_step > 1.5  # the repeated document is drafted from the trie across the id-0 separators


def test_the_shipped_quantized_weights_decode_as_the_fp32_model(run_cli, tmp_path, smollm2):
    """dtype gguf runs the preset's own Q4_1/Q8_0 blocks: its greedy output, one token per step and with a
    Lookahead plan, equals transformers' fp32 greedy output (the same weights, decoded); the profile records the
    dtype."""
    profile = tmp_path / "p.gguf.yaml"
    code, _, stderr = run_cli("profile", "--target", MODEL, "--dtype", "gguf", "--contexts", "128", "--sizes", "1,4",
                              "--repeats", "2", "-o", profile)
    assert code == 0, stderr
    assert yaml_load(profile)["dtype"] == "gguf"
    prompt = read_dataset("specbench:coding")[0].text
    ids = encode_prompt(smollm2.tokenizer, prompt, True)
    expected = hf_greedy(smollm2, ids, 32)
    code, stdout, stderr = run_cli("generate", "--target", MODEL, "--dtype", "gguf", "--prompt", prompt, "--chat",
                                   "--max-new-tokens", 32, "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["tokens"] == expected
    plan = tmp_path / "plan.yaml"
    accepted = tmp_path / "a.yaml"
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(DEMO_PROMPTS.read_text().splitlines()[:1]))
    assert run_cli("accept", "lookahead", "--target", MODEL, "--dtype", "gguf", "--dataset", dataset,
                   "--max-new-tokens", 32, "-o", accepted)[0] == 0
    assert run_cli("solve", "lookahead", "--acceptance", accepted, "--profile", profile, "--decoding-lengths", "2,4",
                   "--branch-lengths", "1,3", "-o", plan)[0] == 0
    code, stdout, stderr = run_cli("generate", "--plan", plan, "--prompt", prompt, "--chat", "--max-new-tokens", 32,
                                   "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["tokens"] == expected


def test_llama_cpp_baselines_run_the_same_gguf(run_cli, tmp_path):
    pytest.importorskip("llama_cpp")
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(DEMO_PROMPTS.read_text().splitlines()[:1]))
    report = tmp_path / "report.json"
    code, _, stderr = run_cli("bench", "--target", MODEL, "--dtype", "gguf", "--dataset", dataset, "--prompts", 1,
                              "--max-new-tokens", 16, "--baselines", "ours-ar,llama.cpp,llama.cpp-lookup",
                              "-o", report)
    assert code == 0, stderr
    summary = json.loads(report.read_text())["summary"]
    for method in ("llama.cpp", "llama.cpp-lookup"):
        assert summary[method]["new_tokens"] > 0 and summary[method]["decode_tokens_per_second"] > 0


@pytest.mark.check  # against transformers' own prompt lookup
@pytest.mark.parametrize("max_ngram, num_tokens", [(2, 10), (3, 4)])
def test_the_replay_of_transformers_prompt_lookup_counts_its_forwards(smollm2, max_ngram, num_tokens):
    """planner/prompt_lookup.py's replay of transformers' rule, over the very outputs transformers' prompt lookup
    generated, gives the steps (target forwards, counted by a hook) it took: the plan's tokens/step are exact."""
    from specplan.core.acceptance_schema import LookaheadRecord
    from specplan.core.method_settings import PromptLookupSettings
    from specplan.planner.prompt_lookup import LOOKUP_RULES, replay_lookup

    model = smollm2.transformers_model()
    forwards = []
    hook = model.register_forward_hook(lambda *args: forwards.append(1))
    records, counted = [], 0
    try:
        for prompt in read_dataset("specbench:summarization,coding")[:2]:
            ids = encode_prompt(smollm2.tokenizer, prompt.text, True)
            forwards.clear()
            tensor = torch.tensor([ids])
            with torch.inference_mode():
                out = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=32,
                                     do_sample=False, prompt_lookup_num_tokens=num_tokens,
                                     max_matching_ngram_size=max_ngram, pad_token_id=smollm2.tokenizer.pad_token_id)
            records.append(LookaheadRecord(prompt.id, prompt.category, ids, out[0, len(ids):].tolist()))
            counted += len(forwards)
    finally:
        hook.remove()
    replayed = replay_lookup(records, LOOKUP_RULES["hf"], PromptLookupSettings(max_ngram, num_tokens),
                             tuple(smollm2.stop_token_ids))
    assert replayed.steps == counted
    assert replayed.tokens == sum(len(r.output) for r in records)
    assert replayed.tokens_per_step > 1.0  # the prompts' text is drafted from, not a trivial one-token run
