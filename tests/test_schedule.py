"""Plans per batch size: the Lookahead schedule the solver chooses from t(B, n), the plan file that carries it, and
the continuous-batching decoder following it step by step without changing any request's tokens."""

from __future__ import annotations

import ast
import json
import runpy
import subprocess
import sys
import zipfile
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml

from specplan.core.acceptance_schema import DraftChainTrace, LookaheadAcceptance, LookaheadRecord
from specplan.core.choices import CANDIDATE_SPEEDUP, MIN_SPEEDUP
from specplan.core.errors import UserError
from specplan.core.method_settings import TrieSettings
from specplan.core.models import cache_dir
from specplan.core.plan_schema import (
    BatchSchedule,
    Candidate,
    Plan,
    PlanModels,
    Prediction,
    ScheduleEntry,
    TokenTree,
    load_plan,
    save_plan,
)
from specplan.core.profile_schema import LatencyProfile
from specplan.decoder.api import Decoder
from specplan.decoder.batching import Request, Scheduler
from specplan.decoder.draft_rules import SglangEma
from specplan.decoder.drafters import SequoiaDrafter, TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.gate import MEASURED_AT_LEAST, UNTIMED_AFTER_JOIN, StepClock
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.trie import Trie
from specplan.planner.closed_loop import SettingPrice, schedule_table
from specplan.planner.draft_chain import chain_schedule
from specplan.planner.export import export_plan
from specplan.planner.lookahead import lookahead_schedule, plan_setting_prices, replay
from specplan.serving import exported_llama_server_flags

from toy import drafters_per_slot

SIZES = (1, 2, 4, 8)


def profile_document() -> dict:
    """A step of one sequence costs about the same for 1 to 8 rows (memory-bound); steps of several sequences cost
    in proportion to their rows (compute-bound), so drafting pays alone and not in a batch."""
    alone = {n: 0.010 + 0.0002 * n for n in SIZES}
    batches = {B: {"t_seconds": {n: 0.002 + 0.010 * B * n for n in SIZES}} for B in (2, 4, 8)}
    return {"kind": "profile/latency", "models": {"target": "toy"},
            "target": {"t_seconds": alone, "contexts": {64: {"t_seconds": dict(alone), "batches": batches}}}}


def profile_where_drafting_pays_alone() -> LatencyProfile:
    return LatencyProfile.from_dict(profile_document(), "synthetic")


def repetitive_records() -> list[LookaheadRecord]:
    """Outputs that repeat their prompts' phrases: a trie drafts them well."""
    phrase = list(range(10, 22))
    return [LookaheadRecord(str(i), "toy", phrase * 2 + [30 + i], (phrase * 4)[i:i + 40]) for i in range(4)]


def test_the_schedule_drafts_where_it_pays_and_turns_off_where_the_batch_is_compute_bound():
    settings = TrieSettings.sized(8, 4)
    schedule, rates = lookahead_schedule(repetitive_records(), settings, profile_where_drafting_pays_alone(), 8,
                                         (2, 4, 8))
    assert schedule.entries[0].low == 1 and schedule.entries[-1].high == 8
    assert all(a.high + 1 == b.low for a, b in zip(schedule.entries, schedule.entries[1:]))
    assert schedule.entry_for(1).speculate and schedule.entry_for(1).speedup > 1.2
    assert not schedule.entry_for(8).speculate and schedule.entry_for(8).speedup == 1.0
    assert schedule.entry_for(100) == schedule.entries[-1]
    for batch in range(1, 9):  # each range's setting is the best priced at every batch size it covers, or off
        entry = schedule.entry_for(batch)  # where the best is not MIN_SPEEDUP times off's
        best = max(r[batch - 1] for r in rates.values() if r[batch - 1] is not None)
        if entry.speculate:
            assert rates[f"L_d={entry.decoding_length}"][batch - 1] == best
        else:
            assert best < MIN_SPEEDUP * rates["off"][batch - 1]
    assert len(rates["off"]) == 8 and set(rates) == {"off", "L_d=2", "L_d=4", "L_d=8"}


def test_a_setting_replayed_exactly_keeps_its_batch_sizes_unless_another_is_priced_ahead_by_the_margin():
    """A TriForce schedule's chains beside the one the acceptance was decoded with are replayed approximately: at a
    batch size where one is priced ahead of the exact one by less than the margin, the exact one stays; by more, it
    takes the batch size (and without an exact one, the fastest always does)."""
    flat = LatencyProfile.from_dict({"kind": "profile/latency", "models": {"target": "toy"}, "target": {
        "t_seconds": {1: 0.010, 2: 0.010}, "contexts": {64: {"t_seconds": {1: 0.010, 2: 0.010},
                                                              "batches": {2: {"t_seconds": {1: 0.02, 2: 0.02}}}}}}},
        "synthetic")
    for ahead, exact, chosen in ((1.01, (3, 0.02), 3), (1.03, (3, 0.02), 2), (1.01, None, 2)):
        prices = {2: SettingPrice(1.5 * ahead, rows=2.0), 3: SettingPrice(1.5, rows=2.0)}
        schedule, rates = schedule_table(prices, flat, 2, 64, "triforce", exact=exact)
        assert rates["gamma2=1"][0] == pytest.approx(ahead * rates["gamma2=2"][0])
        assert [schedule.entry_for(b).decoding_length for b in (1, 2)] == [chosen, chosen]


def test_a_schedule_drafts_only_where_predicted_ahead_by_its_margin(run_cli, tmp_path):
    """A step of 1 or 2 rows costs the same, so a setting emitting 1.03 tokens a step is priced 1.03x off: inside
    the served runs' spread, so off by default; drafting where asked for less, and at 1.10 tokens a step; a setting
    priced 0.90x off drafts only where asked to draft at half off's rate."""
    flat = LatencyProfile.from_dict({"kind": "profile/latency", "models": {"target": "toy"}, "target": {
        "t_seconds": {1: 0.010, 2: 0.010}, "contexts": {64: {"t_seconds": {1: 0.010, 2: 0.010},
                                                              "batches": {2: {"t_seconds": {1: 0.02, 2: 0.02}}}}}}},
        "synthetic")
    for gain, min_speedup, drafts in ((1.03, MIN_SPEEDUP, False), (1.03, 1.0, True), (1.10, MIN_SPEEDUP, True),
                                      (0.90, 1.0, False), (0.90, 0.5, True)):
        schedule, rates = schedule_table({2: SettingPrice(gain, rows=2.0)}, flat, 2, 64, "lookahead", min_speedup)
        assert rates["L_d=2"][0] == pytest.approx(gain * rates["off"][0])
        assert schedule.entry_for(1).speculate == drafts and schedule.entry_for(2).speculate == drafts
        # off, within CANDIDATE_SPEEDUP of paying, the entry keeps the setting as its candidate, at its own price
        candidate = schedule.entry_for(1).candidate
        assert (candidate is not None) == (not drafts and gain >= CANDIDATE_SPEEDUP)
        assert candidate is None or (candidate.decoding_length == 2 and candidate.speedup == pytest.approx(gain))
        # the setting priced (drafted, or the candidate) carries its speedup at each batch size of the range
        priced = schedule.entry_for(1).price_at
        assert [priced(b) for b in (1, 2)] == ([None] * 2 if candidate is None and not drafts else
                                               [(pytest.approx(gain), pytest.approx(gain))] * 2)
    schedule, _ = schedule_table({2: SettingPrice(0.85, rows=2.0)}, flat, 2, 64, "lookahead", MIN_SPEEDUP)
    assert schedule.entries == (ScheduleEntry(1, 2, False, None, 1.0, 100.0, 1.0),)  # far below: no candidate
    acceptance, profile = tmp_path / "a.yaml", tmp_path / "p.yaml"
    acceptance.write_text(yaml.safe_dump(LookaheadAcceptance(
        "toy", {"vocab_size": 64, "sha256": "x"}, repetitive_records()).to_dict()))
    profile.write_text(yaml.safe_dump(profile_document()))
    solve = ("solve", "lookahead", "--acceptance", acceptance, "--profile", profile, "--decoding-lengths", "4,8",
             "--branch-lengths", "2,4", "--batches", 8)
    code, _, stderr = run_cli(*solve, "-o", tmp_path / "plan.yaml")
    assert code == 0 and load_plan(tmp_path / "plan.yaml").solver["schedule"]["min_speedup"] == MIN_SPEEDUP, stderr
    code, _, stderr = run_cli(*solve, "--min-speedup", 1000, "-o", tmp_path / "never.yaml")
    never = load_plan(tmp_path / "never.yaml")
    assert code == 0 and not any(entry.speculate for entry in never.schedule.entries), stderr
    for bad in ("nan", "0"):
        code, _, stderr = run_cli(*solve, "--min-speedup", bad, "-o", tmp_path / "bad.yaml")
        assert code == 2 and "--min-speedup" in stderr and len(stderr.strip().splitlines()) == 1
        assert not (tmp_path / "bad.yaml").exists()


