"""The decoder: greedy output identical to the target's own greedy output; sampled output distributed exactly
as the target's (chi-square on a toy vocabulary) for the Sequoia and SpecInfer rules."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from specplan.core.errors import UserError
from specplan.core.models import load_model
from specplan.decoder.drafters import NoDrafter, SequoiaDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.model import LeanModel
from specplan.decoder.sampling import SamplingParams

from conftest import ACCEPTANCE, PROFILE, TINY_PAIR
from toy import (
    SAMPLES,
    assert_distributed_as_target,
    chi_square_p,
    first_tokens_distribution,
    hf_greedy,
    one_error,
    sample_first_tokens_batched,
    sample_first_two,
    toy_model,
)

# the Qwen pair (biases, tied embeddings) in the full tier; the edit loop runs the Llama pair
PAIRS = ["tiny_pair", pytest.param("tiny_qwen_pair", marks=pytest.mark.slow)]


def random_tree(rng: np.random.Generator, size: int, max_children: int) -> list[int]:
    """A random BFS-ordered tree: each new node hangs off one of the open nodes."""
    parents = [-1]
    frontier = [0]
    while len(parents) < size:
        node = frontier[0]
        for _ in range(int(rng.integers(1, max_children + 1))):
            if len(parents) == size:
                break
            parents.append(node)
            frontier.append(len(parents) - 1)
        frontier.pop(0)
        if rng.random() < 0.3 and len(frontier) > 1:
            frontier.pop(0)  # leave some nodes as leaves above the deepest level
    return parents


TREES = [[-1], [-1, 0], [-1, 0, 1, 2, 3], [-1, 0, 0, 1, 1, 2, 3, 4, 5]] + [
    random_tree(np.random.default_rng(seed), size, 3) for seed, size in enumerate([6, 12, 20, 33])]


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("parents", TREES, ids=lambda p: f"n{len(p)}")
def test_greedy_output_equals_transformers_greedy(pair, parents, request):
    loaded, target, draft = request.getfixturevalue(pair)
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, parents) if len(parents) > 1 else None)
    for seed in range(3):
        prompt = torch.randint(0, 256, (int(8 + 5 * seed),), generator=torch.Generator().manual_seed(seed)).tolist()
        reference = hf_greedy(loaded, prompt, 40)
        result = engine.generate(prompt, 40, SamplingParams())
        assert result.tokens == reference
        assert sum(result.accepted_per_step) >= 40 and result.steps <= 40


@pytest.mark.parametrize("names", [("tiny-random-llama", "tiny-random-llama-draft"),
                                   ("tiny-random-qwen2", "tiny-random-qwen2-draft")])
def test_greedy_output_is_unchanged_by_a_limited_draft_vocabulary(names):
    """The draft proposes only ids below 128 (and EOS): tokens above are never drafted, the output is the same."""
    loaded, draft = load_model(names[0]), load_model(names[1])
    limited = LeanModel(draft.model)
    limited.limit_vocabulary(128, always=[258])
    engine = SpeculativeEngine(LeanModel(loaded.model), SequoiaDrafter(limited, [-1, 0, 0, 1, 2, 3]))
    for seed in range(3):
        prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        reference = hf_greedy(loaded, prompt, 40)
        result = engine.generate(prompt, 40, SamplingParams())
        assert result.tokens == reference
        assert any(t >= 128 for t in reference) and result.tokens_per_step > 1


def test_speculation_accepts_tokens(tiny_pair):
    _, target, draft = tiny_pair
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, [-1, 0, 0, 1, 1, 2, 3, 5]))
    result = engine.generate(list(range(40, 60)), 60, SamplingParams())
    assert result.tokens_per_step > 1.5


def test_a_drafters_own_prefill_counts_as_decoding_time(tiny_pair, monkeypatch):
    """One-token decoding does not pay a drafter's prefill (a draft model's prompt, a StreamingLLM window):
    the engine times the drafter's reset with the decoding, not with the target's prefill (on a clock only the
    drafter's reset advances)."""
    import time

    clock = {"seconds": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["seconds"])

    class SlowResetDrafter(NoDrafter):
        def reset(self, prompt, max_len):
            clock["seconds"] += 0.2

    _, target, _ = tiny_pair
    result = SpeculativeEngine(target, SlowResetDrafter()).generate(list(range(40, 60)), 4, SamplingParams())
    assert result.decode_seconds == pytest.approx(0.2) and result.prefill_seconds == 0.0


def test_stop_token_ends_generation(tiny_pair):
    _, target, draft = tiny_pair
    free = SpeculativeEngine(target, SequoiaDrafter(draft, [-1, 0, 1])).generate(list(range(40, 60)), 30,
                                                                                  SamplingParams())
    stop = free.tokens[7]
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, [-1, 0, 1]), stop_ids={stop})
    result = engine.generate(list(range(40, 60)), 30, SamplingParams())
    first = free.tokens.index(stop)
    assert result.tokens == free.tokens[:first + 1] and result.stop_reason == "stop"


