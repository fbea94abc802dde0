"""A step's rows shared among its requests by their expected yields (decoder/sharing.py): the trie's drafts of every
length from one retrieval, the allocation, the plan section that prices it, and every request's greedy tokens kept
whoever shares its steps."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml
from test_schedule import lookahead_plan_with, profile_document, repetitive_records

from specplan.core.acceptance_schema import LookaheadAcceptance
from specplan.core.choices import MIN_SPEEDUP
from specplan.core.errors import UserError
from specplan.core.method_settings import TrieSettings
from specplan.core.plan_schema import Plan, RowSharing, load_plan
from specplan.decoder.api import Decoder
from specplan.decoder.batching import Request, Scheduler
from specplan.decoder.drafters import ShadowDraft, TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.sharing import SharedRows
from specplan.decoder.trie import Trie

from toy import SAMPLES, VOCAB, assert_distributed_as_target, drafters_per_slot, first_tokens_distribution, toy_model

TRIE = TrieSettings.sized(8, 4)


def sharing_table(extra_row: float, batches: int = 4) -> RowSharing:
    """Steps of 10 ms per sequence plus `extra_row` seconds per drafted row per sequence; the plan's replay yields
    1.2 tokens a step at L_d 2 up to 1.5 at 8."""
    tokens = {1: 1.0, 2: 1.2, 4: 1.4, 8: 1.5}
    return RowSharing(TRIE, 64, tokens, {b: tuple(b * (0.010 + extra_row * (n - 1)) for n in range(1, 9))
                                         for b in range(1, batches + 1)})


def test_a_retrievals_first_nodes_are_its_shorter_draft_and_a_shadow_tells_each_cuts_yield():
    rng = np.random.default_rng(3)
    phrase = rng.integers(0, 50, 12)
    text = np.concatenate([phrase, phrase, phrase[:5], rng.integers(0, 50, 30)]).astype(np.int64)
    trie = Trie(TRIE)
    trie.insert(text, 0, 40, from_prompt=True)
    for length in range(6, 40):
        tokens, parents = (a.copy() for a in trie.retrieve(text, length, 8))
        for nodes in range(1, 8):
            short_tokens, short_parents = trie.retrieve(text, length, nodes)
            assert short_tokens.tolist() == tokens[:nodes].tolist()
            assert short_parents.tolist() == parents[:nodes].tolist()
    shadow = ShadowDraft([5, 6, 7, 8, 9], [-1, 0, 1, 0, 2])  # root 5; 6 -> 7 -> 9, and 8 beside 6
    assert shadow.follow(6) and shadow.follow(7) and not shadow.follow(9)
    assert shadow.emitted == 4 and [shadow.emitted_within(n) for n in range(1, 6)] == [1, 2, 3, 3, 4]


def test_the_rows_go_to_the_requests_whose_drafts_land_and_to_none_where_no_draft_repays_them():
    cheap = SharedRows(sharing_table(extra_row=0.0005))
    landing, missing = [1.0, 1.9, 2.8, 3.5], [1.0, 1.02, 1.03, 1.03]
    assert cheap.allocate([landing, missing], [8, 8]) == [8, 1]
    assert cheap.allocate([landing, landing], [3, 8]) == [3, 8]  # a request's draft is all it can score
    dear = SharedRows(sharing_table(extra_row=0.010))
    assert dear.allocate([landing, missing], [8, 8]) == [1, 1]
    # expected 1.9x as fast as plain steps, and drafted; not where the plan asks a step to be expected 2x as fast
    assert SharedRows(replace(sharing_table(0.0005), min_speedup=1.8)).allocate([landing, missing], [8, 8]) == [8, 1]
    assert SharedRows(replace(sharing_table(0.0005), min_speedup=2.0)).allocate([landing, missing], [8, 8]) == [1, 1]
    # the engine's yields after a class of step replace the plan's replay, beside PRIOR_STEPS of it
    assert cheap.expected(None) == pytest.approx([1.0, 1.2, 1.4, 1.5])
    for _ in range(50):
        shadow = ShadowDraft(list(range(8)), [-1, 0, 1, 2, 3, 4, 5, 6], after=4)
        for token in range(1, 8):
            shadow.follow(token)
        cheap.observe(shadow)
    assert cheap.expected(6)[-1] > 7.5 and cheap.expected(1) == pytest.approx([1.0, 1.2, 1.4, 1.5])


def test_the_served_truth_scales_what_the_table_expects_and_prices():
    """Drafted steps that emit less than expected, or cost more against plain ones than the table says, take the rows
    back."""
    landing, missing = [1.0, 1.9, 2.8, 3.5], [1.0, 1.02, 1.03, 1.03]
    missed = SharedRows(sharing_table(extra_row=0.0005))
    sequence = TrieDrafter(Trie(TRIE))
    for _ in range(40):
        missed.given = {id(sequence): 3.5}
        missed.emitted(sequence, 1)  # expected 2.5 tokens beyond the root, emitted none
    assert missed.yield_scale < 0.1
    drafters = [TrieDrafter(Trie(TRIE)) for _ in range(2)]
    for drafter in drafters:
        drafter.reset([1, 2, 3, 1, 2, 3, 1, 2], 64)
    assert missed.decide(drafters, [3, 3]) == [1, 1]
    dear = SharedRows(sharing_table(extra_row=0.0005))
    assert dear.allocate([landing, missing], [8, 8]) == [8, 1]
    for drafted, ratio in [(False, 1.0), (True, 3.0)] * 4:  # steps with drafts took 3x their price, plain ones 1x
        dear.priced = (0.02, drafted)
        dear.timed(0.02 * ratio)
    assert dear.cost_scale == pytest.approx(3.0) and dear.allocate([landing, missing], [8, 8]) == [1, 1]


def forward_in_passes(rows: float) -> float:
    """A forward that scores its rows in passes of four: 10 ms a pass, 0.1 ms a row."""
    return 0.010 * math.ceil(rows / 4) + 0.0001 * rows


def test_a_step_is_priced_at_its_total_of_rows_where_every_total_was_timed():
    """Steps cost 20 ms plus a forward that scores its rows in passes of four: the table prices every total of rows
    as timed, and a request whose drafts land one row deep is not given that row, which would open a pass; on the
    straight line between uniform steps it would be."""
    tokens = {1: 1.0, 2: 1.8, 4: 2.6, 8: 3.0}
    steps = {b: tuple(0.020 + forward_in_passes(b * n) for n in range(1, 9)) for b in range(1, 5)}
    table = RowSharing(TRIE, 64, tokens, steps, row_seconds=tuple(forward_in_passes(t) for t in range(1, 33)))
    for batch in range(1, 5):
        for rows in range(batch, 8 * batch + 1):
            assert table.seconds(batch, rows) == pytest.approx(0.020 + forward_in_passes(rows)), (batch, rows)
    straight = replace(table, row_seconds=())
    assert straight.seconds(4, 5) < 0.85 * table.seconds(4, 5)
    one_deep, missing = [1.0, 2.0, 2.1, 2.1], [1.0, 1.0, 1.0, 1.0]
    assert SharedRows(straight).allocate([one_deep] + [missing] * 3, [8] * 4) == [2, 1, 1, 1]
    assert SharedRows(table).allocate([one_deep] + [missing] * 3, [8] * 4) == [1, 1, 1, 1]


def test_a_plan_carries_its_shared_rows_and_a_bad_table_is_one_line():
    document = lookahead_plan_with({"entries": [{"batches": [1, 4], "speculate": True, "decoding_length": 4,
                                                 "tokens_per_step": 1.4, "tokens_per_second": 1.0, "speedup": 1.2}]})
    table = sharing_table(0.001)
    plan = Plan.from_dict({**document, "sharing": table.to_dict()}, "p.yaml")
    assert plan.sharing == table and Plan.from_dict(plan.to_dict(), "again").sharing == table
    assert table.seconds(2, 3) == pytest.approx((table.step_seconds[2][0] + table.step_seconds[2][1]) / 2)
    assert table.seconds(8, 8) == pytest.approx(2 * table.step_seconds[4][0])  # beyond the table, per sequence
    timed = replace(table, row_seconds=(0.01, 0.02, 0.03, 0.04))
    assert Plan.from_dict({**document, "sharing": timed.to_dict()}, "p.yaml").sharing == timed
    good = table.to_dict()
    for broken, message in [
        ({**good, "tokens_per_step": {1: 1.0, 2: 3.0}}, "at most that many tokens"),
        ({**good, "tokens_per_step": {2: 1.5}}, "must hold 1: 1.0"),
        ({**good, "step_seconds": {1: [0.01] * 8, 3: [0.01] * 8}}, "without a gap"),
        ({**good, "step_seconds": {1: [0.01] * 7}}, "one per rows per sequence"),
        ({**good, "step_seconds": {1: [float("nan")] * 8}}, "nan|finite|number"),
        ({**good, "row_seconds": [0.01, 0.0]}, "row_seconds"),
        ({**good, "row_seconds": "fast"}, "row_seconds"),
    ]:
        with pytest.raises(UserError, match=message):
            Plan.from_dict({**document, "sharing": broken}, "p.yaml")
    with pytest.raises(UserError, match="for Lookahead plans"):
        Plan.from_dict({"kind": "plan/sequoia", "tree": {"size": 1, "depth": 0, "parents": [-1]},
                        "prediction": {"tokens_per_step": 1.0}, "sharing": good}, "p.yaml")


def test_plan_solve_share_rows_writes_the_table_and_bad_lengths_are_one_line(run_cli, tmp_path):
    acceptance, profile, plan = (tmp_path / name for name in ("a.yaml", "p.yaml", "plan.yaml"))
    acceptance.write_text(yaml.safe_dump(LookaheadAcceptance(
        "toy", {"vocab_size": 64, "sha256": "x"}, repetitive_records()).to_dict()))
    profile.write_text(yaml.safe_dump(profile_document()))
    solve = ("solve", "lookahead", "--acceptance", acceptance, "--profile", profile, "--decoding-lengths", "2,4,8",
             "--branch-lengths", "1,2", "--batches", 4)
    code, _, stderr = run_cli(*solve, "--share-rows", "8,4", "-o", plan)
    assert code == 0, stderr
    sharing = load_plan(plan).sharing
    assert sharing.trie == TrieSettings.sized(8, 4) and sharing.lengths == [1, 2, 4, 8]
    assert sharing.min_speedup == MIN_SPEEDUP
    assert sorted(sharing.step_seconds) == [1, 2, 3, 4] and sharing.tokens_per_step[8] > sharing.tokens_per_step[2]
    # the profile's one-sequence steps barely grow with rows; its batched ones grow in proportion
    assert sharing.step_seconds[1][7] < 1.2 * sharing.step_seconds[1][0] < sharing.step_seconds[4][1]
    assert sharing.row_seconds == ()  # t(n) at 1, 2, 4, 8 rows: no total between uniform steps timed
    dense = profile_document()
    for points in (dense["target"]["t_seconds"], dense["target"]["contexts"][64]["t_seconds"]):
        points.update({n: 0.010 * math.ceil(n / 4) for n in range(1, 41)})
    profile.write_text(yaml.safe_dump(dense))
    code, _, stderr = run_cli(*solve, "--share-rows", "8,4", "-o", plan)
    assert code == 0, stderr
    # every total up to the largest batch's longest drafts: 4 x 8 rows
    assert load_plan(plan).sharing.row_seconds == pytest.approx([0.010 * math.ceil(n / 4) for n in range(1, 33)])
    for bad in ("8", "4,8", "x,2"):
        code, _, stderr = run_cli(*solve, "--share-rows", bad, "-o", tmp_path / "bad.yaml")
        assert code == 2 and len(stderr.strip().splitlines()) == 1 and not (tmp_path / "bad.yaml").exists()
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", acceptance, "--profile", profile,
                              "--share-rows", "8,4", "-o", tmp_path / "x.yaml")
    assert code == 2 and "goes with --batches" in stderr


def test_shared_rows_keep_every_requests_greedy_tokens_and_give_rows_where_drafts_land(tiny_pair):
    """Requests copying their prompts beside requests writing new text: one step scores different rows for different
    sequences, and every request's greedy tokens are its own one-request greedy tokens."""
    loaded, target, _ = tiny_pair
    document = lookahead_plan_with({"entries": [{"batches": [1, 4], "speculate": False, "tokens_per_step": 1.0,
                                                 "tokens_per_second": 1.0, "speedup": 1.0}]})
    plan = Plan.from_dict({**document, "sharing": sharing_table(0.0002).to_dict()}, "p.yaml")
    decoder = Decoder(loaded, lambda: TrieDrafter(Trie(TRIE)), plan, None, target)
    gen = torch.Generator().manual_seed(7)
    phrase = torch.randint(0, 250, (12,), generator=gen).tolist()
    requests = [Request(phrase * 3 + [i], 24) if i % 2 == 0 else
                Request(torch.randint(0, 250, (30,), generator=gen).tolist(), 24) for i in range(4)]
    rows = []  # per step of several sequences: each sequence's rows
    forward_many = target.forward_many
    target.forward_many = lambda items: rows.append([i.tokens.shape[0] for i in items]) or forward_many(items)
    try:
        completions = {c.id: c.result for c in decoder.generate_many(requests, 4)}
    finally:
        del target.forward_many
    steps = [r for r in rows if max(r) <= 8]  # decode steps (prefills score whole prompts)
    assert any(len(set(r)) > 1 for r in steps)  # a step gave its sequences different rows
    for i, request in enumerate(requests):
        assert completions[i].tokens == SpeculativeEngine(target, None).generate(
            request.prompt, request.max_new_tokens, SamplingParams()).tokens, i
        assert set(completions[i].decisions) <= {"shared: drafts", "shared: plain"}
    assert sum(completions[0].decisions.values()) == completions[0].steps
    decoder.unshared()  # the plan as it would run without sharing: its own trie, its schedule (off)
    assert decoder.engine.sharing is None and decoder.engine.drafter.trie.settings == plan.settings
    assert decoder.generate(requests[0].prompt, 24).result.drafted_steps == 0


