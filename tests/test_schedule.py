"""Plans per batch size: the Lookahead schedule the solver chooses from t(B, n), the plan file that carries it, and
the continuous-batching decoder following it step by step without changing any request's tokens."""

from __future__ import annotations

import pytest
import torch
import yaml

from specplan.core.acceptance_schema import LookaheadAcceptance, LookaheadRecord
from specplan.core.errors import UserError
from specplan.core.method_settings import TrieSettings
from specplan.core.plan_schema import BatchSchedule, Plan, ScheduleEntry, load_plan
from specplan.core.profile_schema import LatencyProfile
from specplan.decoder.batching import Request, Scheduler
from specplan.decoder.drafters import TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.trie import Trie
from specplan.planner.lookahead import lookahead_schedule

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
    for batch in range(1, 9):  # each range's setting is the best priced at every batch size it covers
        entry = schedule.entry_for(batch)
        name = f"L_d={entry.decoding_length}" if entry.speculate else "off"
        assert rates[name][batch - 1] == max(r[batch - 1] for r in rates.values() if r[batch - 1] is not None)
    assert len(rates["off"]) == 8 and set(rates) == {"off", "L_d=2", "L_d=4", "L_d=8"}


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


def lookahead_plan_with(schedule: dict) -> dict:
    return {"kind": "plan/lookahead", "models": {"target": "tiny-random-llama"},
            "lookahead": TrieSettings.sized(8, 4).to_dict(), "tokenizer": {"vocab_size": 8, "sha256": "x"},
            "prediction": {"tokens_per_step": 1.5}, "schedule": schedule}


def test_a_plan_carries_its_schedule_and_a_bad_one_is_one_line():
    schedule = BatchSchedule(64, (ScheduleEntry(1, 2, True, 8, 2.1, 150.0, 1.6),
                                  ScheduleEntry(3, 16, False, None, 1.0, 400.0, 1.0)))
    document = lookahead_plan_with(schedule.to_dict())
    plan = Plan.from_dict(document, "p.yaml")
    assert plan.schedule == schedule and Plan.from_dict(plan.to_dict(), "again").schedule == schedule
    for broken, message in [
        ({"entries": [{**schedule.entries[0].to_dict(), "batches": [2, 3]}]}, "contiguous from 1"),
        ({"entries": [{**schedule.entries[0].to_dict(), "decoding_length": 32}]}, "exceeds the plan's 8"),
        ({"entries": [{**schedule.entries[0].to_dict(), "batches": [3, 1]}]}, "1 <= low <= high"),
        ({"entries": []}, "non-empty list"),
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
    scheduler = Scheduler(SpeculativeEngine(target, make()), drafters_per_slot(make), 3, schedule=schedule)
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