def test_context_overflow_is_a_user_error(tiny_pair):
    _, target, draft = tiny_pair
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, [-1, 0, 1]))
    with pytest.raises(UserError, match="exceeds"):
        engine.generate([1] * 4000, 200, SamplingParams())
    with pytest.raises(UserError, match="does not fit"):
        engine.generate([1] * 4000, 95, SamplingParams())


# --- exact sampling -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule, temperature, top_p, draft_vocab", [
    ("sequoia", 1.0, 1.0, None), ("sequoia", 0.5, 0.8, None), ("specinfer", 1.0, 1.0, None),
    ("specinfer", 0.5, 0.8, None), ("sequoia", 1.0, 1.0, 4), ("specinfer", 1.0, 0.9, 4),
])
@pytest.mark.slow
def test_sampled_output_is_distributed_as_the_target(rule, temperature, top_p, draft_vocab, toy_pair):
    """draft_vocab: the draft never proposes id 4, the target's likeliest: it comes from the residuals. Sequoia's
    rule at temperature 1 draws its samples one request at a time; the others through the batching scheduler."""
    target_hf, target, draft = toy_pair
    if draft_vocab is not None:
        _, draft = toy_model(10, noise=0.6)
        draft.limit_vocabulary(draft_vocab, always=[5])
    params = SamplingParams(temperature=temperature, top_p=top_p)
    prompt = [1, 4, 2]
    parents = [-1, 0, 0, 1, 1, 2, 3]  # depth 3, width 2
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, parents), rule=rule)
    if (rule, temperature, draft_vocab) == ("sequoia", 1.0, None):  # one request at a time
        counts, accepted = sample_first_two(lambda: engine, prompt, params, SAMPLES)
    else:  # many at once, sharing their target and draft forwards
        counts, accepted = sample_first_tokens_batched(engine, lambda: SequoiaDrafter(draft, parents), prompt, params,
                                                    SAMPLES)
    assert accepted > 0.2  # the tree path, not just the bonus token, is exercised
    assert_distributed_as_target(counts, first_tokens_distribution(target_hf, prompt, params))


@pytest.mark.slow
def test_chi_square_detects_a_wrong_distribution(toy_pair):
    """The test has power: the draft's own samples are rejected as the target's."""
    target_hf, _, draft = toy_pair
    params = SamplingParams(temperature=1.0)
    engine = SpeculativeEngine(draft)  # autoregressive sampling from the draft
    counts, _ = sample_first_two(lambda: engine, [1, 4, 2], params, SAMPLES)
    assert chi_square_p(counts, first_tokens_distribution(target_hf, [1, 4, 2], params)) < 1e-6


def test_rules_must_match_the_drafts(tiny_pair):
    _, target, draft = tiny_pair
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, [-1, 0, 0]), rule="specinfer")
    with pytest.raises(UserError):
        engine.generate([1, 2, 3], 4, SamplingParams())  # greedy needs the greedy rule
    assert engine.rule_for(SamplingParams(temperature=1.0)).name == "specinfer"
    assert list(itertools.islice(engine.generate([1, 2, 3], 4, SamplingParams(1.0), seed=1).tokens, 4))