def test_no_sharing_on_a_plan_without_shared_rows_is_one_line(run_cli, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(lookahead_plan_with(
        {"entries": [{"batches": [1, 1], "speculate": True, "decoding_length": 4, "tokens_per_step": 1.4,
                      "tokens_per_second": 1.0, "speedup": 1.2}]})))
    code, _, stderr = run_cli("generate", "--plan", plan, "--prompt", "hi", "--no-sharing", "--max-new-tokens", 2)
    assert code == 2 and "shares no rows" in stderr and len(stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_sampled_requests_under_shared_rows_are_distributed_as_the_target():
    """Sampled requests (each its own seed) whose rows a step shares out, beside requests of another prompt: the
    first two tokens of the measured prompt follow transformers' distribution (chi-square)."""
    target_hf, target = toy_model(20, family="llama-32")
    params = SamplingParams(temperature=0.8, top_p=0.95)
    measured, other = [1, 4, 2, 5, 3], [3, 3, 1, 0]  # the slot's trie learns the outputs: later requests draft
    requests = []
    for seed in range(SAMPLES):
        requests.append(Request(measured, 2, params, seed))
        if seed % 8 == 0:
            requests.append(Request(other, 1 + seed % 3, params, SAMPLES + seed))
    make = lambda: TrieDrafter(Trie(TRIE))  # noqa: E731
    engine = SpeculativeEngine(target, make(), sharing=SharedRows(sharing_table(extra_row=0.0001)))
    counts, drafted = np.zeros((VOCAB, VOCAB)), 0
    for completion in Scheduler(engine, drafters_per_slot(make), 3).run(requests):
        drafted += completion.result.drafted_steps
        if requests[completion.id].prompt == measured:
            tokens = completion.result.tokens
            counts[tokens[0], tokens[1]] += 1
    assert drafted > SAMPLES  # most requests drafted
    assert_distributed_as_target(counts, first_tokens_distribution(target_hf, measured, params))
