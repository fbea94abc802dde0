"""TriForce: the retrieval cache, the streaming drafter, and the hierarchy's losslessness (greedy and sampled)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml

from specplan.core.acceptance_schema import StreamingRecord, TriForceAcceptance, TriForceEntry, TriForceTrace
from specplan.core.errors import UserError
from specplan.core.method_settings import RetrievalSettings, TrieSettings
from specplan.core.models import load_model
from specplan.decoder.drafters import NoDrafter, TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.model import LeanModel, causal_mask
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.trie import Trie
from specplan.decoder.triforce import (
    RESELECT_AFTER_IDLE_STEPS,
    HierarchicalDrafter,
    RetrievalCache,
    StreamingDrafter,
    bottom_trie_settings,
)

from toy import (
    SAMPLES,
    VOCAB,
    assert_distributed_as_target,
    first_tokens_distribution,
    hf_greedy,
    long_prompt,
    one_error,
    sample_first_tokens_batched,
)


@torch.inference_mode()
def test_retrieval_cache_keeps_sink_tail_and_best_chunks(tiny_pair):
    _, target, _ = tiny_pair
    prompt = long_prompt(203, 0)
    full = target.new_cache(256)
    target.prefill(torch.tensor(prompt), full, logits=False)
    queries = torch.randn(target.shape.layers, target.shape.heads, target.shape.head_dim)
    retrieval = RetrievalCache(target, RetrievalSettings(budget=64, chunk=8), scratch=16)
    retrieval.build(full, queries)
    cache = retrieval.cache
    assert cache.length == 64 + 203 % 8
    group = target.shape.heads // target.shape.kv_heads
    for layer in range(target.shape.layers):
        for head in range(target.shape.kv_heads):
            keys = full.k[layer, head, :200].view(25, 8, -1)
            q = queries[layer, head * group:(head + 1) * group].sum(0)
            scores = keys.mean(1) @ q
            best = [0] + [c for c in torch.argsort(scores[1:], descending=True)[:7].add(1).tolist()]
            expected = torch.cat([keys[c] for c in best] + [full.k[layer, head, 200:203]])
            torch.testing.assert_close(cache.k[layer, head, :cache.length], expected)
            values = full.v[layer, head, :200].view(25, 8, -1)
            torch.testing.assert_close(cache.v[layer, head, :cache.length],
                                       torch.cat([values[c] for c in best] + [full.v[layer, head, 200:203]]))
    # Inserting overwrites the lowest-ranked slots, from the last one down.
    assert retrieval.insert(full, 195, 198)
    torch.testing.assert_close(cache.k[:, :, 61:64].flip(2), full.k[:, :, 195:198])


@torch.inference_mode()
def test_retrieval_cache_of_a_sliding_window_model_holds_its_window():
    """Mistral (every layer a 16-token window): a retrieval cache whose budget covers the window holds every position
    the window sees (the chunks scored highest, when they lie before the window, would be masked), keeps each slot's
    position, and the middle level then scores a chain exactly as the target does (the windows see the same keys),
    also after inserting committed tokens."""
    target = LeanModel(load_model("tiny-random-mistral").model)
    prompt = long_prompt(100, 3)
    full = target.new_cache(160)
    target.prefill(torch.tensor(prompt[:-1]), full, logits=False)
    queries = full.root_queries = torch.zeros(target.shape.layers, target.shape.heads, target.shape.head_dim)
    target.forward(torch.tensor(prompt[-1:]), torch.tensor([full.length]), full, None, logits_rows=slice(0, 0))
    retrieval = RetrievalCache(target, RetrievalSettings(budget=32, chunk=8), scratch=16)
    retrieval.build(full, queries)
    middle = retrieval.cache
    held = middle.key_positions[:, :, :middle.length]
    for position in range(99 - 16 + 1, 99):  # every position the next query's window sees
        assert bool((held == position).any(-1).all()), position
    chain = torch.tensor(prompt[-1:] + long_prompt(6, 4))
    positions = torch.arange(full.length, full.length + len(chain))
    expected = target.forward(chain, positions, full, None if len(chain) == 1 else
                              causal_mask(full.length, len(chain), target.dtype, target.device))
    got = target.forward(chain, positions, middle, causal_mask(middle.length, len(chain), target.dtype,
                                                               target.device))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    full.commit(None, 3)
    assert retrieval.insert(full, full.length - 3, full.length)
    following = torch.tensor(long_prompt(2, 5))
    positions = torch.arange(full.length, full.length + 2)
    expected = target.forward(following, positions, full, causal_mask(full.length, 2, target.dtype, target.device))
    got = target.forward(following, positions, middle, causal_mask(middle.length, 2, target.dtype, target.device))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_streaming_drafter_of_a_sliding_window_model_drafts_as_the_target():
    """Mistral's 16-token window inside a StreamingLLM cache of 2 sinks + 40 recent tokens (more than the 2 x 16
    positions two layers of windows reach back): after evictions the slots are not positions, yet every drafted
    token is the target's own greedy choice, so every draft is accepted."""
    target = LeanModel(load_model("tiny-random-mistral").model)
    prompt = long_prompt(90, 6)
    drafter = StreamingDrafter(target, gamma=3, sinks=2, window=40)
    result = SpeculativeEngine(target, drafter).generate(prompt, 32, SamplingParams())
    assert result.tokens == hf_greedy(load_model("tiny-random-mistral"), prompt, 32)
    assert result.accepted_per_step[:-1] == [4] * (len(result.accepted_per_step) - 1)


def bottoms(target, draft):
    return {
        "streaming-draft": lambda: StreamingDrafter(draft, gamma=2, sinks=4, window=64),
        "trie": lambda: TrieDrafter(Trie(TrieSettings(decoding_length=4, branch_length=3, window=6))),
        "two-level": NoDrafter,
    }


@pytest.mark.parametrize("bottom", ["streaming-draft", "trie", "two-level"])
def test_hierarchy_greedy_equals_transformers_greedy(bottom, tiny_pair):
    loaded, target, draft = tiny_pair
    make = bottoms(target, draft)[bottom]
    for seed, (gamma1, gamma2, budget, chunk, stride) in enumerate([(2, 4, 384, 8, 16), (1, 3, 256, 16, 32)]):
        prompt = long_prompt(400, seed)
        drafter = HierarchicalDrafter(target, make(), gamma1, gamma2, RetrievalSettings(budget, chunk, stride))
        due_after_step = []
        update = drafter.update

        def recording_update(*args, update=update, drafter=drafter, due_after_step=due_after_step):
            update(*args)
            due_after_step.append(drafter.rebuild_due)

        drafter.update = recording_update
        result = SpeculativeEngine(target, drafter).generate(prompt, 60, SamplingParams())
        assert result.tokens == hf_greedy(loaded, prompt, 60)
        assert drafter.retrieval.builds >= 2  # rebuilt along the way
        # Each rebuild is built when the next step starts: none after the last step.
        assert drafter.retrieval.builds == 1 + sum(due_after_step[:-1])
        assert result.tokens_per_step > 1.0