def test_plan_solve_lookahead_batches_writes_the_schedule_and_plan_show_prints_and_plots_it(run_cli, tmp_path):
    acceptance, profile, plan, png = (tmp_path / name for name in ("a.yaml", "p.yaml", "plan.yaml", "s.png"))
    acceptance.write_text(yaml.safe_dump(LookaheadAcceptance(
        "toy", {"vocab_size": 64, "sha256": "x"}, repetitive_records()).to_dict()))
    profile.write_text(yaml.safe_dump(profile_document()))
    code, stdout, stderr = run_cli("solve", "lookahead", "--acceptance", acceptance, "--profile", profile,
                                   "--decoding-lengths", "4,8", "--branch-lengths", "2,4", "--batches", 8, "-o", plan)
    assert code == 0, stderr
    assert "schedule per batch size" in stdout
    written = load_plan(plan)
    assert written.schedule.entries[-1].high == 8 and not written.schedule.entry_for(8).speculate
    code, shown, stderr = run_cli("show", plan, "--plot", png)
    assert code == 0, stderr
    assert "schedule per batch size" in shown and " off " in shown and png.stat().st_size > 0
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", acceptance, "--batches", 8, "-o", tmp_path / "x")
    assert code == 2 and "priced on a profile: give --profile" in stderr


def test_plan_show_gives_a_ranges_price_at_its_last_batch_size():
    from specplan.show import describe_schedule

    shown = describe_schedule(BatchSchedule(64, (
        ScheduleEntry(1, 1, True, 2, 1.25, 50.0, 1.23, speedups=(1.23,)),
        ScheduleEntry(2, 16, False, None, 1.0, 69.0, 1.0, Candidate(2, 1.25, 1.023), (1.023,) * 14 + (0.917,)),
        ScheduleEntry(17, 20, False, None, 1.0, 80.0, 1.0))), "lookahead").splitlines()
    assert shown[2].endswith("1.230") and shown[4].endswith("1.000")  # one size, or none priced: nothing more
    assert shown[3].endswith("drafted where measured to pay  (candidate 0.917x at 16)")


def test_a_plan_solved_for_short_requests_replays_and_reprices_their_outputs_only(run_cli, tmp_path):
    acceptance, profile, plan = (tmp_path / name for name in ("a.yaml", "p.yaml", "plan.yaml"))
    records = repetitive_records()
    acceptance.write_text(yaml.safe_dump(LookaheadAcceptance("toy", {"vocab_size": 64, "sha256": "x"},
                                                             records).to_dict()))
    profile.write_text(yaml.safe_dump(profile_document()))
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", acceptance, "--profile", profile,
                              "--decoding-lengths", "4,8", "--branch-lengths", "2,4", "--batches", 4,
                              "--max-new-tokens", 10, "-o", plan)
    assert code == 0, stderr
    written = load_plan(plan)
    cut = [replace(record, output=record.output[:10]) for record in records]
    assert written.inputs["acceptance"]["output_tokens"] == 10
    assert written.prediction.details["replayed_tokens"] == 10 * len(records)
    assert written.prediction.tokens_per_step == pytest.approx(replay(cut, written.settings).tokens_per_step)
    short = plan_setting_prices(written, {4})[4]
    assert short.tokens_per_step == pytest.approx(replay(cut, written.settings, 4).tokens_per_step)
    whole = plan_setting_prices(written, {4}, output_tokens=40)[4]
    assert whole.tokens_per_step == pytest.approx(replay(records, written.settings, 4).tokens_per_step)
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", acceptance, "--engine", "vllm",
                              "--share-rows", "8,4", "-o", tmp_path / "x")
    assert code == 2 and "--share-rows go with our Lookahead trie" in stderr


def lookahead_plan_with(schedule: dict) -> dict:
    return {"kind": "plan/lookahead", "models": {"target": "tiny-random-llama"},
            "lookahead": TrieSettings.sized(8, 4).to_dict(), "tokenizer": {"vocab_size": 8, "sha256": "x"},
            "prediction": {"tokens_per_step": 1.5}, "schedule": schedule}


def test_a_plan_carries_its_schedule_and_a_bad_one_is_one_line():
    schedule = BatchSchedule(64, (ScheduleEntry(1, 2, True, 8, 2.1, 150.0, 1.6, speedups=(1.6, 1.4)),
                                  ScheduleEntry(3, 4, False, None, 1.0, 300.0, 1.0, Candidate(4, 1.4, 0.97)),
                                  ScheduleEntry(5, 16, False, None, 1.0, 400.0, 1.0)),
                             mix_shares=((), (0.6,), (0.4, 0.7), (0.3, 0.5)))
    document = lookahead_plan_with(schedule.to_dict())
    plan = Plan.from_dict(document, "p.yaml")
    assert plan.schedule == schedule and Plan.from_dict(plan.to_dict(), "again").schedule == schedule
    # a drafted step's price: the setting's at each batch size where the entry carries them (else at its first), an
    # off entry's candidate's, none beyond; a drafter without a per-request decision drafts no candidate
    assert [plan.predicted_at(b) for b in (1, 2, 3, 4, 5)] == [(2.1, 1.6), (2.1, 1.4), (1.4, 0.97), (1.4, 0.97), None]
    assert [(e.nodes(gated=True), e.nodes(gated=False)) for e in schedule.entries] == [(8, 8), (4, 1), (1, 1)]
    # a step's mix: its share at 1, 2, 4, ... sequences drafting, linear between them, none beyond the sizes priced
    assert [plan.schedule.mix_share(4, k) for k in range(5)] == [0.0, 0.3, 0.5, pytest.approx(0.75), 1.0]
    assert plan.schedule.mix_share(1, 1) == 1.0 and plan.schedule.mix_share(8, 1) is None
    off = {"batches": [1, 1], "speculate": False, "tokens_per_step": 1.0, "tokens_per_second": 1.0, "speedup": 1.0}
    candidate = {"decoding_length": 4, "tokens_per_step": 1.4, "speedup": 0.97}
    for broken, message in [
        ({"entries": [{**schedule.entries[0].to_dict(), "candidate": candidate}]}, "do not speculate"),
        ({"entries": [{**off, "candidate": {**candidate, "decoding_length": 9}}]}, "exceeds the plan's 8"),
        ({"entries": [{**off, "candidate": {**candidate, "speedup": "fast"}}]}, "speedup"),
        ({"entries": [{**schedule.entries[0].to_dict(), "batches": [2, 3]}]}, "contiguous from 1"),
        ({"entries": [{**schedule.entries[0].to_dict(), "decoding_length": 32}]}, "exceeds the plan's 8"),
        ({"entries": [{**schedule.entries[0].to_dict(), "batches": [3, 1]}]}, "1 <= low <= high"),
        ({"entries": []}, "non-empty list"),
        ({"entries": [{**schedule.entries[0].to_dict(), "speedups": [1.6]}]}, "one speedup per batch size"),
        ({"entries": [{**off, "speedups": [1.0]}]}, "of a setting or a candidate"),
        ({"entries": [{**schedule.entries[0].to_dict(), "speedups": [1.6, float("nan")]}]}, "speedups"),
        ({"entries": [schedule.entries[0].to_dict()], "mix_shares": [[], [1.5]]}, "mix_shares"),
        ({"entries": [schedule.entries[0].to_dict()], "mix_shares": [[], [0.5, 0.6]]}, "one share at each of"),
        ({"entries": [schedule.entries[0].to_dict()], "mix_shares": [0.5]}, "lists of shares"),
    ]:
        with pytest.raises(UserError, match=message):
            Plan.from_dict(lookahead_plan_with(broken), "p.yaml")