def test_greedy_walk_from_all_argmaxes_equals_the_walk_node_by_node():
    """The GPU's greedy walk (every row's argmax read at once) takes the CPU's path, with ties in the logits."""
    from specplan.decoder.tree import DraftTree
    from specplan.decoder.verify import GreedyMatch, greedy_path

    generator = torch.Generator().manual_seed(0)
    paths = set()
    for _ in range(200):
        size = int(torch.randint(2, 12, (), generator=generator))
        parents = [-1] + [int(torch.randint(0, v, (), generator=generator)) for v in range(1, size)]
        tree = DraftTree(torch.randint(0, 4, (size,), generator=generator).tolist(), parents)
        logits = torch.randint(0, 3, (size, 4), generator=generator).float()  # small integers: ties are common
        walked = GreedyMatch().walk(tree, logits, SamplingParams(), None)
        assert greedy_path(tree, logits.argmax(dim=-1).tolist()) == walked
        paths.add(len(walked[0]))
    assert len(paths) >= 3  # paths of several lengths were walked


def test_ancestor_matrix_holds_each_node_and_its_ancestors():
    from specplan.decoder.tree import ancestor_matrix

    generator = torch.Generator().manual_seed(1)
    for size in (1, 2, 5, 17, 64):
        parents = [-1] + [int(torch.randint(0, v, (), generator=generator)) for v in range(1, size)]
        expected = torch.zeros(size, size, dtype=torch.bool)
        for v in range(size):
            u = v
            while u >= 0:
                expected[v, u] = True
                u = parents[u]
        assert torch.equal(ancestor_matrix(parents), expected)

# --- the trie drafter (Lookahead) ----------------------------------------------------------------------------

def trie_engine(target: LeanModel, **settings) -> SpeculativeEngine:
    from specplan.core.method_settings import TrieSettings
    from specplan.decoder.drafters import TrieDrafter
    from specplan.decoder.trie import Trie

    return SpeculativeEngine(target, TrieDrafter(Trie(TrieSettings(**settings))))


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("decoding_length, branch_length", [(2, 1), (8, 4), (24, 6)])
def test_trie_greedy_output_equals_transformers_greedy(pair, decoding_length, branch_length, request):
    loaded, target, _ = request.getfixturevalue(pair)
    engine = trie_engine(target, decoding_length=decoding_length, branch_length=branch_length, window=8,
                         capacity=2000)
    reference_run = SpeculativeEngine(target)
    accepted = 0
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        motif = torch.randint(0, 6, (5,), generator=gen).tolist()  # token 0 appears in the prompts
        prompt = motif * 4 + torch.randint(0, 256, (6,), generator=gen).tolist() + motif[:3]
        reference = hf_greedy(loaded, prompt, 48)
        result = engine.generate(prompt, 48, SamplingParams())
        assert result.tokens == reference
        assert reference_run.generate(prompt, 48, SamplingParams()).tokens == reference
        accepted += sum(result.accepted_per_step) - result.steps
    assert accepted > 0


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.5, 0.9, 0), (1.0, 0.85, 4)])
def test_trie_sampling_is_distributed_as_the_target(temperature, top_p, top_k, toy_pair):
    target_hf, target, _ = toy_pair
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    prompt = [5, 0, 3, 3]  # the trie proposes 3 after 3, a token the target draws about half the time
    settings = dict(decoding_length=6, branch_length=3, window=5, capacity=500)
    engine = trie_engine(target, **settings)
    counts, accepted = sample_first_tokens_batched(engine, lambda: trie_engine(target, **settings).drafter, prompt,
                                                params, SAMPLES)
    assert accepted > 0.1
    assert_distributed_as_target(counts, first_tokens_distribution(target_hf, prompt, params))


def test_bench_report_on_tiny_models(bench_tiny_sequoia):
    report_path = bench_tiny_sequoia(12, "hf,hf-assisted,ours-ar")
    report = json.loads(report_path.read_text())
    summary = report["summary"]
    assert set(summary) == {"ours", "hf", "hf-assisted", "ours-ar"}
    for name in ("ours", "hf-assisted", "ours-ar"):
        assert summary[name]["identical_to_hf"] == summary[name]["compared"] == 2
    for entry in summary.values():
        assert entry["decode_tokens_per_second"] > 0 and entry["tokens_per_second"] > 0
    first, second = (row["order"] for row in report["per_prompt"])
    assert first == ["ours", "hf", "hf-assisted", "ours-ar"] and second == first[1:] + first[:1]
    for row in report["per_prompt"]:
        hf = row["methods"]["hf"]
        assert hf["decode_tokens"] == hf["new_tokens"] - 1 and hf["decode_seconds"] < hf["seconds"]
    ours = summary["ours"]
    hf_rate = summary["hf"]["decode_tokens_per_second"]
    assert ours["speedup_vs_hf"] == pytest.approx(ours["decode_tokens_per_second"] / hf_rate)
    assert "| ours |" in report_path.with_suffix(".md").read_text() and report_path.with_suffix(".png").stat().st_size