@pytest.mark.parametrize("sat_out", [RESELECT_AFTER_IDLE_STEPS - 1, RESELECT_AFTER_IDLE_STEPS])
def test_a_sequence_drafting_again_after_sitting_out_long_reselects_its_retrieval_cache(sat_out, tiny_pair):
    """A sequence that sat out RESELECT_AFTER_IDLE_STEPS steps rebuilds its retrieval cache at the step it drafts
    again, on that step's root; one that sat out fewer keeps its selection. The output is the target's either way."""
    loaded, target, _ = tiny_pair
    prompt = long_prompt(400, 3)
    drafter = HierarchicalDrafter(target, NoDrafter(), 1, 2, RetrievalSettings(384, 8, 1000))
    # after each step, whether the next drafts: the first drafted step builds, then `sat_out` steps sit out
    decisions = iter([True] + [False] * sat_out + [True] * 64)
    update = drafter.update

    def deciding_update(*args):
        update(*args)
        drafter.drafting = next(decisions)

    drafter.update = deciding_update
    result = SpeculativeEngine(target, drafter).generate(prompt, 40, SamplingParams())
    assert result.tokens == hf_greedy(loaded, prompt, 40)
    assert result.drafted_per_step[2:2 + sat_out] == [0] * sat_out and result.drafted_per_step[2 + sat_out] > 0
    assert drafter.retrieval.builds == (2 if sat_out >= RESELECT_AFTER_IDLE_STEPS else 1)


def test_bottom_follows_the_top_and_does_not_cost_acceptance(tiny_pair):
    """With greedy decoding every bottom yields the middle level's own greedy chain, so the top accepts as
    much of it as in the two-level variant; a bottom that lost track of the committed tokens would feed the
    middle level a wrong root and fall far behind."""
    loaded, target, draft = tiny_pair
    prompt = long_prompt(400, 7)
    top_acceptance = {}
    for name, make in bottoms(target, draft).items():
        drafter = HierarchicalDrafter(target, make(), 2, 6, RetrievalSettings(384, 8, 64))
        out = SpeculativeEngine(target, drafter).generate(prompt, 80, SamplingParams()).tokens
        # All emitted tokens but the next root are committed; the whole output when the last step was cut
        # at max_new_tokens inside the accepted path.
        everything = prompt + out
        bottom = drafter.bottom
        if isinstance(bottom, TrieDrafter):
            assert bottom.sequence[:bottom.length].tolist() in (everything[:-1], everything)
        if isinstance(bottom, StreamingDrafter):
            assert bottom.positions in (len(everything) - 1, len(everything))
        top_acceptance[name] = drafter.stats["accepted"] / drafter.stats["chain_tokens"]
    assert top_acceptance["two-level"] > 0.15  # random weights: retrieval costs a tiny model much agreement
    for name in ("trie", "streaming-draft"):
        assert top_acceptance[name] >= 0.9 * top_acceptance["two-level"], top_acceptance


def test_a_chain_reports_its_middle_rounds_as_its_draft_passes(tiny_pair):
    """A drafted step's middle rounds follow its text, which its price follows (decoder/gate.py, DraftPasses): each
    chain reports its own; without a bottom a round adds one token, so a chain of gamma2 takes gamma2 rounds."""
    _, target, draft = tiny_pair
    for name, make in bottoms(target, draft).items():
        drafter = HierarchicalDrafter(target, make(), 2, 6, RetrievalSettings(384, 8, 64))
        passes: list[int] = []
        update = drafter.update

        def noting_update(tree, accepted, next_token, update=update, drafter=drafter, passes=passes):
            if tree.size > 1:
                passes.append(drafter.draft_passes)
            update(tree, accepted, next_token)

        drafter.update = noting_update
        SpeculativeEngine(target, drafter).generate(long_prompt(400, 3), 40, SamplingParams())
        assert passes and sum(passes) == drafter.stats["rounds"], name
        assert all(1 <= p <= 6 for p in passes), name
        if name == "two-level":
            assert set(passes) == {6}


def test_a_trie_bottom_sitting_out_tells_the_middle_rounds_its_chains_would_take(tiny_pair):
    """A sequence sitting out drafts nothing, yet its trie bottom's first-round draft at each step it sits out, walked
    by the text that follows, tells the middle rounds a chain there would take (Drafter.shadow_passes, which its
    drafted step's price follows): ceil(gamma2 / (matched + 1)), gamma2 where the bottom has no match. The roots it
    sits out enter the trie at once, so that text seen only while sitting out is drafted from; off, it tells none."""
    _, target, _ = tiny_pair
    gamma1, gamma2 = 2, 6
    drafter = HierarchicalDrafter(target, TrieDrafter(Trie(bottom_trie_settings(gamma1))), gamma1, gamma2,
                                  RetrievalSettings(384, 8, 64))
    drafter.reset(long_prompt(400, 5), 600)
    fresh = [300, 301, 302, 303, 304, 305]  # ids the prompt (below 256) does not hold
    for token in fresh:
        drafter.idle(token)
    assert drafter.shadow_passes() == [gamma2] * len(fresh)
    for token in fresh:  # again: the trie took them while the sequence sat out, and every first round lands
        drafter.idle(token)
    told = drafter.shadow_passes()
    assert told and set(told) == {math.ceil(gamma2 / (gamma1 + 1))} and drafter.shadow_passes() == []
    drafter.draft_nodes(1)  # the schedule's off
    drafter.idle(300)
    assert drafter.shadow_passes() == []


def test_streaming_only_drafter_is_lossless(tiny_pair):
    loaded, target, _ = tiny_pair
    prompt = long_prompt(300, 5)
    drafter = StreamingDrafter(target, gamma=3, sinks=4, window=48)  # the target itself, short window
    result = SpeculativeEngine(target, drafter).generate(prompt, 50, SamplingParams())
    assert result.tokens == hf_greedy(loaded, prompt, 50)


class _RoundsPerRequest(HierarchicalDrafter):
    """Notes its round count at the start of every request it serves."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.round_marks: list[int] = []

    def reset(self, prompt, max_len):
        self.round_marks.append(self.stats["rounds"])
        super().reset(prompt, max_len)

    def rounds_per_request(self) -> np.ndarray:
        return np.diff(self.round_marks + [self.stats["rounds"]])


@pytest.mark.slow
def test_hierarchy_sampling_is_distributed_as_the_target(toy_pair):
    """The samples share their steps through the batching scheduler; each slot's drafter serves one sample after
    another, as a server keeps it: a request's reset must leave nothing of the last one. A temperature and a top-p
    cut: both transforms of the target's distribution at once (T = 1 runs in every other method's tests). The first
    three tokens: a sequence's first step is plain, its first chain drafts the next two."""
    target_hf, target, draft = toy_pair
    params = SamplingParams(temperature=0.5, top_p=0.8)
    prompt = [int(x) for x in np.random.default_rng(32).integers(0, VOCAB, 40)]  # two uncertain tokens
    drafters = []

    def make() -> _RoundsPerRequest:
        drafters.append(_RoundsPerRequest(target, StreamingDrafter(draft, gamma=2, sinks=2, window=8), 2, 4,
                                          RetrievalSettings(budget=16, chunk=4, stride=8)))
        return drafters[-1]

    counts, accepted = sample_first_tokens_batched(SpeculativeEngine(target, make()), make, prompt, params, SAMPLES,
                                                   tokens=3)
    per_sample = np.concatenate([drafter.rounds_per_request() for drafter in drafters])
    assert len(per_sample) == SAMPLES
    middle_corrections = np.mean(per_sample > 2)  # a middle rejection cut a round
    assert accepted > 0.2 and middle_corrections > 0.1
    assert_distributed_as_target(counts, first_tokens_distribution(target_hf, prompt, params, tokens=3))