def test_the_decoder_follows_the_schedule_and_every_request_keeps_its_greedy_tokens(tiny_pair):
    """Drafting (L_d = 6) with one sequence in flight, off with two or more: the trees a step scores follow the
    schedule as requests join and leave, and every request's greedy tokens equal its own one-request tokens."""
    _, target, _ = tiny_pair
    schedule = BatchSchedule(None, (ScheduleEntry(1, 1, True, 6, 2.0, 1.0, 1.5),
                                    ScheduleEntry(2, 8, False, None, 1.0, 1.0, 1.0)))
    make = lambda: TrieDrafter(Trie(TrieSettings.sized(8, 3)))  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    phrase = torch.randint(0, 250, (12,), generator=gen).tolist()
    requests = [Request(phrase * 3 + [i], n) for i, n in enumerate((30, 6, 8))]
    sizes = []  # per step: (sequences, largest tree)
    scheduler = Scheduler(SpeculativeEngine(target, make(), schedule=schedule), drafters_per_slot(make), 3)
    forward_many, forward = target.forward_many, target.forward
    target.forward_many = lambda items: sizes.append((len(items), max(i.tokens.shape[0] for i in items))) or \
        forward_many(items)
    target.forward = lambda tokens, *a, **k: sizes.append((1, tokens.shape[0])) or forward(tokens, *a, **k)
    try:
        results = {c.id: c.result.tokens for c in scheduler.run(requests)}
    finally:
        del target.forward_many, target.forward
    steps = [s for s in sizes if s[1] <= 8]  # decode steps (prefills score whole prompts)
    assert all(largest == 1 for count, largest in steps if count > 1)
    assert any(count == 1 and largest > 1 for count, largest in steps)  # alone, it drafted
    assert max(largest for count, largest in steps if count == 1) <= 6
    for i, request in enumerate(requests):
        assert results[i] == SpeculativeEngine(target, make()).generate(request.prompt, request.max_new_tokens,
                                                                        SamplingParams()).tokens, i


def test_an_off_entrys_candidate_drafts_only_where_requests_decide_and_time_it(tiny_pair):
    """Off at every batch size with a candidate priced 0.95x: gated requests time its drafted steps (and, measured
    to pay on a repetitive text, keep drafting it); without per-request decisions nothing drafts. Every request's
    greedy tokens stay its own."""
    _, target, _ = tiny_pair
    schedule = BatchSchedule(None, (ScheduleEntry(1, 8, False, None, 1.0, 1.0, 1.0, Candidate(6, 2.0, 0.95)),))
    make = lambda: TrieDrafter(Trie(TrieSettings.sized(8, 3)))  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    phrase = torch.randint(0, 250, (12,), generator=gen).tolist()
    requests = [Request(phrase * 3 + [i], n) for i, n in enumerate((30, 6, 8))]
    for pricing, drafts in ((lambda batch, context: schedule.entry_for(batch, context).price_at(batch), True),
                            (None, False)):
        clock = StepClock()
        scheduler = Scheduler(SpeculativeEngine(target, make(), pricing=pricing, schedule=schedule, clock=clock),
                              drafters_per_slot(make), 2)
        results = {c.id: c.result for c in scheduler.run(requests)}
        assert any(r.drafted_steps for r in results.values()) == drafts
        assert all(max(r.drafted_per_step, default=0) <= 5 for r in results.values())
        for i, request in enumerate(requests):
            assert results[i].tokens == SpeculativeEngine(target, make()).generate(
                request.prompt, request.max_new_tokens, SamplingParams()).tokens, i


def test_the_step_log_sees_every_step_and_the_steps_the_clock_timed(tiny_pair):
    """`plan serve --step-log`: each step once its seconds are known, with its batch, its drafted sequences, its kind;
    the steps it says the clock timed are those the clock holds, second for second; a prefill after a step untimes
    it, and so does a join in the UNTIMED_AFTER_JOIN steps before it."""
    _, target, _ = tiny_pair
    schedule = BatchSchedule(None, (ScheduleEntry(1, 8, False, None, 1.0, 1.0, 1.0, Candidate(6, 2.0, 0.95)),))
    make = lambda: TrieDrafter(Trie(TrieSettings.sized(8, 3)))  # noqa: E731
    phrase = torch.randint(0, 250, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    requests = [Request(phrase * 3 + [i], n) for i, n in enumerate((60, 6, 8, 40, 30))]
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):  # B = 2 priced before the load: 1.5 plain steps a drafted one
        clock.record(2, True, 0.003)
        clock.record(2, False, 0.002)
    scheduler = Scheduler(SpeculativeEngine(target, make(), pricing=lambda batch, context: schedule.entry_for(
        batch, context).price_at(batch), schedule=schedule, clock=clock), drafters_per_slot(make), 2)
    records = []
    scheduler.step_log = records.append
    results = list(scheduler.run(requests))
    assert len(records) >= max(r.result.steps for r in results)
    assert all(1 <= r.batch <= 2 and 0 <= r.drafted <= r.batch for r in records)
    assert sum(r.finished for r in records) + (scheduler.logged_step.finished if scheduler.logged_step else 0) == 5
    assert {r.kind for r in records} >= {"drafted", "plain"} and all(r.price is not None for r in records)
    assert not any(r.timed for r in records if r.admitted_after or r.kind is None)
    for index, record in enumerate(records):  # nor the first steps after a sequence joins
        assert not (record.timed and any(r.admitted_after for r in records[max(0, index - UNTIMED_AFTER_JOIN):index]))
    for batch in (1, 2):
        timed = [r for r in records if r.timed and r.batch == batch]
        assert len(timed) == clock.timed_steps.get(batch, 0) - (2 * MEASURED_AT_LEAST if batch == 2 else 0)
        for drafted, kind in ((True, "drafted"), (False, "plain")):
            logged, held = [r.seconds for r in timed if r.kind == kind], list(clock.seconds.get((batch, drafted), ()))
            count = min(len(logged), len(held))
            assert logged[len(logged) - count:] == held[len(held) - count:]
    at_two = [r for r in records if r.batch == 2]
    assert at_two[-1].clock_price == clock.drafted_step_cost(2) and at_two[0].clock_price is not None


