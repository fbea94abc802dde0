"""SGLang's NGRAM replayed (planner/sglang_ngram.py): its trie's recency order and BFS breadths, when a step's
tokens reach the trie, the padded verification, the solver's plan and its export; and the replay against SGLang's
own trie code (tests/sglang_trie.py), where its wheel can be fetched."""

from __future__ import annotations

import subprocess
import zipfile

import pytest

from specplan.core.acceptance_schema import LookaheadRecord, load_lookahead_acceptance
from specplan.core.method_settings import NgramTreeSettings
from specplan.core.plan_schema import load_plan
from specplan.planner.prompt_lookup import replay_ngram_tree
from specplan.planner.sglang_ngram import PADDING_TOKEN, NgramTreeProposer, token_paths

from toy import one_error

ACCEPTANCE = "acceptance/smollm2-135m.lookahead.specbench-sum-rag-code.fp32.yaml"
PROFILE = "profiles/smollm2-135m.cpu-2c.fp32.yaml"


@pytest.mark.parametrize("max_bfs_breadth, expected", [(2, {(4,)}), (10, {(4,), (3,)})])
def test_the_tree_takes_the_most_recent_children_up_to_the_matchs_breadth(max_bfs_breadth, expected):
    """Depth 4: breadths fall from max (no match) by (max - min) / 3 per matched token. "1 2" was followed by 3,
    then by 4: the 2-token match takes 1 child (breadth 1.33) with breadth 2, 4 (breadth 4) with breadth 10."""
    proposer = NgramTreeProposer(NgramTreeSettings(3, 4, max_bfs_breadth))
    proposer.insert([7, 1, 2, 3])
    proposer.insert([9, 1, 2, 4])
    assert token_paths(proposer.draft([5, 1, 2])) == expected


def test_seeing_an_ngram_again_makes_it_the_most_recent():
    proposer = NgramTreeProposer(NgramTreeSettings(3, 4, 2))
    for window in ([7, 1, 2, 3], [9, 1, 2, 4], [8, 1, 2, 3]):
        proposer.insert(window)
    assert token_paths(proposer.draft([5, 1, 2])) == {(3,)}


def test_prob_takes_the_most_probable_continuations():
    """After "1" came 2 three times and 3 once, after "1 2" came 5 twice and 6 once: PROB places 2 (3/4), then
    2 5 (3/4 x 2/3 = 1/2), then 3, tied at 1/4 with 2 6 and first out of libstdc++'s heap; with a breadth of 1 a
    node's most frequent child has all of its probability."""
    proposer = NgramTreeProposer(NgramTreeSettings(4, 4, 2, match_type="PROB"))
    for window in ([1, 2, 5], [1, 2, 5], [1, 2, 6], [1, 3]):
        proposer.insert(window)
    assert token_paths(proposer.draft([9, 1])) == {(2,), (2, 5), (3,)}
    proposer = NgramTreeProposer(NgramTreeSettings(3, 4, 2, match_type="PROB"))
    for window in ([1, 2, 5], [1, 2, 5], [1, 2, 6], [1, 3]):
        proposer.insert(window)
    assert token_paths(proposer.draft([9, 1])) == {(2,), (2, 5)}
    narrow = NgramTreeProposer(NgramTreeSettings(4, 4, 1, match_type="PROB"))
    for window in ([1, 2, 5], [1, 2, 5], [1, 2, 6], [1, 3]):
        narrow.insert(window)
    assert token_paths(narrow.draft([9, 1])) == {(2,), (2, 5)}


def test_a_steps_own_tokens_reach_the_trie_one_step_later():
    """After the prompt [5] and the prefill's 1, each step inserts the window it matched from: at the second step
    "1" has no continuation yet (the first step inserted [5, 1]), at the third it has "1" (from [5, 1, 1]), which
    is accepted with a token of the target's own; the fourth emits the last token."""
    record = LookaheadRecord("r", "c", [5], [1] * 6)
    replay = replay_ngram_tree([record], NgramTreeSettings(3, 4, 1))
    assert replay.step_tokens.tolist() == [1, 1, 2, 1]
    assert replay.step_drafts.tolist() == [2, 2, 2, 2]  # every step verifies num_draft_tokens, a match or not


def test_a_padding_slot_accepts_token_0_under_the_root():
    proposer = NgramTreeProposer(NgramTreeSettings(4, 4, 2))
    empty = proposer.draft([3, 1])
    assert proposer.accepted(empty, [PADDING_TOKEN, 5]) == 1 and proposer.accepted(empty, [5]) == 0