@pytest.mark.parametrize("settings, gammas, message", [
    (RetrievalSettings(budget=60, chunk=8), (2, 4), "does not divide"),
    (RetrievalSettings(budget=512, chunk=8), (2, 4), "not below the context"),
    (RetrievalSettings(budget=64, chunk=8), (4, 2), "gamma1 <= gamma2"),
])
def test_bad_settings(settings, gammas, message, tiny_pair):
    _, target, _ = tiny_pair
    with pytest.raises(UserError, match=message):
        drafter = HierarchicalDrafter(target, NoDrafter(), *gammas, settings)
        SpeculativeEngine(target, drafter).generate(long_prompt(300, 0), 4, SamplingParams())


TRIFORCE_ACCEPTANCE = {
    "kind": "acceptance/triforce", "models": {"target": "tiny-random-llama", "bottom": "trie"}, "temperature": 0.0,
    "entries": [
        {"context": 4096, "budget": 256, "chunk": 8, "stride": 64, "middle": 0.7, "bottom": 0.5},
        {"context": 4096, "budget": 1024, "chunk": 8, "stride": 64, "middle": 0.9, "bottom": 0.5},
    ],
}
FLAT_PROFILE = {  # t(n, L) = 10 ms + 1 ms per new token at 264 tokens of context, 4x that at 4096
    "kind": "profile/latency", "models": {"target": "tiny-random-llama"},
    "target": {"context": 264, "t_seconds": {1: 0.011, 2: 0.012, 4: 0.014, 8: 0.018, 16: 0.026, 32: 0.042},
               "contexts": {264: {"t_seconds": {1: 0.011, 2: 0.012, 4: 0.014, 8: 0.018, 16: 0.026, 32: 0.042}},
                            4096: {"t_seconds": {1: 0.044, 2: 0.048, 4: 0.056, 8: 0.072, 16: 0.104,
                                                 32: 0.168}}}},
}


def first_entry() -> TriForceEntry:
    return TriForceAcceptance.from_dict(TRIFORCE_ACCEPTANCE, "acceptance").entries[0]


def test_triforce_cost_model_by_hand():
    from specplan.core.profile_schema import LatencyProfile
    from specplan.planner.triforce_cost import evaluate, expected_tokens

    profile = LatencyProfile.from_dict(FLAT_PROFILE, "profile")
    entry = first_entry()
    c = evaluate(profile, 4096, entry, gamma1=2, gamma2=4, bottom_seconds=0.001)
    per_round = 1 + 0.5 + 0.25  # E(0.5, 2)
    rounds = 3  # ceil(4 / 1.75)
    chain = rounds * per_round  # 5.25 tokens
    middle_context = 256 + 8  # the budget plus one chunk: t(n, 264) from the profile
    round_cost = 2 * 0.001 + profile.latency(3, middle_context)
    top = profile.latency(chain + 1, 4096)
    tokens = (1 - 0.7 ** (chain + 1)) / (1 - 0.7)
    per_token = (rounds * round_cost + top) / tokens + 0.044 / 64
    assert c.chain_tokens == pytest.approx(chain)
    assert c.tokens_per_step == pytest.approx(tokens) == pytest.approx(expected_tokens(0.7, chain))
    assert c.seconds_per_token == pytest.approx(per_token)
    assert c.speedup == pytest.approx(0.044 / per_token)


def test_solve_and_show_triforce(run_cli, write_yaml_file, tmp_path):
    acceptance = write_yaml_file("acc.yaml", TRIFORCE_ACCEPTANCE)
    profile = write_yaml_file("prof.yaml", FLAT_PROFILE)
    assert run_cli("show", acceptance)[1].count("4096") == 2
    out = tmp_path / "plan.yaml"
    code, stdout, stderr = run_cli("solve", "triforce", "--acceptance", acceptance, "--profile", profile, "-o", out)
    assert code == 0, stderr
    from specplan.core.plan_schema import load_plan

    plan = load_plan(out)
    assert plan.settings.budget == 1024  # the better middle acceptance wins here
    assert plan.settings.bottom == "trie" and plan.settings.gamma2 >= plan.settings.gamma1
    assert 0 < plan.prediction.details["best_two_level"]["speedup"] < plan.prediction.speedup
    assert plan.provenance["command"] == f"plan solve triforce --acceptance {acceptance} --profile {profile} -o {out}"
    useless_bottom = dict(TRIFORCE_ACCEPTANCE, entries=[dict(e, bottom=0.0) for e in TRIFORCE_ACCEPTANCE["entries"]])
    code, _, stderr = run_cli("solve", "triforce", "--acceptance", write_yaml_file("useless.yaml", useless_bottom),
                              "--profile", profile, "-o", tmp_path / "dropped.yaml")
    dropped = load_plan(tmp_path / "dropped.yaml")  # drafts never accepted only cost: the plan drops the bottom
    assert code == 0 and dropped.settings.bottom == "none", stderr
    assert dropped.prediction.speedup == dropped.prediction.details["best_two_level"]["speedup"]
    hopeless = dict(TRIFORCE_ACCEPTANCE, entries=[dict(e, middle=0.0) for e in TRIFORCE_ACCEPTANCE["entries"]])
    code, _, stderr = run_cli("solve", "triforce", "--acceptance", write_yaml_file("hopeless.yaml", hopeless),
                              "--profile", profile, "-o", tmp_path / "hopeless-plan.yaml")
    assert code == 0 and "no setting is predicted faster than 1.05x one-token decoding at context 4096" in stderr
    hopeless_plan = load_plan(tmp_path / "hopeless-plan.yaml")  # decodes one token per step instead
    assert not hopeless_plan.settings.speculate and hopeless_plan.prediction.speedup == 1.0
    assert hopeless_plan.prediction.details["best_speculative"]["speedup"] < 1
    assert hopeless_plan.prediction.seconds_per_token == pytest.approx(0.044)  # t(1, 4096)
    plan = load_plan(out)
    for margin, speculates in ((plan.prediction.speedup * 0.99, True), (plan.prediction.speedup * 1.01, False)):
        code, _, stderr = run_cli("solve", "triforce", "--acceptance", acceptance, "--profile", profile,
                                  "--min-speedup", str(margin), "-o", tmp_path / "margin.yaml")
        assert code == 0 and load_plan(tmp_path / "margin.yaml").settings.speculate == speculates, stderr
    for bad in ("nan", "0"):
        code, _, stderr = run_cli("solve", "triforce", "--acceptance", acceptance, "--profile", profile,
                                  "--min-speedup", bad, "-o", tmp_path / "bad.yaml")
        assert code == 2 and "--min-speedup" in stderr and not (tmp_path / "bad.yaml").exists()
    code, stdout, _ = run_cli("solve", "triforce", "--acceptance", acceptance, "--profile", profile, "--two-level",
                              "-o", tmp_path / "two.yaml")
    assert code == 0 and load_plan(tmp_path / "two.yaml").settings.bottom == "none"