def test_a_fixed_setting_drafts_that_length_at_every_batch_size(tiny_pair):
    """`plan serve --setting 3` on a plan whose schedule drafts alone and nothing beside others: every request
    drafts up to 3 nodes at every step, alone or not, and keeps its greedy tokens; a length outside the plan's
    range, or a plan whose tree branches, is one line."""
    loaded, target, draft = tiny_pair
    schedule = BatchSchedule(None, (ScheduleEntry(1, 1, True, 6, 2.0, 1.0, 1.5),
                                    ScheduleEntry(2, 8, False, None, 1.0, 1.0, 1.0)))
    plan = Plan.from_dict(lookahead_plan_with(schedule.to_dict()), "p.yaml")
    decoder = Decoder(loaded, lambda: TrieDrafter(Trie(plan.settings)), plan, None, target)
    for bad in (1, 9):
        with pytest.raises(UserError, match="drafts 2 to 8 nodes"):
            decoder.fix_setting(bad)
    decoder.fix_setting(3)
    phrase = torch.randint(0, 250, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    requests = [Request(phrase * 3 + [i], n) for i, n in enumerate((30, 16, 20))]
    sizes = []  # per step: (sequences, largest tree)
    forward_many = target.forward_many
    target.forward_many = lambda items: sizes.append((len(items), max(i.tokens.shape[0] for i in items))) or \
        forward_many(items)
    try:
        results = {c.id: c.result.tokens for c in decoder.generate_many(requests, 3)}
    finally:
        del target.forward_many
    steps = [s for s in sizes if s[1] <= 8]  # decode steps (a prefill scores whole prompts)
    assert any(count > 1 and largest == 3 for count, largest in steps)  # drafting beside others
    assert max(largest for _, largest in steps) == 3
    for i, request in enumerate(requests):
        assert results[i] == SpeculativeEngine(target, None).generate(request.prompt, request.max_new_tokens,
                                                                      SamplingParams()).tokens, i
    tree = Plan.from_dict({"kind": "plan/sequoia", "models": {"target": "tiny-random-llama"},
                           "tree": {"parents": [-1, 0, 0], "size": 3, "depth": 1},
                           "prediction": {"tokens_per_step": 1.5}}, "tree.yaml")
    branching = Decoder(loaded, lambda: SequoiaDrafter(draft, list(tree.tree.parents)), tree, None, target)
    with pytest.raises(UserError, match="this plan's tree branches"):
        branching.fix_setting(2)


def chain_profile() -> LatencyProfile:
    """The same step costs with a draft model whose step costs a fifth of the target's, batched alike."""
    document = profile_document()
    document["draft"] = {"step_seconds": 0.002, "contexts": {64: {"step_seconds": 0.002, "batches": {
        B: {"step_seconds": 0.002 * B} for B in (2, 4, 8)}}}}
    return LatencyProfile.from_dict(document, "synthetic")


def well_drafted_chains() -> list[DraftChainTrace]:
    """A draft that matches the target 7 times in 8."""
    match = np.array([i % 8 != 7 for i in range(64)])
    return [DraftChainTrace(match, np.where(match, 0.9, 0.3), prompt_tokens=40) for _ in range(3)]


def test_a_chain_schedule_drafts_long_alone_and_nothing_where_the_batch_is_compute_bound():
    schedule, rates = chain_schedule(well_drafted_chains(), chain_profile(), 8, 4)
    assert schedule.entries[0].low == 1 and schedule.entries[-1].high == 8
    assert schedule.entry_for(1).speculate and schedule.entry_for(1).decoding_length - 1 >= 3
    assert not schedule.entry_for(8).speculate
    for batch in range(1, 9):
        entry = schedule.entry_for(batch)
        name = f"K={entry.decoding_length - 1}" if entry.speculate else "off"
        assert rates[name][batch - 1] == max(r[batch - 1] for r in rates.values() if r[batch - 1] is not None)
    assert set(rates) == {"off", "K=1", "K=2", "K=3", "K=4"}
    document = profile_document()  # a modeled device whose memory holds the caches of 4 sequences, not 8
    document["draft"] = chain_profile().raw["draft"]
    document["target"]["contexts"][64]["batches"][8]["fits_memory"] = False
    short, _ = chain_schedule(well_drafted_chains(), LatencyProfile.from_dict(document, "synthetic"), 8, 4)
    assert short.entries[-1].high == 4
    with pytest.raises(UserError, match="profile the draft with --batches"):
        document = profile_document()
        document["draft"] = {"step_seconds": 0.002}
        chain_schedule(well_drafted_chains(), LatencyProfile.from_dict(document, "synthetic"), 8, 4)


def chain_plan(entries: tuple[ScheduleEntry, ...], size: int = 4) -> Plan:
    return Plan("sequoia", PlanModels(target="t", draft="d"), Prediction(2.5, speedup=1.4),
                tree=TokenTree.from_parents(list(range(-1, size - 1))), schedule=BatchSchedule(64, entries),
                engine="vllm")


SHRINKING = (ScheduleEntry(1, 2, True, 4, 2.6, 80.0, 1.5), ScheduleEntry(3, 4, True, 2, 1.8, 120.0, 1.1),
             ScheduleEntry(5, 8, False, None, 1.0, 140.0, 1.0))


def test_a_chain_plan_round_trips_its_schedule_and_a_branching_tree_takes_none(tmp_path):
    path = tmp_path / "chain.yaml"
    save_plan(chain_plan(SHRINKING), path)
    assert load_plan(path).schedule.entries == SHRINKING
    data = yaml.safe_load(path.read_text())
    data["tree"] = {"size": 4, "depth": 2, "parents": [-1, 0, 0, 1]}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match="not a branching tree"):
        load_plan(path)



@pytest.mark.slow
def test_a_chain_plan_holds_the_chain_of_an_off_entrys_candidate(run_cli, tmp_path):
    """On this profile one-token decoding wins at batch size 1 (the DP's chain: the root alone) while its off entry
    keeps a K = 1 candidate that the per-request decisions may draft: the plan's chain must hold it."""
    out = tmp_path / "chain.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance",
                              "acceptance/qwen2.5-coder-1.5b+0.5b-v64k.sequoia.specbench.t0.bf16.yaml", "--profile",
                              "profiles/qwen2.5-coder-1.5b+0.5b-v64k.cpu-2c-zen5.gguf.batched.yaml", "--max-size", 9,
                              "--max-depth", 8, "--engine", "vllm", "--batches", 16, "-o", out)
    assert code == 0, stderr
    plan = load_plan(out)
    first = plan.schedule.entry_for(1)
    assert not first.speculate and first.candidate is not None  # the case this test is about
    assert plan.tree.depth == first.nodes(gated=True) - 1 >= 1

@pytest.mark.parametrize("concurrency", [1, 3, 6])
def test_a_draft_chain_following_its_schedule_keeps_every_request_its_greedy_tokens(concurrency, tiny_pair):
    """A chain of 3 cut to 1 token from 3 sequences and to none from 5, as requests join and leave (and the draft
    model fed the tokens of the steps it sat out): each request's tokens are its own one-request tokens."""
    _, target, draft = tiny_pair
    entries = (ScheduleEntry(1, 2, True, 4, 2.6, 80.0, 1.5), ScheduleEntry(3, 4, True, 2, 1.8, 120.0, 1.1),
               ScheduleEntry(5, 8, False, None, 1.0, 140.0, 1.0))
    gen = torch.Generator().manual_seed(5)
    requests = [Request(torch.randint(0, 250, (n,), generator=gen).tolist(), m)
                for n, m in ((9, 30), (25, 12), (4, 40), (33, 20), (12, 26), (7, 18), (18, 9))]

    def make():
        return SequoiaDrafter(draft, [-1, 0, 1, 2])

    scheduler = Scheduler(SpeculativeEngine(target, make(), schedule=BatchSchedule(64, entries)),
                          drafters_per_slot(make), concurrency)
    results = {c.id: c.result.tokens for c in scheduler.run(requests)}
    for i, request in enumerate(requests):
        assert results[i] == SpeculativeEngine(target, make()).generate(request.prompt, request.max_new_tokens,
                                                                        SamplingParams()).tokens
    with pytest.raises(UserError, match="tree branches"):
        SequoiaDrafter(draft, [-1, 0, 0]).follow(entries[0])