def test_show_reports_prints_their_tables_and_plots_a_summary(bench_tiny_sequoia, run_cli, tmp_path):
    report_path = bench_tiny_sequoia(6, "hf,ours-ar")
    report = json.loads(report_path.read_text())
    assert report["machine"]["device"] == "cpu" and report["machine"]["threads"] >= 1
    code, stdout, stderr = run_cli("show", report_path, report_path, "--plot", tmp_path / "summary.png")
    assert code == 0, stderr
    assert stdout.count("| ours |") == 2 and (tmp_path / "summary.png").read_bytes()[:4] == b"\x89PNG"
    not_a_report = tmp_path / "other.json"
    for text, message in (('{"kind": "bench/report"', "malformed JSON"),
                          ('{"kind": "plan/sequoia"}', "not a plan bench"),
                          ('{"kind": "bench/report", "models": {"target": "t"}, "summary": {"ours": {}}}',
                           "decode tokens/s")):
        not_a_report.write_text(text)
        code, _, stderr = run_cli("show", not_a_report, "--plot", tmp_path / "bad.png")
        assert code == 2 and message in stderr and one_error(stderr), stderr
        assert not (tmp_path / "bad.png").exists()
    code, _, stderr = run_cli("show", report_path, tmp_path / "plan.yaml")
    assert code == 2 and "only when all are plan bench reports" in stderr


def test_a_cpu_of_the_same_name_and_flags_is_told_apart_by_its_family_model_and_stepping():
    from specplan.core.machine import machine_difference, machine_identity

    here = machine_identity({"device": "cpu", "cpu": "AMD EPYC", "cpu_flags": ["avx2", "avx512f"], "threads": 2,
                             "cpu_id": "family 25 model 17 stepping 1", "torch": "2.13.0"})
    assert here["cpu_id"] == "family 25 model 17 stepping 1" and "torch" not in here
    there = {**here, "cpu_id": "family 25 model 1 stepping 1"}
    assert machine_difference(there, here) == ("cpu_id family 25 model 1 stepping 1 there, "
                                               "family 25 model 17 stepping 1 here")
    recorded_before_ids = {key: value for key, value in here.items() if key != "cpu_id"}
    assert machine_difference(recorded_before_ids, here) is None
    assert machine_difference(here, recorded_before_ids) is None


def test_bench_and_generate_say_when_the_plans_profile_is_from_another_machine(run_cli, write_yaml_file, tmp_path):
    from specplan.core.machine import machine_difference, this_machine
    from specplan.core.plan_schema import load_plan

    here = this_machine("cpu")
    assert machine_difference(dict(here), here) is None
    elsewhere = {"device": "cpu", "cpu": "Imaginary CPU", "cpu_flags": ["avx2"], "threads": 64}
    profile = write_yaml_file("prof.yaml", {**PROFILE, "hardware": {**elsewhere, "torch": "2.13.0"}})
    acceptance = write_yaml_file("acc.yaml", {**ACCEPTANCE, "temperature": 0.0})
    plan = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acceptance, "--profile", profile, "--max-size", 4,
                              "--max-depth", 2, "-o", plan)
    assert code == 0, stderr
    assert load_plan(plan).inputs["profile"]["machine"] == elsewhere
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"question_id": 0, "category": "c", "turns": ["count 1 2 3 4"]}))
    report_path = tmp_path / "report.json"
    code, stdout, stderr = run_cli("bench", "--plan", plan, "--target", "tiny-random-llama", "--draft",
                                   "tiny-random-llama-draft", "--dataset", dataset, "--prompts", 1,
                                   "--max-new-tokens", 4, "--baselines", "ours-ar", "-o", report_path)
    assert code == 0, stderr
    difference = json.loads(report_path.read_text())["prediction"]["profiled_elsewhere"]
    assert "Imaginary CPU there" in difference and "threads 64 there" in difference
    assert "another machine" in stdout and "another machine" in report_path.with_suffix(".md").read_text()
    code, _, stderr = run_cli("generate", "--plan", plan, "--target", "tiny-random-llama", "--draft",
                              "tiny-random-llama-draft", "--prompt", "count 1 2 3", "--max-new-tokens", 2)
    assert code == 0, stderr
    assert "solved on another machine's profile (" in stderr and "Imaginary CPU there" in stderr