def test_decoded_settings_are_kept_unless_another_is_clearly_faster(write_yaml_file):
    """The decoded plan's replay is exact, the others' approximate: a near-tie (within 2%) keeps the decoded
    settings, so that decoding and solving again settles; a clearly faster setting replaces them."""
    from specplan.planner.triforce import REPLAY_SWITCH_MARGIN, solve_triforce

    profile = write_yaml_file("prof.yaml", FLAT_PROFILE)
    _, ranked = solve_triforce(write_yaml_file("acc.yaml", TRIFORCE_ACCEPTANCE), profile)
    best = ranked[0]
    near = next(c for c in ranked if c.gamma1 > 0 and best.speedup / (1 + REPLAY_SWITCH_MARGIN) < c.speedup
                < best.speedup)
    slow = next(c for c in ranked if c.gamma1 > 0 and c.speedup < best.speedup / (1 + REPLAY_SWITCH_MARGIN))
    for decoded, kept in ((near, near), (slow, best)):
        settings = {"bottom": "trie", "gamma1": decoded.gamma1, "gamma2": decoded.gamma2, "budget": decoded.budget,
                    "chunk": decoded.chunk, "stride": decoded.stride}
        acceptance = dict(TRIFORCE_ACCEPTANCE, decoded_with={"plan": "p.yaml", **settings})
        plan, _ = solve_triforce(write_yaml_file("decoded.yaml", acceptance), profile)
        assert (plan.settings.gamma1, plan.settings.gamma2, plan.settings.budget) == (
            max(kept.gamma1, 1), kept.gamma2, kept.budget)
        assert plan.prediction.replay_exact == (kept is decoded)


def test_model_bottom_is_priced_over_its_streaming_cache(run_cli, write_yaml_file, tmp_path):
    """The draft drafts over sinks + window cached tokens: its step is read there, linear between the draft's
    profiled contexts (4 + 1020 = 1024 tokens: halfway from 264 to 1784)."""
    acceptance = dict(TRIFORCE_ACCEPTANCE, models={"target": "tiny-random-llama", "bottom": "tiny-random-llama-draft"},
                      bottom_cache={"sinks": 4, "window": 1020})
    profile = dict(FLAT_PROFILE, draft={"step_seconds": 0.002, "context": 264, "t_seconds": {1: 0.002},
                                        "contexts": {264: {"step_seconds": 0.002, "t_seconds": {1: 0.002}},
                                                     1784: {"step_seconds": 0.004, "t_seconds": {1: 0.004}}}})
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "triforce", "--acceptance", write_yaml_file("acc.yaml", acceptance),
                              "--profile", write_yaml_file("prof.yaml", profile), "-o", out)
    assert code == 0, stderr
    from specplan.core.plan_schema import load_plan

    plan = load_plan(out)
    assert plan.settings.bottom == "model" and plan.settings.window == 1020
    assert plan.inputs["bottom_seconds_per_draft"] == pytest.approx(0.003)
    assert plan.inputs["window_prefill_seconds"] is None  # not profiled: unpriced, and the plan says so
    # Profiled for this window, the draft's prefill (50 ms) is charged once per prompt of the replay (two of 40
    # tokens: 1.25 ms a token); profiled for another window, it is not read.
    traced = dict(acceptance, entries=[dict(e, traces=[{"middle": [1] * 40, "bottom": [1] * 40}] * 2)
                                       for e in acceptance["entries"]])
    per_token = {}
    for window, charged in ((1020, 0.05), (1024, None)):
        prefilled = dict(profile, draft=dict(profile["draft"], window_prefill={"sinks": 4, "window": window,
                                                                               "seconds": 0.05}))
        code, _, stderr = run_cli("solve", "triforce", "--acceptance", write_yaml_file("traced.yaml", traced),
                                  "--profile", write_yaml_file("prof.yaml", prefilled), "-o", out)
        assert code == 0, stderr
        plan = load_plan(out)
        assert plan.settings.bottom == "model" and plan.inputs["window_prefill_seconds"] == charged
        per_token[charged] = plan.prediction.seconds_per_token
    assert per_token[0.05] == pytest.approx(per_token[None] + 0.05 / 40)
    # `plan bench --reprice` re-times the draft's window prefill the plan charges, and re-prices with it
    from specplan.core.profile_schema import load_profile
    from specplan.planner.triforce_reprice import priced_points, reprice

    prefilled = write_yaml_file("prof.yaml", dict(profile, draft=dict(
        profile["draft"], window_prefill={"sinks": 4, "window": 1020, "seconds": 0.05})))
    run_cli("solve", "triforce", "--acceptance", write_yaml_file("traced.yaml", traced), "--profile", prefilled,
            "-o", out)
    plan, solved = load_plan(out), load_profile(prefilled)
    assert priced_points(plan, solved).window_prefill == "draft"
    own, _ = reprice(plan, solved)
    slower, _ = reprice(plan, solved.with_points({}, {}, {}, {"draft": 0.09}))
    assert own.seconds_per_token == pytest.approx(per_token[0.05])
    assert slower.seconds_per_token == pytest.approx(own.seconds_per_token + 0.04 / 40)
    # an acceptance file without the plan's setting is one line naming the setting (it raised a TypeError)
    from dataclasses import replace

    unrelated = replace(plan, settings=replace(plan.settings, budget=plan.settings.budget * 2),
                        prediction=replace(plan.prediction, details={}))
    with pytest.raises(UserError, match=f"has no entry for context {plan.settings.context}, budget"):
        priced_points(unrelated, solved)


def test_point_timer_times_a_window_prefill():
    from specplan.profiler.latency import PointTimer

    lean = LeanModel(load_model("tiny-random-llama", "fp32").model)
    timer = PointTimer(lean, None, {64: [1, 2]}, {}, [], ("target", 2, 8))
    timer.run(2)
    target, builds, draft, window_prefill = timer.medians()
    assert set(target[64]) == {1, 2} and builds == {} and draft == {}
    assert set(window_prefill) == {"target"} and window_prefill["target"] > 0
    with pytest.raises(ValueError, match="no draft model"):
        PointTimer(lean, None, {}, {}, [], ("draft", 2, 8))