def test_chain_schedules_export_as_vllm_and_tensorrt_llm_take_them():
    """vLLM: num_speculative_tokens_per_batch_size, (first, last, K) ranges from 1 (its validator: vllm/v1/
    spec_decode/dynamic/utils.py, planner/engines.py's VLLM_DYNAMIC_SD), num_speculative_tokens the largest K.
    TensorRT-LLM: draft_len_schedule {last batch size of a range: K}, checked against its rules as llm_args.py and
    speculative/utils.py read at the cited commits (TRTLLM_ARGS, TRTLLM_SPEC_UTILS): keys >= 1, K >= 0, every K at
    most max_draft_len, the smallest key's K equal to it; a batch takes the K of the first key at or above it."""
    plan = chain_plan(SHRINKING)
    config = json.loads(export_plan(plan, "vllm", "draft/path").content)
    assert config == {"method": "draft_model", "model": "draft/path", "num_speculative_tokens": 3,
                      "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 4, 1], [5, 8, 0]]}
    speculative = yaml.safe_load(export_plan(plan, "trtllm-draft", "draft/path").content)["speculative_config"]
    schedule, max_draft_len = speculative["draft_len_schedule"], speculative["max_draft_len"]
    assert all(key >= 1 for key in schedule) and all(k >= 0 for k in schedule.values())
    assert schedule[min(schedule)] == max_draft_len and all(k <= max_draft_len for k in schedule.values())
    for batch in range(1, 9):
        keys = sorted(schedule)
        trtllm = schedule[next(key for key in keys if key >= batch)]
        assert trtllm == (plan.schedule.entry_for(batch).decoding_length or 1) - 1
    candidates = chain_plan(SHRINKING[:2] + (  # off in two entries with different candidates: one range off
        ScheduleEntry(5, 6, False, None, 1.0, 140.0, 1.0, Candidate(3, 2.2, 0.98)),
        ScheduleEntry(7, 8, False, None, 1.0, 150.0, 1.0)))
    assert json.loads(export_plan(candidates, "vllm", "draft/path").content)["num_speculative_tokens_per_batch_size"] \
        == [[1, 2, 3], [3, 4, 1], [5, 8, 0]]
    growing = chain_plan((ScheduleEntry(1, 2, True, 2, 1.8, 80.0, 1.2), ScheduleEntry(3, 8, True, 4, 2.4, 90.0, 1.1)))
    with pytest.raises(UserError, match="batch size 1 drafts the most"):
        export_plan(growing, "trtllm-draft", "draft/path")


def test_the_engines_command_names_the_target_a_plan_was_solved_for_not_a_modeled_config():
    """A plan solved on a config.json (a modeled GPU profile) has no weights the engine could load: its command names
    TARGET for the user to fill in; a preset or a model directory is named as it stands."""
    plan = chain_plan(SHRINKING)
    assert export_plan(plan, "vllm", "draft/path").instructions.startswith("vllm serve t ")
    modeled = replace(plan, models=PlanModels(target="/any/where/llama-3.1-8b.json", draft="d"))
    for fmt in ("vllm", "sglang"):
        instructions = export_plan(modeled, fmt, "draft/path", concurrency=4).instructions
        assert "TARGET" in instructions and ".json" not in instructions


def test_a_served_llama_servers_command_carries_the_options_it_took_from_the_environment(monkeypatch):
    """LLAMA_ARG_ variables set llama-server's options (LLAMA_ARG_REPACK=false: --no-repack); a level's recorded
    command puts them before the binary, as a shell runs it again, and drops the port; ours takes none of them."""
    from specplan.serving import llama_server_environment, recorded_command

    monkeypatch.setenv("LLAMA_ARG_REPACK", "false")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert llama_server_environment() == {"LLAMA_ARG_REPACK": "false"}
    assert recorded_command(["/bin/llama-server", "-m", "m.gguf", "--port", "8080", "-np", "4"]) == [
        "LLAMA_ARG_REPACK=false", "/bin/llama-server", "-m", "m.gguf", "-np", "4"]
    assert recorded_command(["/bin/plan", "serve", "--port", "8080"]) == ["/bin/plan", "serve"]


@pytest.mark.parametrize("flags, signal_name, repack, hint", [
    (["amx_tile"], "ILL", None, True), (["amx_tile"], "SEGV", None, True), (["amx_tile"], "SEGV", "false", False),
    (["amx_tile"], "TERM", None, False), (["avx2"], "SEGV", None, False)])
def test_a_server_that_crashes_before_it_answers_fails_in_one_line_naming_its_log(tmp_path, monkeypatch, flags,
                                                                                  signal_name, repack, hint):
    """llama-server's AMX kernels killed its warm-up on an AMX host (SIGILL on Q4_1, SIGSEGV on Q4_K_M; its log at
    the default verbosity silent on them): the line says how to keep the weights out of them; any other crash names
    the exit code and the log alone."""
    import specplan.serving
    from specplan.serving import RunningProcess, System

    monkeypatch.setattr(specplan.serving, "cpu_info", lambda: {"cpu_flags": flags})
    if repack is None:
        monkeypatch.delenv("LLAMA_ARG_REPACK", raising=False)
    else:
        monkeypatch.setenv("LLAMA_ARG_REPACK", repack)
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\necho 'llama threadpool init'\nkill -{signal_name} $$\n")
    binary.chmod(0o755)
    server = RunningProcess(System("llama-server", lambda port, c: [str(binary), "--port", str(port)]), 1,
                            tmp_path / "server.log")
    with pytest.raises(UserError) as failure:
        server.wait_ready()
    server.stop()
    message = str(failure.value)
    assert "exited with code -" in message and str(tmp_path / "server.log") in message
    assert ("LLAMA_ARG_REPACK=false" in message) == hint and "\n" not in message


def test_llama_server_gets_the_schedules_setting_at_the_stated_concurrency():
    plan = chain_plan(SHRINKING)
    with pytest.raises(UserError, match="give --concurrency"):
        export_plan(plan, "llama.cpp", "draft.gguf")
    flags = export_plan(plan, "llama.cpp", "draft.gguf", concurrency=4, context=2048).content.split()
    assert flags[:4] == ["-np", "4", "-c", "8192"] and flags[flags.index("--spec-draft-n-max") + 1] == "1"
    assert export_plan(plan, "llama.cpp", "draft.gguf", concurrency=8).content == "-np 8 -c 32768"
    # the serving benchmark's llama-server-export: those flags at each level, its slots set by the bench alike
    flags_at = exported_llama_server_flags(plan, "draft.gguf")
    assert flags_at(4) == [word for word in export_plan(plan, "llama.cpp", "draft.gguf", concurrency=4).content.split()
                           if word not in ("-np", "4", "-c", "16384")] and "--spec-draft-model" in flags_at(4)
    assert flags_at(8) == []
    # solved for llama.cpp's own knobs, none of which pays: still the slots for the concurrency stated
    plan.engine = "llama.cpp"
    plan.solver["chain_knobs"] = {"enabled": False, "best": {"draft_max": 2, "draft_min": 0, "p_min": 0.8,
                                                             "tokens_per_step": 1.9, "speedup": 0.8}}
    assert export_plan(plan, "llama.cpp", "draft.gguf", concurrency=8, context=2048).content == "-np 8 -c 16384"


def test_the_llama_server_grid_summary_pools_one_command_served_under_two_names(tmp_path, monkeypatch, capsys):
    """bench/llama_server_grid.py: at C = 8 the export is llama-server's own no-draft command (the plan drafts
    nothing there): the two names' runs are one setting, the best of the grid; at C = 4 the export drafts, its own
    command. Results without recorded commands have them rebuilt from the names and the plan; a fixed draft length
    is read against the plan's prediction of it."""
    plan = chain_plan(SHRINKING)
    plan.solver["schedule"] = {"tokens_per_second": {"off": [10.0] * 7 + [35.0], "K=2": [None] * 7 + [28.0]}}
    plan_path = tmp_path / "plan.yaml"
    save_plan(plan, plan_path)

    def level(system: str, concurrency: int, rate: float, round_: int) -> dict:
        return {"system": system, "concurrency": concurrency, "requests": 8, "output_tokens": 512,
                "wall_seconds": 512 / rate, "tokens_per_second": rate, "tpot_p50": None, "tpot_p95": None,
                "ttft_p50": None, "ttft_p95": None, "failed": 0, "machine": "cpu", "round": round_}

    rows = [level("llama-server", 8, 40.0, 0), level("llama-server-export", 8, 37.0, 0),
            level("llama-server-draft-2", 8, 30.0, 0), level("llama-server", 8, 38.0, 1),
            level("llama-server-export", 8, 41.0, 1), level("llama-server-draft-2", 8, 31.0, 1),
            level("llama-server", 4, 20.0, 0), level("llama-server-export", 4, 22.0, 0), level("ours", 4, 30.0, 0)]
    results = tmp_path / "grid.jsonl"
    results.write_text("\n".join(json.dumps(row) for row in rows) + "\n")

    def grid(*args: str) -> tuple[int, str, str]:  # the script run in this process: no interpreter started per run
        monkeypatch.setattr(sys, "argv", ["llama_server_grid.py", str(results), *args])
        try:
            runpy.run_path("bench/llama_server_grid.py", run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = exit_.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, _ = grid("--plan", str(plan_path))
    assert code == 0
    at_four, at_eight = out.splitlines()
    assert "export / best 1.10 (llama-server)" in at_four and "ours / best 1.50" in at_four
    assert "pooled by command: export / best 1.10 (llama-server-export: 1 runs; best llama-server)" in at_four
    assert "export / best 1.00 (llama-server)" in at_eight  # 39.0 against 39.0 by name
    assert "pooled by command: export / best 1.00 (llama-server = llama-server-export: 4 runs" in at_eight
    assert "llama-server-draft-2 / llama-server 0.78 (predicted 0.80)" in at_eight  # the plan's K = 2 and off at B = 8
    eight = [row for row in rows if row["concurrency"] == 8]
    apart = {"llama-server-export": ["-ts", "1"], "llama-server-draft-2": ["-ts", "2"]}
    for row in eight:  # recorded commands, the export's apart from llama-server's
        row["command"] = ["llama-server", "-m", "t.gguf", *apart.get(row["system"], [])]
    results.write_text("\n".join(json.dumps(row) for row in eight) + "\n")
    code, recorded, _ = grid()
    assert code == 0
    assert "pooled by command: export / best 1.00 (llama-server-export: 2 runs; best llama-server)" in recorded
    eight[1].pop("command")
    results.write_text("\n".join(json.dumps(row) for row in eight) + "\n")
    code, _, err = grid()
    # an export's command rebuilt needs the plan: one line
    assert code == 2 and err.startswith("error:") and len(err.splitlines()) == 1


def test_sglang_takes_an_eagle_chains_schedule_as_adaptive_tiers_and_a_draft_model_at_one_concurrency():
    """An EAGLE head's chain (`--method eagle`): SGLang's adaptive-steps config, a tier keyed at each range's first
    batch size with its draft length the one candidate; routed as SGLang routes (the largest key at or below the
    batch size: adaptive_step_router.py, planner/engines.py's SGLANG_ADAPTIVE), every batch size gets the plan's
    length. A standalone draft runs no adaptive steps there: its flags at the stated concurrency."""
    plan = chain_plan(SHRINKING)
    config = json.loads(export_plan(plan, "sglang", "eagle/head", method="eagle").content)
    tiers = {int(key): entry["candidate_steps"] for key, entry in config.items() if key.isdigit()}
    assert tiers == {1: [3], 3: [1], 5: [0]} and "adaptive_spec_params.py" in config["written_for"]
    for batch in range(1, 65):
        assert tiers[max(key for key in tiers if key <= batch)] == [(plan.schedule.entry_for(batch).decoding_length
                                                                     or 1) - 1]
    with pytest.raises(UserError, match="give --concurrency"):
        export_plan(plan, "sglang", "draft/path")
    flags = export_plan(plan, "sglang", "draft/path", concurrency=3).content.split()
    assert flags[flags.index("--speculative-algorithm") + 1] == "STANDALONE"
    assert flags[flags.index("--speculative-num-steps") + 1] == "1"
    assert export_plan(plan, "sglang", "draft/path", concurrency=8).content == ""


SGLANG_WITH_ADAPTIVE = "0.5.23"  # the release whose adaptive-steps code the export and our replay are checked with


def sglang_adaptive_module() -> dict:
    """SGLang's adaptive_spec_params.py from its wheel on PyPI (no dependencies), run without its imports of the
    server (used only by the support check; the log call stubbed): its config loader, EMA slots and router."""
    wheels = cache_dir() / f"sglang-{SGLANG_WITH_ADAPTIVE}"
    if not any(wheels.glob("*.whl")):
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_WITH_ADAPTIVE}",
                                  "--no-deps", "--quiet", "-d", str(wheels)], capture_output=True)
        if fetched.returncode != 0:
            pytest.skip(f"sglang {SGLANG_WITH_ADAPTIVE} cannot be fetched here")
    module = ast.parse(zipfile.ZipFile(next(wheels.glob("*.whl"))).read(
        "sglang/srt/speculative/adaptive_spec_params.py").decode())
    module.body = [node for node in module.body if not (isinstance(node, ast.ImportFrom) and node.module
                                                        and node.module.startswith("sglang"))]
    namespace: dict = {"__name__": "sglang_adaptive", "log_info_on_rank0": lambda *args, **kwargs: None}
    exec(compile(module, "adaptive_spec_params.py", "exec"), namespace)
    return namespace