@pytest.mark.check
def test_the_replay_is_sglangs_own_trie_step_by_step():
    """Every step's tree and accepted count equal those of SGLang's trie.cpp, built from its wheel (skipped where
    the wheel cannot be fetched or built), over a grid of settings of both match types; the solver's replay takes as
    many steps."""
    from sglang_trie import FULL_GRID, build_library, compare

    try:
        library = build_library()
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile, IndexError) as exc:
        pytest.skip(f"SGLang's NGRAM sources are not available here: {exc}")
    records = load_lookahead_acceptance(ACCEPTANCE).records[:4]
    assert {settings.match_type for settings in FULL_GRID} == {"BFS", "PROB"}
    for settings in FULL_GRID:
        steps, difference = compare(library, records, settings)
        assert difference is None, f"{settings}: {difference}"
        assert steps > 100 and replay_ngram_tree(records, settings).steps == steps


@pytest.mark.slow
def test_a_solved_plan_loads_exports_its_flags_and_runs_nowhere_else(few_outputs, run_cli, tmp_path):
    plan = tmp_path / "sglang.yaml"
    code, stdout, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--profile", PROFILE,
                                   "--engine", "sglang", "--draft-lengths", "2,4,11", "--bfs-breadths", "1,10",
                                   "-o", plan)
    assert code == 0, stderr
    assert "sglang's NGRAM trie" in stdout
    loaded = load_plan(plan)
    settings = loaded.settings
    assert loaded.engine == "sglang" and isinstance(settings, NgramTreeSettings)
    assert settings.num_draft_tokens in (3, 5, 12) and settings.max_bfs_breadth in (1, 10)
    assert settings.max_trie_depth == 18 and len(loaded.solver["top"]) == 10  # of 12: 3 lengths, 2 breadths, 2 types
    assert "trie.cpp" in loaded.solver["source"] and "ngram_worker.py" in loaded.solver["source"]
    code, stdout, _ = run_cli("export", plan, "--format", "sglang")
    if settings.enabled:
        flags = stdout.split()
        assert code == 0 and flags[flags.index("--speculative-algorithm") + 1] == "NGRAM"
        assert flags[flags.index("--speculative-num-draft-tokens") + 1] == str(settings.num_draft_tokens)
        assert flags[flags.index("--speculative-ngram-max-bfs-breadth") + 1] == str(settings.max_bfs_breadth)
        assert flags[flags.index("--speculative-ngram-match-type") + 1] == settings.match_type
    code, _, stderr = run_cli("export", plan, "--format", "vllm")
    assert code == 2 and "--engine vllm" in stderr
    code, _, stderr = run_cli("bench", "--plan", plan, "--dataset", "specbench", "--baselines", "hf",
                              "-o", tmp_path / "r.json")
    assert code == 2 and "cannot run here" in stderr


@pytest.mark.slow
def test_the_replay_prices_the_padded_tree(few_outputs, run_cli, write_yaml_file, tmp_path):
    """SGLang verifies num_draft_tokens every step: where each extra token costs a whole forward, no setting pays,
    and the plan turns NGRAM off."""
    steep = write_yaml_file("steep.yaml", {
        "kind": "profile/latency", "backend": "lean", "models": {"target": "smollm2-135m"},
        "target": {"t_seconds": {n: 0.01 * n for n in (1, 2, 3, 5, 9, 17)}}})
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--profile", steep,
                              "--engine", "sglang", "--draft-lengths", "1,4", "--bfs-breadths", "10", "-o", out)
    assert code == 0, stderr
    assert "no setting beats sglang's one-token decoding" in stderr
    plan = load_plan(out)
    assert plan.settings.enabled is False and plan.prediction.details["lookup_speedup"] < 1.0
    code, stdout, stderr = run_cli("export", out, "--format", "sglang")
    assert code == 0 and stdout.strip() == "" and "without NGRAM" in stderr


@pytest.mark.parametrize("option, value, message", [("--trie-depths", "1", "trie depths >= 2"),
                                                   ("--bfs-breadths", "0", "BFS breadths must be >= 1"),
                                                   ("--match-types", "BFS,DFS", "unknown match type 'DFS'")])
def test_bad_knobs_are_one_line(few_outputs, run_cli, tmp_path, option, value, message):
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--engine", "sglang", option, value,
                              "-o", out)
    assert code == 2 and message in stderr and one_error(stderr) and not out.exists()