def test_triforce_trace_replay_by_hand():
    """Two-level, gamma2 = 2, middle trace 1 1 0 1: the first token comes from a plain step, t(1, 4096) (its
    forward's query scores the first build); from 1 the top accepts the chain's first token and corrects its
    second (tokens 1-2), then from 3 to the end: 2 drafted steps of 2 x t(1, 264) + t(3, 4096) each, 1.5 tokens
    each (the profile is linear: t(n) = 40 + 4n ms at 4096, 10 + n ms at 264). The continuation also pays its
    first build, priced at t(1, 4096) by a profile without builds, at 5 ms by one with them."""
    from specplan.core.profile_schema import LatencyProfile
    from specplan.planner.triforce_cost import evaluate_traces

    profile = LatencyProfile.from_dict(FLAT_PROFILE, "profile")
    entry = replace(first_entry(), traces=[TriForceTrace(np.array([1.0, 1.0, 0.0, 1.0]), np.ones(4))])
    c = evaluate_traces(profile, 4096, entry, gamma1=1, gamma2=2, bottom_seconds=None, top_costs={})
    step = 2 * 0.011 + 0.052
    assert c.tokens_per_step == pytest.approx(1.5)
    assert c.step_seconds == pytest.approx(step)
    assert c.speedup == pytest.approx(0.044 / ((2 * step + 0.044 + 0.044) / 4))
    builds = {**FLAT_PROFILE["target"]["contexts"][4096], "retrieval_build_seconds": {128: 0.003, 384: 0.007}}
    timed = LatencyProfile.from_dict(
        {**FLAT_PROFILE, "target": {**FLAT_PROFILE["target"],
                                    "contexts": {**FLAT_PROFILE["target"]["contexts"], 4096: builds}}}, "profile")
    assert timed.retrieval_build(4096, 256) == pytest.approx(0.005)
    c = evaluate_traces(timed, 4096, entry, gamma1=1, gamma2=2, bottom_seconds=None, top_costs={})
    assert c.speedup == pytest.approx(0.044 / ((2 * step + 0.044 + 0.005) / 4))
    # With a stride of 2 a rebuild falls due after 2 of the 4 tokens inserted; the one due after the last
    # step is never built.
    c = evaluate_traces(timed, 4096, replace(entry, stride=2), gamma1=1, gamma2=2, bottom_seconds=None, top_costs={})
    assert c.speedup == pytest.approx(0.044 / ((2 * step + 0.044 + 2 * 0.005) / 4))
    # A trie bottom, gamma1 = 2, gamma2 = 3, two positions: the plain first step, then one round of 3 tokens (the
    # bottom's trace beyond the end counts at its mean), and the top verifies the root and 3 tokens.
    one = replace(entry, traces=[TriForceTrace(np.array([1.0, 1.0]), np.array([1.0, 1.0]))])
    c = evaluate_traces(profile, 4096, one, gamma1=2, gamma2=3, bottom_seconds=0.001, top_costs={})
    assert c.chain_tokens == 3 and c.tokens_per_step == 1.0
    assert c.step_seconds == pytest.approx(2 * 0.001 + 0.013 + 0.056)
    # A model bottom's window prefill, 0.3 s, is paid once per continuation (4 tokens here); the two-level
    # variant has no bottom to pay it.
    model = evaluate_traces(profile, 4096, entry, gamma1=1, gamma2=2, bottom_seconds=0.001, top_costs={})
    prefilled = evaluate_traces(profile, 4096, entry, gamma1=1, gamma2=2, bottom_seconds=0.001, top_costs={},
                                window_prefill=0.3)
    assert prefilled.seconds_per_token == pytest.approx(model.seconds_per_token + 0.3 / 4)
    two_level = evaluate_traces(profile, 4096, entry, gamma1=1, gamma2=2, bottom_seconds=None, top_costs={},
                                window_prefill=0.3)
    assert two_level.seconds_per_token == pytest.approx((2 * step + 0.044 + 0.044) / 4)


def test_streaming_draft_replay_by_hand():
    """The StreamingLLM-only draft, gamma2 = 2, trace 1 0 1 (three positions): the top accepts one draft and
    corrects the next (tokens 0-1), then accepts the rest: 2 steps of 2 x c_s + t(3, 4096 + p). The target
    itself drafts here: c_s = t(1, 4 + 1024), read between the profile's contexts. No retrieval cache: no
    first forward of the root and no build."""
    from specplan.core.profile_schema import LatencyProfile
    from specplan.planner.triforce_cost import evaluate_streaming, evaluate_traces, streaming_seconds

    profile = LatencyProfile.from_dict(FLAT_PROFILE, "profile")
    record = StreamingRecord(context=4096, drafter="target", acceptance=2 / 3, traces=[np.array([1.0, 0.0, 1.0])])
    c_s = streaming_seconds(profile, record, 1028)
    assert c_s == pytest.approx(float(profile.latency(1, 1028))) and 0.011 < c_s < 0.044
    entry = replace(first_entry(), traces=[TriForceTrace(np.ones(3), np.ones(3))])
    two_level = evaluate_traces(profile, 4096, entry, gamma1=1, gamma2=2, bottom_seconds=None, top_costs={})
    c = evaluate_streaming(profile, 4096, record, 2, c_s, {}, two_level)
    assert c.streaming and (c.budget, c.chunk, c.stride) == (256, 8, 64)
    assert c.tokens_per_step == pytest.approx(1.5)
    assert c.seconds_per_token == pytest.approx((2 * (2 * c_s + 0.052)) / 3)
    assert c.speedup == pytest.approx(0.044 / c.seconds_per_token)
    prefilled = evaluate_streaming(profile, 4096, record, 2, c_s, {}, two_level, window_prefill=0.3)
    assert prefilled.seconds_per_token == pytest.approx((2 * (2 * c_s + 0.052) + 0.3) / 3)


def test_planner_chooses_the_streaming_draft_where_it_pays(run_cli, write_yaml_file, tmp_path):
    """A draft the top always accepts and no retrieval setting to match it: the plan drafts with the
    StreamingLLM cache alone (`bottom: streaming`), and decodes losslessly; a useless one is only recorded;
    --two-level ignores it."""
    from specplan.core.plan_schema import load_plan
    from specplan.core.profile_schema import load_profile
    from specplan.decoder.api import load_decoder

    profile = write_yaml_file("prof.yaml", FLAT_PROFILE)
    perfect = {"context": 4096, "drafter": "target", "acceptance": 1.0, "traces": [[1] * 40, [1] * 30]}
    traced = [dict(e, traces=[{"middle": [1, 0] * 20, "bottom": [1] * 40}, {"middle": [0, 1] * 15,
                                                                           "bottom": [1] * 30}])
              for e in TRIFORCE_ACCEPTANCE["entries"]]
    outcomes = {}
    for name, record, extra in (("perfect", perfect, []), ("useless", dict(perfect, acceptance=0.0, traces=[
            [0] * 40, [0] * 30]), []), ("two-level", perfect, ["--two-level"])):
        acceptance = write_yaml_file(f"{name}.yaml", dict(TRIFORCE_ACCEPTANCE, entries=traced, streaming=[record]))
        out = tmp_path / f"{name}-plan.yaml"
        code, _, stderr = run_cli("solve", "triforce", "--acceptance", acceptance, "--profile", profile,
                                  "--min-speedup", "0.01", "-o", out, *extra)
        assert code == 0, stderr
        outcomes[name] = load_plan(out)
    plan = outcomes["perfect"]
    assert plan.settings.bottom == "streaming" and plan.models.draft is None
    assert plan.prediction.speedup == plan.prediction.details["best_streaming"]["speedup"] > 1
    assert plan.prediction.details["best_streaming"]["gamma2"] == plan.settings.gamma2
    two = plan.prediction.details["best_two_level"]
    assert (plan.settings.budget, plan.settings.chunk, plan.settings.stride) == (
        two["budget"], two["chunk"], two["stride"])
    assert plan.inputs["streaming_seconds_per_draft"] > 0
    assert_repricing_reads_exactly_the_priced_points(plan, load_profile(profile))
    decoder = load_decoder(str(tmp_path / "perfect-plan.yaml"), target="tiny-random-llama", dtype="fp32")
    drafter = decoder.engine.drafter
    assert isinstance(drafter, StreamingDrafter) and drafter.gamma == plan.settings.gamma2
    assert drafter.model is decoder.target_forward and drafter.window == 1024
    prompt = long_prompt(300, 5)
    assert decoder.engine.generate(prompt, 40, SamplingParams()).tokens == hf_greedy(decoder.target, prompt, 40)
    assert outcomes["useless"].settings.bottom != "streaming"
    assert outcomes["useless"].prediction.details["best_streaming"]["speedup"] < outcomes["useless"].prediction.speedup
    assert outcomes["two-level"].settings.bottom == "none" and "best_streaming" not in outcomes[
        "two-level"].prediction.details