@pytest.mark.check
def test_sglangs_own_adaptive_code_reads_the_export_as_the_plan_does(tmp_path):
    """SGLang's AdaptiveSpeculativeParams over the exported tiers gives every batch size the plan's draft length."""
    sglang = sglang_adaptive_module()
    plan = chain_plan(SHRINKING)
    path = tmp_path / "adaptive.json"
    path.write_text(export_plan(plan, "sglang", "eagle/head", method="eagle").content)
    params = sglang["AdaptiveSpeculativeParams"](initial_steps=3, cfg_path=str(path))
    for batch in range(1, 65):
        assert params.get_steps_for_batch(batch) == (plan.schedule.entry_for(batch).decoding_length or 1) - 1


@pytest.mark.check
def test_our_sglang_rule_moves_its_steps_as_sglangs_own_controller_does():
    """The same accepted drafts fed to SGLang's AdaptiveSpeculativeParams (default tiers) and to our SglangEma rule
    (decoder/draft_rules.py), at batch sizes moving across the tiers: the same steps after every step."""
    sglang = sglang_adaptive_module()
    params = sglang["AdaptiveSpeculativeParams"](initial_steps=3)
    ours = SglangEma(initial_steps=3)
    gen = np.random.default_rng(0)
    for step in range(400):
        batch = int(gen.choice([1, 2, 5, 8, 12, 32, 40, 64, 80]))
        assert ours.tokens(batch) == params.get_steps_for_batch(batch), step
        steps = params.get_steps_for_batch(batch)
        accepted = [int(gen.integers(0, steps + 1)) if gen.random() < 0.7 else steps for _ in range(batch)]
        params.on_verify_complete(accepted, batch)
        for count in accepted:
            ours.observe(steps, count, batch)


VLLM_WITH_THE_TABLE = "0.33.0"  # the release whose dynamic/utils.py the export is checked with


@pytest.mark.check
def test_vllms_own_schedule_code_reads_the_export_as_the_plan_does():
    """vLLM's validator and dense lookup (vllm/v1/spec_decode/dynamic/utils.py of its wheel, fetched from PyPI; no
    dependencies) take the exported table and give every batch size the plan's draft length (a made-up schedule and
    the committed modeled Llama-3.1-8B ones)."""
    wheels = cache_dir() / f"vllm-{VLLM_WITH_THE_TABLE}"
    if not any(wheels.glob("*.whl")):
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={VLLM_WITH_THE_TABLE}", "--no-deps",
                                  "--quiet", "-d", str(wheels)], capture_output=True)
        if fetched.returncode != 0:
            pytest.skip(f"vllm {VLLM_WITH_THE_TABLE} cannot be fetched here")
    wheel = next(wheels.glob("*.whl"))
    namespace: dict = {}
    exec(zipfile.ZipFile(wheel).read("vllm/v1/spec_decode/dynamic/utils.py").decode(), namespace)
    for plan, largest in ((chain_plan(SHRINKING), 64), (load_plan("plans/llama-3.1-8b.vllm-chain.h100.bf16.yaml"), 256),
                          (load_plan("plans/llama-3.1-8b.vllm-chain.a100-80g.bf16.yaml"), 256)):
        config = json.loads(export_plan(plan, "vllm", "draft/path").content)
        dense = namespace["build_dynamic_sd_schedule_lookup"](config["num_speculative_tokens_per_batch_size"], largest,
                                                              config["num_speculative_tokens"])
        assert dense[1:] == [(plan.schedule.entry_for(b).decoding_length or 1) - 1 for b in range(1, largest + 1)]


# --- a table per context range (`--contexts`) -------------------------------------------------------------------

def profile_where_long_contexts_cost_more() -> LatencyProfile:
    """The profile above at context 64, and at 4,096 a step whose attention over the long cache costs in proportion to
    its rows (so that drafting no longer pays, even for one sequence)."""
    document = profile_document()
    long = {n: 0.02 * n for n in SIZES}
    document["target"]["contexts"][4096] = {"t_seconds": long, "batches": {
        B: {"t_seconds": {n: 0.02 * B * n for n in SIZES}} for B in (2, 4, 8)}}
    return LatencyProfile.from_dict(document, "synthetic")


def test_a_schedule_per_context_range_picks_each_sequences_table_and_round_trips():
    settings = TrieSettings.sized(8, 4)
    profile = profile_where_long_contexts_cost_more()
    schedule, _ = lookahead_schedule(repetitive_records(), settings, profile, 8, (2, 4, 8), contexts=(4096, 64))
    short, long = schedule.tables
    assert (short.context, short.up_to_context, long.context, long.up_to_context) == (64, 512, 4096, None)
    alone_short, _ = lookahead_schedule(repetitive_records(), settings, profile, 8, (2, 4, 8), contexts=(64,))
    settings_of = lambda table: [(e.low, e.high, e.decoding_length) for e in table.entries]  # noqa: E731
    assert settings_of(short) == settings_of(alone_short)  # each table: the schedule solved at its context alone
    assert schedule.entry_for(1, 100).speculate and not schedule.entry_for(1, 1000).speculate
    assert schedule.entry_for(1) == schedule.entry_for(1, 10)  # no context: the first table
    plan = Plan.from_dict(lookahead_plan_with(schedule.to_dict()), "p.yaml")
    assert plan.schedule == schedule and Plan.from_dict(plan.to_dict(), "again").schedule == schedule
    broken = schedule.to_dict()
    broken["longer"][0]["up_to_context"] = 100
    with pytest.raises(UserError, match="only the last table may go without one"):
        Plan.from_dict(lookahead_plan_with(broken), "p.yaml")
    with pytest.raises(UserError, match="distinct and positive"):
        BatchSchedule.by_context([short, replace(long, context=64)])