def test_bench_without_a_plan_runs_one_token_decoding_at_dtype_gguf(run_cli, tmp_path):
    """`plan bench` with no plan: `ours` is one-token decoding of --target (here a tiny model at dtype gguf,
    quantized at load), against transformers' greedy output of the same, decoded weights."""
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"count {i} 1 2 3 4"]})
                                 for i in range(2)))
    report_path = tmp_path / "report.json"
    code, _, stderr = run_cli("bench", "--target", "tiny-random-llama", "--dtype", "gguf", "--dataset", dataset,
                              "--prompts", 2, "--max-new-tokens", 12, "--baselines", "hf,ours-ar", "-o", report_path)
    assert code == 0, stderr
    report = json.loads(report_path.read_text())
    assert report["plan"] is None and report["models"]["dtype"] == "gguf"
    summary = report["summary"]
    assert summary["ours"]["tokens_per_step"] == 1.0
    assert summary["ours"]["identical_to_hf"] == summary["ours-ar"]["identical_to_hf"] == 2


def test_bench_reprices_a_sequoia_plan_on_its_forwards_re_timed(bench_tiny_sequoia, write_yaml_file, tmp_path):
    """`plan bench --reprice` with a Sequoia plan: t(1), t(n) and the draft's step at the plan's context, re-timed
    between the prompts, price the plan's tokens/step again; on the profile itself that price is the plan's. (The
    profile is written, not measured: the tiny pair's measured draft step costs about its target's, and no tree
    would beat one-token decoding.)"""
    from specplan.core.plan_schema import load_plan
    from specplan.core.profile_schema import load_profile
    from specplan.planner.sequoia import plan_speedup

    profile = write_yaml_file("profile.yaml", {**PROFILE, "models": TINY_PAIR,
                                               "target": {**PROFILE["target"], "context": 32}})
    report_path = bench_tiny_sequoia(8, "ours-ar", "--reprice", profile=profile)
    plan = load_plan(tmp_path / "plan.yaml")
    assert plan_speedup(plan, load_profile(profile)) == pytest.approx(plan.prediction.speedup)
    repriced = json.loads(report_path.read_text())["prediction"]["repriced"]
    assert repriced["profiled_speedup"] == pytest.approx(plan.prediction.speedup)
    assert repriced["passes"] == 6 and repriced["points"] == 3  # 2 passes before each prompt and after the last
    assert set(repriced["price_ratios"]) == {"one_token", f"verify_{plan.tree.size}", "draft_step"}
    assert all(ratio > 0 for ratio in repriced["price_ratios"].values()) and repriced["speedup"] > 0
    markdown = report_path.with_suffix(".md").read_text()
    assert "re-priced with its 3 priced forwards" in markdown and "two-level" not in markdown


def test_bench_reprice_refuses_a_plan_without_a_profile_in_one_line(run_cli, write_yaml_file, tmp_path):
    acceptance = write_yaml_file("acc.yaml", {**ACCEPTANCE, "temperature": 0.0, "models": TINY_PAIR})
    plan = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acceptance, "--max-size", 4, "--max-depth", 2,
                              "-o", plan)
    assert code == 0, stderr
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"question_id": 0, "category": "c", "turns": ["count 1 2 3 4"]}))
    report_path = tmp_path / "report.json"
    code, _, stderr = run_cli("bench", "--plan", plan, "--target", "tiny-random-llama", "--draft",
                              "tiny-random-llama-draft", "--dataset", dataset, "--prompts", 1, "--max-new-tokens", 4,
                              "--baselines", "ours-ar", "--reprice", "-o", report_path)
    assert code == 2 and "--reprice needs a plan solved with a latency profile" in stderr
    assert one_error(stderr) and not report_path.exists()