@pytest.mark.parametrize("record, message", [
    ({"context": 4096, "drafter": "draft", "acceptance": 0.5, "traces": [[1, 0]]}, "needs a model bottom"),
    ({"context": 4096, "drafter": "other", "acceptance": 0.5, "traces": [[1, 0]]}, "draft or target"),
    ({"context": 4096, "drafter": "target", "acceptance": 0.5, "traces": [[]]}, "non-empty per-prompt lists"),
    ({"context": 4096, "drafter": "target", "acceptance": 0.5, "traces": [[1, 2]]}, "traces[0][1]"),
    ({"context": 4096, "drafter": "target", "acceptance": float("nan"), "traces": [[1]]}, "acceptance"),
])
def test_bad_streaming_records_are_rejected(record, message, run_cli, write_yaml_file, tmp_path):
    acceptance = write_yaml_file("acc.yaml", {**TRIFORCE_ACCEPTANCE, "streaming": [record]})
    code, _, stderr = run_cli("solve", "triforce", "--acceptance", acceptance, "--profile",
                              write_yaml_file("prof.yaml", FLAT_PROFILE), "-o", tmp_path / "plan.yaml")
    assert code == 2 and message in stderr and one_error(stderr), stderr
    assert not (tmp_path / "plan.yaml").exists()


def test_triforce_replays_recorded_trie_runs_by_hand():
    """gamma1 = 2, gamma2 = 3, the middle right everywhere, the trie's recorded runs 0 2 0 1 0 1 0 (its first
    proposals, all wrong, would give one token per round): 0 is the plain first step's; at 1 one round of 1 + 2
    tokens, the top keeps the chain and a bonus token; at 5 rounds of 1 + 1 and 1 + 4/7 (the mean run past the
    end), a chain of 4."""
    from specplan.core.profile_schema import LatencyProfile
    from specplan.planner.triforce_cost import evaluate_traces

    profile = LatencyProfile.from_dict(FLAT_PROFILE, "profile")
    runs = np.zeros((8, 7), dtype=np.int64)
    runs[1] = [0, 2, 0, 1, 0, 1, 0]
    entry = replace(first_entry(), traces=[TriForceTrace(np.ones(7), np.zeros(7), runs)])
    c = evaluate_traces(profile, 4096, entry, gamma1=2, gamma2=3, bottom_seconds=0.001, top_costs={})
    round_cost = 2 * 0.001 + 0.013  # t(3, 264)
    assert c.tokens_per_step == pytest.approx(3.0)
    assert c.step_seconds == pytest.approx((round_cost + 0.056 + 2 * round_cost + 0.060) / 2)  # t(4), t(5) at 4096


def test_trie_runs_follow_the_middle_and_stop_off_the_text():
    """Trees: at 0 the chain 5 6 7; at 1 the branches 6 and 9 7; at 2 nothing. Where the middle picks the text
    5 6 7, the walks take 5 6 7, then 6 (7 hangs under 9), then nothing. Where it picks 5 9 7 on the text
    5 6 7, the walk at 1 takes 9, off the text, and stops there: the middle's rows past it were computed on
    the text, not after 9."""
    from specplan.profiler.triforce_acceptance import _trie_runs

    trees = [(np.array([1, 5, 6, 7]), np.array([-1, 0, 1, 2])), (np.array([5, 6, 9, 7]), np.array([-1, 0, 0, 2])),
             (np.array([6]), np.array([-1]))]
    text = np.array([5, 6, 7])
    assert _trie_runs(trees, text, text) == "310"
    assert _trie_runs(trees, np.array([5, 9, 7]), text) == "110"