def test_each_request_follows_the_table_of_its_own_length(tiny_pair):
    """Drafting (L_d = 6) while a sequence holds up to 40 tokens, off beyond: two requests of different prompt
    lengths sharing the steps draft as their own lengths say, and keep their greedy tokens."""
    _, target, _ = tiny_pair
    schedule = BatchSchedule.by_context([
        BatchSchedule(20, (ScheduleEntry(1, 8, True, 6, 2.0, 1.0, 1.5),)),
        BatchSchedule(80, (ScheduleEntry(1, 8, False, None, 1.0, 1.0, 1.0),))])
    assert schedule.up_to_context == 40
    make = lambda: TrieDrafter(Trie(TrieSettings.sized(8, 3)))  # noqa: E731
    phrase = torch.randint(0, 250, (10,), generator=torch.Generator().manual_seed(7)).tolist()
    requests = [Request(phrase * 2 + [1], 30), Request(phrase * 5 + [2], 12)]  # 21 and 51 prompt tokens
    trees: list[tuple[int, int]] = []  # per sequence and step: (its context, its tree's size)
    forward_many, forward = target.forward_many, target.forward

    def record(items):
        trees.extend((item.cache.length, item.tokens.shape[0]) for item in items)
        return forward_many(items)

    target.forward_many = record
    target.forward = lambda tokens, positions, cache, *a, **k: trees.append((cache.length, tokens.shape[0])) or \
        forward(tokens, positions, cache, *a, **k)
    try:
        results = {c.id: c.result.tokens for c in Scheduler(SpeculativeEngine(target, make(), schedule=schedule),
                                                            drafters_per_slot(make), 2).run(requests)}
    finally:
        del target.forward_many, target.forward
    decode = [(length, size) for length, size in trees if size <= 8]  # (the prompts' prefills: 21 and 51 rows)
    assert any(length <= 40 and size > 1 for length, size in decode)  # the short sequence drafted
    assert all(size == 1 for length, size in decode if length > 40)  # past 40 tokens, nobody drafts
    for i, request in enumerate(requests):
        assert results[i] == SpeculativeEngine(target, make()).generate(request.prompt, request.max_new_tokens,
                                                                        SamplingParams()).tokens, i


def test_bench_settings_need_the_serving_benchmark_and_a_plan_with_a_schedule(run_cli, tmp_path):
    out, plan = tmp_path / "grid.jsonl", "plans/smollm2-135m.lookahead.cpu-2c.fp32.batched.yaml"
    longest = max(entry.decoding_length or 0 for entry in load_plan(plan).schedule.entries)
    for args, message in [
        (["--plan", plan, "--settings", "2"], "go with --concurrency"),
        (["--plan", plan, "--rules", "llama.cpp"], "go with --concurrency"),
        (["--plan", plan, "--rounds", "2"], "go with --concurrency"),
        (["--plan", plan, "--concurrency", "1", "--rules", "vllm-magic"], "unknown drafting rule"),
        (["--target", "tiny-random-llama", "--concurrency", "1", "--settings", "2"], "a --plan with a schedule"),
        (["--plan", plan, "--concurrency", "1", "--settings", "2,9"],
         f"--settings 9: this plan drafts 2 to {longest} nodes"),
    ]:
        code, _, err = run_cli("bench", "--dataset", "specbench", *args, "-o", out)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_the_serving_bench_runs_its_systems_in_the_order_named_and_the_plan_last_unless_named(run_cli, tmp_path,
                                                                                                 monkeypatch):
    import specplan.serving

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(lookahead_plan_with(BatchSchedule(64, (
        ScheduleEntry(1, 2, True, 8, 2.1, 150.0, 1.6), ScheduleEntry(3, 16, False, None, 1.0, 400.0, 1.0))).to_dict())))
    orders = []
    monkeypatch.setattr(specplan.serving, "serving_prices", lambda *args: ({}, None))
    monkeypatch.setattr(specplan.serving, "run_serving_bench",
                        lambda systems, *args: orders.append([system.name for system in systems]))
    for baselines, settings in [("ours,ours-ar", "2,4"), ("ours-ar", "4,2")]:
        code, _, err = run_cli("bench", "--plan", plan, "--concurrency", 1, "--dataset", "specbench", "--prompts", 2,
                               "--baselines", baselines, "--settings", settings, "-o", tmp_path / "grid.jsonl")
        assert code == 0, err
    assert orders == [["ours", "ours-ar", "setting-2", "setting-4"], ["ours-ar", "setting-4", "setting-2", "ours"]]


def test_serving_rounds_alternate_the_order_and_a_rerun_serves_only_the_rounds_not_done(tmp_path):
    """--rounds 3: every system once a round, two systems in turn first (round_order), each result with its round;
    a rerun with more rounds serves only those missing; the grid's table compares each system with off in its round."""
    from specplan.serving import RequestTiming, System, load_levels, run_serving_bench, serving_table, warmup_tokens

    served = []

    def system(name: str, tokens_per_second: float) -> System:
        def run(prompts, concurrency, max_tokens):  # each round's machine faster than the last
            if max_tokens != warmup_tokens(None):
                served.append(name)
            seconds = max_tokens / (tokens_per_second * max(served.count(name), 1))
            return [RequestTiming(0.0, 0.1, seconds, max_tokens, prompt=i) for i in range(len(prompts))]
        return System(name, in_process=run)

    systems = [system("ours-ar", 20.0), system("ours", 30.0)]
    results = tmp_path / "grid.jsonl"
    run_serving_bench(systems, [[1, 2, 3]] * 4, [2], 40, 1, results, len, "test", lambda line: None,
                      warmup_tokens(None), rounds=3)
    assert served == ["ours-ar", "ours", "ours", "ours-ar", "ours-ar", "ours"]
    levels = load_levels(results)
    assert [(r.system, r.round) for r in levels] == [("ours-ar", 0), ("ours", 0), ("ours", 1), ("ours-ar", 1),
                                                     ("ours-ar", 2), ("ours", 2)]
    served.clear()
    run_serving_bench(systems, [[1, 2, 3]] * 4, [2], 40, 1, results, len, "test", lambda line: None,
                      warmup_tokens(None), rounds=4)
    assert served == ["ours", "ours-ar"]  # round 4 (reversed) only
    table = serving_table(load_levels(results))
    assert [line.split(" | ")[2:4] for line in table.splitlines()[2:]] == [
        ["60.0", "1.50"], ["120.0", "1.50"], ["180.0", "1.50"], ["60.0", "1.50"],  # round 4 first served again
        ["40.0", "1.00"], ["80.0", "1.00"], ["120.0", "1.00"], ["40.0", "1.00"]]


REFUSING_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):  # every request refused, as a slot too short for it refuses it
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(400)
        self.end_headers()
        self.wfile.write(b"the request exceeds the available context size")

HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_level_whose_warm_up_fails_stops_before_it_is_measured(tmp_path):
    """A server that refuses its warm-up (a slot too short for it) would be measured cold, or refuse the load as
    well: the bench stops in one line naming the level and the server's log, and records no result for it."""
    import sys

    from specplan.serving import System, run_serving_bench

    script = tmp_path / "server.py"
    script.write_text(REFUSING_SERVER)
    results = tmp_path / "grid.jsonl"
    system = System("ours", lambda port, concurrency: [sys.executable, str(script), str(port)])
    with pytest.raises(UserError, match=r"^ours at concurrency 2: 2 of 2 warm-up requests failed; see .*grid\.ours"
                                        r"\.log$"):
        run_serving_bench([system], [[1, 2, 3]] * 4, [2], 4, 1, results, len, "test", lambda line: None, 8)
    assert not results.exists()