@pytest.mark.slow
def test_accept_triforce_keeps_traces_that_solve_replays(run_cli, tmp_path):
    from specplan.core.acceptance_schema import load_triforce_acceptance
    from specplan.core.plan_schema import load_plan
    from specplan.core.profile_schema import load_profile
    from specplan.decoder.api import load_decoder
    from specplan.decoder.drafters import NoDrafter
    from specplan.planner.triforce_cost import evaluate_traces
    from specplan.profiler.haystack import build_prompts

    out = tmp_path / "acc.yaml"
    code, _, stderr = run_cli("accept", "triforce", "--target", "tiny-random-llama", "--dataset",
                              "haystack", "--contexts", "300", "--prompts", "2", "--budgets", "64",
                              "--chunks", "8", "--strides", "16", "--max-new-tokens", "12", "-o", out)
    assert code == 0, stderr
    acceptance = load_triforce_acceptance(out)
    (entry,) = acceptance.entries
    assert len(entry.traces) == 2
    middle = np.concatenate([t.middle for t in entry.traces])
    bottom = np.concatenate([t.bottom for t in entry.traces])
    assert all(1 <= len(t.middle) <= 12 for t in entry.traces) and entry.extra["positions"] == len(middle)
    assert set(np.unique(middle)) <= {0.0, 1.0}
    assert entry.middle == pytest.approx(middle.mean()) and entry.bottom == pytest.approx(bottom.mean())
    for trace in entry.traces:
        runs = trace.bottom_runs
        assert runs.shape == (8, len(trace.middle)) and (runs <= np.arange(1, 9)[:, None]).all()
    (streaming,) = acceptance.streaming  # the target itself over a StreamingLLM cache, against the full target
    assert streaming.context == 300 and streaming.drafter == "target"
    assert [len(t) for t in streaming.traces] == [len(t.middle) for t in entry.traces]
    assert streaming.acceptance == pytest.approx(np.concatenate(streaming.traces).mean())
    profile = tmp_path / "prof.yaml"
    assert run_cli("profile", "--target", "tiny-random-llama", "--contexts", "72,300", "--sizes", "1,2,4,8,16,32",
                   "--repeats", "1", "-o", profile)[0] == 0
    # A tiny model's timings put the plan near one-token decoding: speculate whatever they say. Its window
    # holds the whole context, so the streaming draft is the target and might win: a hierarchy plan is what
    # this test follows, so it solves without the streaming record.
    document = yaml.safe_load(out.read_text())
    del document["streaming"]
    out.write_text(yaml.safe_dump(document))
    code, _, stderr = run_cli("solve", "triforce", "--acceptance", out, "--profile", profile, "--min-speedup",
                              "0.01", "-o", tmp_path / "plan.yaml")
    assert code == 0, stderr
    plan = tmp_path / "plan.yaml"
    assert "replayed" in load_plan(plan).solver["algorithm"]
    assert_repricing_reads_exactly_the_priced_points(load_plan(plan), load_profile(profile))

    # Measured along the plan's own decoded text (in fp32 the target's: the first proposals along it are the
    # same) and in its steps: the replay of the plan's own settings then takes the decoder's steps.
    decoded = tmp_path / "decoded.yaml"
    code, _, stderr = run_cli("accept", "triforce", "--target", "tiny-random-llama", "--dataset",
                              "haystack", "--contexts", "300", "--prompts", "2", "--budgets", "64",
                              "--chunks", "8", "--strides", "16", "--max-new-tokens", "12", "--decode-with", plan,
                              "-o", decoded)
    assert code == 0, stderr
    redecoded = load_triforce_acceptance(decoded)
    for again, first in zip(redecoded.entries[0].traces, entry.traces, strict=True):
        assert np.array_equal(again.bottom, first.bottom)
    settings = load_plan(plan).settings
    assert redecoded.decoded_with == {"plan": str(plan), **{key: getattr(settings, key) for key in (
        "bottom", "gamma1", "gamma2", "budget", "chunk", "stride")}}
    code, _, stderr = run_cli("solve", "triforce", "--acceptance", decoded, "--profile", profile, "--min-speedup",
                              "0.01", "-o", tmp_path / "again.yaml")
    again = load_plan(tmp_path / "again.yaml")
    assert code == 0 and again.prediction.replay_exact == all(
        getattr(again.settings, key) == getattr(settings, key) for key in (
        "bottom", "gamma1", "gamma2", "budget", "chunk", "stride"))
    candidate = evaluate_traces(load_profile(profile), 300, redecoded.entries[0], settings.gamma1,
                                settings.gamma2, 2e-4, {})
    decoder = load_decoder(str(plan), target="tiny-random-llama", dtype="fp32")
    decoder.draft_every_step()  # the tiny model's plan may be priced below one-token decoding: its drafts declined
    steps = sum(decoder.engine.generate(p.ids, 12, SamplingParams()).steps
                for p in build_prompts("haystack", decoder.tokenizer, 300, 2))
    assert candidate.tokens_per_step == pytest.approx((len(middle) - 2) / (steps - 2))  # each prompt's plain first
    report_path = tmp_path / "report.json"
    code, stdout, stderr = run_cli("bench", "--plan", plan, "--target", "tiny-random-llama", "--dataset",
                                   "haystack", "--context", "300", "--prompts", "1",
                                   "--max-new-tokens", "12", "--baselines", "hf,ours-ar,two-level,streaming",
                                   "--reprice", "-o", report_path)
    assert code == 0, stderr
    report = json.loads(report_path.read_text())
    for name in ("ours", "ours-ar", "two-level", "streaming"):
        assert report["summary"][name]["identical_to_hf"] == 1
    repriced = report["prediction"]["repriced"]
    assert repriced["passes"] == 4
    assert repriced["profiled_speedup"] == pytest.approx(load_plan(plan).prediction.speedup)
    assert repriced["measured_over_repriced"] == pytest.approx(
        report["summary"]["ours"]["speedup_vs_ours-ar"] / repriced["speedup"])
    assert repriced["price_ratios"]["one_token_at_context"] > 0 and "re-priced with its" in stdout
    assert "planned_context" not in report["prediction"]
    code, stdout, stderr = run_cli("bench", "--plan", plan, "--target", "tiny-random-llama", "--dataset", "haystack",
                                   "--context", "320", "--prompts", "1", "--max-new-tokens", "4", "--baselines",
                                   "ours-ar", "-o", tmp_path / "longer.json")
    assert code == 0 and "solved for 300-token prompts and these hold 320" in stdout, stderr

    # Where no setting is predicted fast enough, the plan decodes one token per step; the bench still runs its
    # TriForce baselines at the best setting, and re-prices that setting.
    one_token = tmp_path / "one-token.yaml"
    code, _, stderr = run_cli("solve", "triforce", "--acceptance", out, "--profile", profile, "--min-speedup", "1000",
                              "-o", one_token)
    assert code == 0 and "the plan decodes one token per step" in stderr
    assert isinstance(load_decoder(str(one_token), target="tiny-random-llama", dtype="fp32").engine.drafter,
                      NoDrafter)
    code, stdout, stderr = run_cli("bench", "--plan", one_token, "--target", "tiny-random-llama", "--dataset",
                                   "haystack", "--context", "300", "--prompts", "1",
                                   "--max-new-tokens", "12", "--baselines", "hf,ours-ar,two-level,streaming",
                                   "--reprice", "-o", tmp_path / "one-token.json")
    assert code == 0, stderr
    one_token_report = json.loads((tmp_path / "one-token.json").read_text())
    assert one_token_report["summary"]["ours"]["tokens_per_step"] == 1.0
    assert one_token_report["summary"]["two-level"]["tokens_per_step"] > 1.0
    assert all(one_token_report["summary"][name]["identical_to_hf"] == 1 for name in ("ours", "two-level"))
    one_token_repriced = one_token_report["prediction"]["repriced"]
    assert one_token_repriced["speedup"] == 1.0 and one_token_repriced["best_speculative_profiled_speedup"] == \
        pytest.approx(load_plan(one_token).prediction.details["best_speculative"]["speedup"])
    assert "the plan decodes one token per step" in stdout
    for option, message in ((["--dtype", "bf16"], "not bf16"), (["--temperature", "0.7"], "greedy"),
                            (["--contexts", "64"], "not below the context")):
        code, _, stderr = run_cli("accept", "triforce", "--target", "tiny-random-llama", "--dataset",
                                  "haystack", "--decode-with", plan, *option, "-o", tmp_path / "x.yaml")
        assert code == 2 and message in stderr and one_error(stderr), stderr
        assert not (tmp_path / "x.yaml").exists()
    code, _, stderr = run_cli("accept", "triforce", "--target", "tiny-random-llama", "--dataset",
                              "haystack", "--contexts", "300", "--decode-with", one_token,
                              "-o", tmp_path / "x.yaml")
    assert code == 2 and "speculate: false" in stderr and one_error(stderr), stderr
    with open(out, "a") as handle:
        handle.write("# edited\n")
    code, _, stderr = run_cli("bench", "--plan", plan, "--target", "tiny-random-llama", "--dataset",
                              "haystack", "--context", "300", "--prompts", "1", "--baselines",
                              "ours-ar", "--reprice", "-o", tmp_path / "again.json")
    assert code == 2 and "changed after the plan was solved" in stderr and one_error(stderr)


def assert_repricing_reads_exactly_the_priced_points(plan, profile) -> None:
    """Re-priced with its own profile, a plan predicts what the solver did; with only the priced points slowed
    down 3x, what it predicts from a profile slowed down 3x everywhere (the trie's constant cost aside)."""
    from specplan.planner.triforce_reprice import priced_points, reprice

    own, own_two = reprice(plan, profile)
    assert own.speedup == pytest.approx(plan.prediction.speedup)
    assert own_two.speedup == pytest.approx(plan.prediction.details["best_two_level"]["speedup"])
    points = priced_points(plan, profile)
    assert plan.settings.context in points.target and 1 in points.target[plan.settings.context]
    slow = {L: {n: 3 * profile.latency(n, L).item() for n in sizes} for L, sizes in points.target.items()}
    slow_builds = {L: {b: 3 * profile.builds_by_context[L][b] for b in budgets} for L, budgets in points.builds.items()}
    everywhere = profile.with_points(
        {L: {n: 3 * t for n, t in curve.items()} for L, curve in profile.target_by_context.items()},
        {L: {b: 3 * t for b, t in builds.items()} for L, builds in profile.builds_by_context.items()}, {})
    for priced, slowed, unslowed in zip(reprice(plan, profile.with_points(slow, slow_builds, {})),
                                        reprice(plan, everywhere), (own, own_two)):
        assert priced.seconds_per_token == pytest.approx(slowed.seconds_per_token)
        assert priced.seconds_per_token > unslowed.seconds_per_token * 1.5


@pytest.mark.parametrize("trace, message", [
    ({"middle": [1, 0, 1], "bottom": [1, 1]}, "equal length"),
    ({"middle": [1, 0], "bottom": [1, 1], "bottom_runs": ["10"] * 7}, "must hold 8 strings"),
    ({"middle": [1, 0], "bottom": [1, 1], "bottom_runs": ["20"] + ["10"] * 7}, "none above its gamma1"),
    ({"middle": [1, 0], "bottom": [1, 1], "bottom_runs": ["1"] * 8}, "one digit per position"),
])
def test_bad_traces_are_rejected(trace, message, run_cli, write_yaml_file, tmp_path):
    entry = {**TRIFORCE_ACCEPTANCE["entries"][0], "traces": [trace]}
    acceptance = write_yaml_file("acc.yaml", {**TRIFORCE_ACCEPTANCE, "entries": [entry]})
    profile = write_yaml_file("prof.yaml", FLAT_PROFILE)
    code, _, stderr = run_cli("solve", "triforce", "--acceptance", acceptance, "--profile", profile, "-o",
                              tmp_path / "plan.yaml")
    assert code == 2 and message in stderr and one_error(stderr)
    assert not (tmp_path / "plan.yaml").exists()