def test_every_system_serves_at_every_place_and_after_every_other_once_over_its_rounds():
    """Four systems (a plan, off and two fixed settings): over four rounds each runs first, second, third and last
    once, and right after each other system once, the first round in the order given; reversing every other round
    kept the plan and off at the ends. An odd count takes twice as many rounds; two systems alternate as before."""
    from specplan.serving import round_order

    for count in (2, 3, 4, 5):
        systems = [f"system-{index}" for index in range(count)]
        rounds = count if count % 2 == 0 else 2 * count
        orders = [round_order(systems, round_) for round_ in range(rounds)]
        assert all(sorted(order) == systems for order in orders)
        for place in range(count):
            assert sorted(order[place] for order in orders) == sorted(systems * (rounds // count))
        followed = [(order[i], order[i + 1]) for order in orders for i in range(count - 1)]
        assert sorted(followed) == sorted([(a, b) for a in systems for b in systems if a != b] * (rounds // count))
        assert orders[0] == systems and round_order(systems, rounds) == orders[0]  # the order given, repeated
    assert [round_order(["ours-ar", "ours"], round_) for round_ in range(3)] == [
        ["ours-ar", "ours"], ["ours", "ours-ar"], ["ours-ar", "ours"]]


def test_warm_up_prompts_share_what_the_level_shares_and_start_like_none_of_its_prompts():
    """Questions over one document: the warm-up requests share the document (reversed), so a server prefills it once
    and copies it as the load will, and none of them starts as a measured prompt does (nothing measured is cached by
    the warm-up); prompts sharing nothing are each reversed whole."""
    import os

    from specplan.serving import warmup_prompts

    document = list(range(100, 400))
    level = [document + [7, 8, 9], document + [10, 11], document + [12, 13, 14, 15]]
    warmup = warmup_prompts(level, 2)
    assert warmup == [document[::-1] + [9, 8, 7], document[::-1] + [11, 10]]
    assert all(len(os.path.commonprefix([ahead, measured])) == 0 for ahead in warmup for measured in level)
    assert warmup_prompts([[1, 2, 3], [4, 5]], 2) == [[3, 2, 1], [5, 4]]
    assert warmup_prompts([[1, 2, 3]], 1) == [[3, 2, 1]]


def test_a_warm_up_lasts_until_the_clock_has_timed_both_kinds_at_the_plans_longest_steps():
    """warmup_tokens: warm-up requests whose every drafted step emits the plan's most tokens (a TriForce chain of
    gamma1 + gamma2 tokens accepted whole and the target's next) still reach the plain steps the clock wants at B = C
    after the drafted ones (the steps after they join untimed, the first of each kind too); the warm-up for steps of
    ten tokens at most ends on drafted steps for such a plan and leaves its plain ones to the measured load."""
    from specplan.serving import warmup_tokens

    plan = Plan.from_dict({"kind": "plan/triforce", "models": {"target": "tiny-random-llama"},
                           "prediction": {"tokens_per_step": 12.0, "speedup": 1.5},
                           "triforce": {"gamma1": 4, "gamma2": 12, "budget": 256, "chunk": 8, "stride": 64,
                                        "context": 1024, "rebuild_below": 0.0, "bottom": "trie", "sinks": 4,
                                        "window": 64}}, "p.yaml")
    assert plan.most_tokens_per_step == 4 + 12 + 1

    def timed_in(warmup: int, batch: int = 4) -> list[int]:
        """The steps of each kind (drafted, plain) the clock holds after the warm-up, every drafted step emitting the
        plan's most tokens and each step of the kind the clock wants while it wants one."""
        clock, emitted, steps = StepClock(), 0, 0
        while emitted < warmup:
            drafted = clock.wanted(batch) is not False
            if steps >= UNTIMED_AFTER_JOIN:
                clock.step_done(batch, drafted, 0.1)
            emitted += plan.most_tokens_per_step if drafted else 1
            steps += 1
        return [len(clock.seconds.get((batch, drafted), ())) for drafted in (True, False)]

    assert min(timed_in(warmup_tokens(plan))) >= MEASURED_AT_LEAST
    assert timed_in(warmup_tokens(None))[1] < MEASURED_AT_LEAST
    assert warmup_tokens(plan) > warmup_tokens(None) == warmup_tokens(Plan.from_dict(lookahead_plan_with(
        BatchSchedule(None, (ScheduleEntry(1, 8, True, 8, 1.5, 1.0, 1.2),)).to_dict()), "l.yaml"))


def test_a_slot_holds_the_longest_prompt_with_a_warm_up_longer_than_its_output():
    """slot_context: a TriForce plan's warm-up (its chains of gamma1 + gamma2 + 1 tokens) runs longer than the load's
    128 new tokens; its server's slots take the longest prompt with that many (a 7,680-token prompt's warm-up was
    refused by a server sized for the output alone), and SLOT_CONTEXT where every prompt is short."""
    from specplan.serving import SLOT_CONTEXT, SLOT_TREE_ROOM, slot_context

    long_prompt, warmup = [1] * 7680, 198
    assert slot_context([[1] * 10, long_prompt], 128, warmup) == 7680 + warmup + SLOT_TREE_ROOM
    assert slot_context([long_prompt], 300, warmup) == 7680 + 300 + SLOT_TREE_ROOM
    assert slot_context([[1] * 10], 64, warmup) == SLOT_CONTEXT


def test_each_round_sends_its_requests_in_an_order_of_its_own_the_same_for_every_system(tmp_path):
    """A closed loop served the same order twice repeats its arrivals: round 0 sends the prompts in order, every
    later round a permutation of the same requests, drawn once for the round and sent to every system alike."""
    from specplan.serving import RequestTiming, System, prompts_at_level, run_serving_bench, warmup_tokens

    prompts = [[i] for i in range(8)]
    assert prompts_at_level(prompts, 2, 4) == prompts
    orders = [prompts_at_level(prompts, 2, 4, round_) for round_ in (1, 2)]
    assert all(sorted(order) == prompts and order != prompts for order in orders) and orders[0] != orders[1]
    assert prompts_at_level(prompts, 2, 4, 1) == orders[0]  # drawn the same again (a rerun, bench/price_levels.py)
    assert prompts_at_level(prompts[:3], 2, 3) == [[0], [1], [2], [0], [1], [2]]

    sent: dict[tuple[str, int], list[list[int]]] = {}

    def system(name: str) -> System:
        def run(level_prompts, concurrency, max_tokens):
            if max_tokens == 40:
                sent[(name, sum(key[0] == name for key in sent))] = level_prompts
            return [RequestTiming(0.0, 0.1, 1.0, max_tokens, prompt=i) for i in range(len(level_prompts))]
        return System(name, in_process=run)

    run_serving_bench([system("ours-ar"), system("ours")], prompts, [2], 40, 4, tmp_path / "grid.jsonl", len,
                      "test", lambda line: None, warmup_tokens(None), rounds=3)
    for round_ in range(3):
        assert sent[("ours-ar", round_)] == sent[("ours", round_)] == prompts_at_level(prompts, 2, 4, round_)


@pytest.mark.parametrize("bottom", ["trie", "model"])
def test_a_triforce_hierarchy_follows_its_schedule_and_every_request_keeps_its_greedy_tokens(bottom, tiny_pair,
                                                                                           monkeypatch):
    """gamma2 = 4 alone, 2 beside one or two others, off from four on: each step's chains are cut to the batch's
    setting (none drafted where it is off, the bottom and the retrieval cache keeping up with the text meanwhile), and
    each request's greedy tokens equal its own one-request tokens, at every concurrency."""
    from specplan.core.method_settings import RetrievalSettings
    from specplan.decoder.engine import SequenceRun
    from specplan.decoder.triforce import HierarchicalDrafter, StreamingDrafter, bottom_trie_settings

    from toy import long_prompt

    _, target, draft = tiny_pair
    schedule = BatchSchedule(None, (ScheduleEntry(1, 1, True, 5, 3.0, 10.0, 1.3),
                                    ScheduleEntry(2, 3, True, 3, 2.0, 20.0, 1.1),
                                    ScheduleEntry(4, 8, False, None, 1.0, 30.0, 1.0)))

    def make():
        lower = (TrieDrafter(Trie(bottom_trie_settings(2))) if bottom == "trie"
                 else StreamingDrafter(draft, gamma=2, sinks=4, window=64))
        return HierarchicalDrafter(target, lower, 2, 4, RetrievalSettings(256, 8, 16))

    requests = [Request(long_prompt(300 + 30 * i, i), 14 + 5 * i) for i in range(6)]
    alone = [SpeculativeEngine(target, make()).generate(r.prompt, r.max_new_tokens, SamplingParams()).tokens
             for r in requests]
    decided, chains = [], []
    decide, propose_many = SequenceRun.decide, HierarchicalDrafter.propose_many
    monkeypatch.setattr(SequenceRun, "decide", lambda run, batch, load=None: decide(run, batch, load) or decided.append(
        (batch, run.drafter.gamma2)))

    def recorded(drafters, *args):
        trees = propose_many(drafters, *args)
        chains.extend((d.gamma2, tree.size - 1) for d, tree in zip(drafters, trees))
        return trees

    monkeypatch.setattr(HierarchicalDrafter, "propose_many", staticmethod(recorded))
    for concurrency in (1, 3, 5):
        scheduler = Scheduler(SpeculativeEngine(target, make(), schedule=schedule), drafters_per_slot(make),
                              concurrency)
        results = {c.id: c.result.tokens for c in scheduler.run(requests)}
        assert [results[i] for i in range(len(requests))] == alone, concurrency
    expected = {1: 4, 2: 2, 3: 2, 4: 0, 5: 0}
    assert all(gamma2 == expected[batch] for batch, gamma2 in decided)
    assert {batch for batch, _ in decided} == {1, 2, 3, 4, 5}
    assert chains and all(gamma2 > 0 and size >= gamma2 for gamma2, size in chains)