def test_a_triforce_schedule_prices_each_chain_length_by_hand_and_turns_off_where_the_batch_is_compute_bound(
        tmp_path):
    """Two-level, middle trace 1 1 0 1: after the plain first step, gamma2 = 2 takes 2 steps of 1.5 tokens, 2 middle
    rounds of one row over the retrieval cache (context 264) and a top chain of 2 (3 rows); builds spread at b / R'
    per token, the plain first step and the first build (both t(1, 4096) here) once per request. With batched steps
    that cost in proportion to their rows, drafting pays alone and not beside seven others."""
    from specplan.core.method_settings import TriForceSettings
    from specplan.core.plan_schema import Plan, PlanModels, Prediction, load_plan, save_plan
    from specplan.core.profile_schema import LatencyProfile
    from specplan.planner.closed_loop import step_seconds
    from specplan.planner.triforce import triforce_schedule
    from specplan.planner.triforce_cost import setting_price

    document = {**FLAT_PROFILE, "target": {**FLAT_PROFILE["target"], "contexts": {
        context: {**curve, "batches": {B: {"t_seconds": {n: base + unit * B * n for n in (1, 2, 4, 8)}}
                                       for B in (2, 4, 8)}}
        for (context, curve), (base, unit) in zip(FLAT_PROFILE["target"]["contexts"].items(),
                                                  ((0.010, 0.004), (0.040, 0.020)))}}}
    profile = LatencyProfile.from_dict(document, "profile")
    entry = replace(first_entry(), traces=[TriForceTrace(np.array([1.0, 1.0, 0.0, 1.0]), np.ones(4))])
    price = setting_price(profile, 4096, entry, 1, 2, "none", None, 1028)
    assert price.tokens_per_step == pytest.approx(1.5) and price.rows == pytest.approx(3.0)
    assert (price.middle_rounds, price.middle_rows, price.middle_context) == (pytest.approx(2.0), 1, 264)
    assert price.host_seconds == pytest.approx(1.5 * 0.044 / 64)
    assert price.request_seconds == pytest.approx(0.044 + 0.044)
    assert step_seconds(profile, 1, price, [4096]) == pytest.approx(2 * 0.011 + 0.052 + price.host_seconds)
    settings = TriForceSettings(1, 2, 256, 8, 64, 4096, "none")
    plan = Plan("triforce", PlanModels(target="tiny-random-llama"), Prediction(2.0, 1.2), settings=settings)
    schedule, rates = triforce_schedule(plan, [entry], profile, 8, None)
    assert set(rates) == {"off", "gamma2=1", "gamma2=2"}
    assert schedule.entry_for(1).speculate and not schedule.entry_for(8).speculate
    for batch in range(1, 9):
        entry_at = schedule.entry_for(batch)
        name = f"gamma2={entry_at.decoding_length - 1}" if entry_at.speculate else "off"
        assert rates[name][batch - 1] == max(r[batch - 1] for r in rates.values() if r[batch - 1] is not None)
    with pytest.raises(UserError, match="per-prompt traces"):
        triforce_schedule(plan, [first_entry()], profile, 8, None)
    plan.schedule = schedule
    save_plan(plan, tmp_path / "plan.yaml")
    assert load_plan(tmp_path / "plan.yaml").schedule == schedule
    document = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    document["schedule"]["entries"][0]["decoding_length"] = 4  # gamma2 3, beyond the plan's 2
    with pytest.raises(UserError, match="exceeds the plan's 3"):
        Plan.from_dict(document, "plan.yaml")
    document["triforce"]["bottom"] = "streaming"
    with pytest.raises(UserError, match="not a plan without a middle level"):
        Plan.from_dict(document, "plan.yaml")


def test_long_prompts_about_one_document_differ_in_their_last_line_only():
    """`--one-document`: every prompt holds the same essays and every needle, about the requested length; a slot
    keeps the document's cache between its requests. The default builds a document per prompt, as it always did."""
    import os

    from specplan.profiler.haystack import NEEDLES, build_prompts

    tokenizer = load_model("tiny-random-llama").tokenizer
    prompts = build_prompts("haystack", tokenizer, 600, 5, one_document=True)
    shared = len(os.path.commonprefix([p.ids for p in prompts]))
    assert all(len(p.ids) <= 606 for p in prompts)  # the longest request line sizes the document
    document = tokenizer.decode(prompts[0].ids[:shared])
    assert all(needle in document for needle, _ in NEEDLES)
    assert all(tokenizer.decode(p.ids[shared:]).lstrip().startswith(("Answer briefly", "Summarize")) for p in prompts)
    assert [p.category for p in prompts] == ["needle", "summary"] * 2 + ["needle"]
    apart = build_prompts("haystack", tokenizer, 600, 2)
    assert len(os.path.commonprefix([p.ids for p in apart])) < shared
    with pytest.raises(UserError, match="use a longer context"):  # every needle planted: 300 tokens hold none
        build_prompts("haystack", tokenizer, 300, 2, one_document=True)


def test_accept_triforce_on_one_document(run_cli, tmp_path):
    """`plan accept triforce --one-document --seed S` measures on the load `plan bench --one-document` sends (its
    document's essays in seed S's order) and records both; another seed is another document."""
    from specplan.core.acceptance_schema import load_triforce_acceptance

    traces = {}
    for seed in ("0", "1"):
        out = tmp_path / f"acc-{seed}.yaml"
        code, _, stderr = run_cli("accept", "triforce", "--target", "tiny-random-llama", "--dataset", "haystack",
                                  "--contexts", "600", "--prompts", "2", "--budgets", "64", "--chunks", "8",
                                  "--strides", "16", "--max-new-tokens", "8", "--one-document", "--seed", seed,
                                  "-o", out)
        assert code == 0, stderr
        dataset = yaml.safe_load(out.read_text())["dataset"]
        assert dataset["one_document"] is True and dataset.get("seed", 0) == int(seed)
        (entry,) = load_triforce_acceptance(out).entries
        traces[seed] = [(tuple(t.middle), tuple(t.bottom)) for t in entry.traces]
    assert traces["0"] != traces["1"]


def test_long_prompts_from_a_jsonl_dataset():
    """`--context` with a JSONL dataset: its records' texts stand as the essays (long prompts unlike the haystack),
    each prompt about the requested length; a dataset too short for the context fails in one line."""
    from specplan.profiler.haystack import build_prompts

    tokenizer = load_model("tiny-random-llama").tokenizer
    prompts = build_prompts("specbench:summarization", tokenizer, 3000, 2, one_document=True)
    assert all(len(p.ids) <= 3030 for p in prompts) and max(len(p.ids) for p in prompts) >= 2970
    assert "Summarize:" in tokenizer.decode(prompts[0].ids)
    with pytest.raises(UserError, match="fewer than"):
        build_prompts("specbench:coding", tokenizer, 20000, 1)
