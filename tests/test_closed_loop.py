"""The price of a closed-loop serving load (planner/closed_loop.py), step by step on a profile whose every time is
known, and `plan bench --concurrency` writing it beside each measured level."""

from __future__ import annotations

import pytest
import yaml

from specplan.core.errors import UserError
from specplan.core.profile_schema import LatencyProfile
from specplan.planner.closed_loop import (
    CLIENT_TURNAROUND_SECONDS,
    OFF,
    SettingPrice,
    closed_loop_price,
    mix_shares,
    step_seconds,
)

STEP = 0.010  # every step of 1 or 2 sequences, any rows up to 4
PREFILL_PER_TOKEN = 0.001


def flat_profile(prefills: bool = True) -> LatencyProfile:
    flat = {n: STEP for n in (1, 2, 4)}
    target = {"t_seconds": flat, "contexts": {64: {"t_seconds": flat, "batches": {2: {"t_seconds": flat}}}}}
    if prefills:
        target["prefill_seconds"] = {10: 10 * PREFILL_PER_TOKEN, 100: 100 * PREFILL_PER_TOKEN}
    return LatencyProfile.from_dict({"kind": "profile/latency", "target": target}, "flat")


def test_a_step_where_some_sequences_draft_is_priced_by_its_rows_and_their_draft_forwards():
    """A step of 4 sequences, k drafting a 4-row setting: t(4, n) at its mean rows, the draft's forwards (a TriForce
    middle level's rounds) over the k alone. Where rows cost nothing more (a flat t(B, n)), what k drafting add is
    the middle forwards at k: shares t(1) / t(4) and t(2) / t(4) of what all four add; where nothing is added,
    none."""
    by_batch = {1: 0.010, 2: 0.015, 4: 0.020}
    flat = {n: by_batch[1] for n in (1, 2, 4)}
    batches = {b: {"t_seconds": {n: seconds for n in (1, 2, 4)}} for b, seconds in by_batch.items() if b > 1}
    target = {"t_seconds": flat, "contexts": {64: {"t_seconds": flat, "batches": batches}}}
    profile = LatencyProfile.from_dict({"kind": "profile/latency", "target": target}, "flat in n")
    chain = SettingPrice(3.0, rows=4.0, middle_rounds=2.0, middle_rows=4, middle_context=64)
    assert step_seconds(profile, 4, chain, [64], drafting=0) == pytest.approx(step_seconds(profile, 4, OFF, [64]))
    assert step_seconds(profile, 4, chain, [64], drafting=4) == step_seconds(profile, 4, chain, [64])
    assert mix_shares(profile, 4, chain, 64) == pytest.approx((0.010 / 0.020, 0.015 / 0.020))
    rows = SettingPrice(2.0, rows=4.0)  # rows alone: nothing added where they cost nothing; else growing with k
    assert mix_shares(flat_profile(), 2, rows, 64) == ()
    shares = mix_shares(_rows_profile(), 4, rows, 64)
    assert len(shares) == 2 and 0.0 < shares[0] < shares[1] < 1.0


def _rows_profile() -> LatencyProfile:
    """t(B, n) growing with the step's rows, B x n, at 1, 2 and 4 sequences."""
    curve = lambda batch: {n: 0.010 + 0.001 * batch * n for n in (1, 2, 4)}  # noqa: E731
    target = {"t_seconds": curve(1),
              "contexts": {64: {"t_seconds": curve(1), "batches": {b: {"t_seconds": curve(b)} for b in (2, 4)}}}}
    return LatencyProfile.from_dict({"kind": "profile/latency", "target": target}, "rows")


def test_one_client_pays_its_prefill_then_a_step_per_token_or_per_drafted_run():
    prompt = list(range(11))  # 10 prefilled tokens: the last is the first step's root
    off = closed_loop_price(flat_profile(), [prompt], 1, 10, lambda batch: OFF)
    assert off.steps == 10 and off.wall_seconds == pytest.approx(10 * PREFILL_PER_TOKEN + 10 * STEP)
    assert off.tokens_per_second == pytest.approx(10 / off.wall_seconds) and off.mean_batch == 1
    drafted = closed_loop_price(flat_profile(), [prompt], 1, 10, lambda batch: SettingPrice(2.5, rows=4))
    assert drafted.steps == 4 and drafted.wall_seconds == pytest.approx(10 * PREFILL_PER_TOKEN + 4 * STEP)


def test_clients_send_their_next_prompt_when_the_last_completes_and_a_slot_reuses_its_prefix():
    shared = list(range(50))
    prompts = [shared + [100 + i] * 11 for i in range(4)]  # 61 tokens each, the first 50 the same
    price = closed_loop_price(flat_profile(), prompts, 2, 5, lambda batch: OFF)
    # two waves of two: the first prefills 60 + 60 tokens, the second only what its slots do not hold (10 + 10)
    assert price.prefill_seconds == pytest.approx((120 + 20) * PREFILL_PER_TOKEN)
    assert price.steps == 10 and price.mean_batch == 2 and price.output_tokens == 20
    assert price.wall_seconds == pytest.approx(price.prefill_seconds + 10 * STEP + CLIENT_TURNAROUND_SECONDS)
    # each request's own output length: the batch drains as the short one leaves
    uneven = closed_loop_price(flat_profile(), prompts[:2], 2, 5, lambda batch: OFF, output_tokens=[2, 5])
    assert uneven.steps == 5 and uneven.mean_batch == pytest.approx(7 / 5) and uneven.output_tokens == 7


def test_a_prompt_a_slot_lost_is_priced_from_the_prompt_cache():
    first, second = [1] * 80 + [2], [3] * 80 + [4]  # 80 prefilled tokens each, nothing shared
    price = closed_loop_price(flat_profile(), [first, second, first], 1, 5, lambda batch: OFF)
    # the second prompt keeps nothing of the first, which the cache saves; the first again starts from it
    assert price.prefill_seconds == pytest.approx((80 + 80 + 1) * PREFILL_PER_TOKEN)  # a prefill reads 1 at least
    short = [[5] * 20 + [6], [7] * 20 + [8], [5] * 20 + [6]]  # below MIN_SAVED_TOKENS: not saved
    assert closed_loop_price(flat_profile(), short, 1, 5, lambda batch: OFF).prefill_seconds == pytest.approx(
        3 * 20 * PREFILL_PER_TOKEN)


def test_prompts_sharing_a_document_in_flight_are_priced_with_it_computed_once():
    """Two questions over one 100-token document sent at once: the first prefills it, the other copies it and
    prefills its question; the next ones join slots that hold it. A shared head shorter than MIN_SAVED_TOKENS is
    computed by each of the first two."""
    document = list(range(100, 200))
    questions = [[1] * 10 + [2], [3] * 20 + [4], [5] * 5 + [6], [7] * 8 + [8]]
    prompts = [document + question for question in questions]
    price = closed_loop_price(flat_profile(), prompts, 2, 5, lambda batch: OFF, output_tokens=[2, 5, 5, 5])
    assert price.prefill_seconds == pytest.approx((100 + 10 + 20 + 5 + 8) * PREFILL_PER_TOKEN)
    head = list(range(100, 140))
    short = closed_loop_price(flat_profile(), [head + q for q in questions[:3]], 2, 5, lambda batch: OFF)
    assert short.prefill_seconds == pytest.approx((2 * 40 + 10 + 20 + 5) * PREFILL_PER_TOKEN)


def test_the_setting_follows_the_batch_in_flight():
    seen = []

    def setting(batch: int) -> SettingPrice:
        seen.append(batch)
        return SettingPrice(2.0, rows=2) if batch == 1 else OFF

    closed_loop_price(flat_profile(), [list(range(11))] * 3, 2, 4, setting, output_tokens=[4, 1, 4])
    assert 2 in seen and 1 in seen  # two in flight, then the last request alone drafts


def test_a_load_is_priced_only_on_a_profile_with_the_target_prefills():
    with pytest.raises(UserError, match="profile with --batches"):
        closed_loop_price(flat_profile(prefills=False), [[1, 2, 3]], 1, 4, lambda batch: OFF)


def test_plan_bench_prices_each_system_of_a_lookahead_schedule(run_cli, tmp_path):
    """serving_prices: the schedule, its fixed settings and no drafting, each load priced on the plan's profile and
    acceptance, and again at a measured tokens per step."""
    from test_schedule import profile_document, repetitive_records

    from specplan.core.acceptance_schema import LookaheadAcceptance
    from specplan.core.plan_schema import load_plan
    from specplan.serving import MeasuredSteps, serving_prices

    acceptance, profile, plan_path = (tmp_path / name for name in ("a.yaml", "p.yaml", "plan.yaml"))
    acceptance.write_text(yaml.safe_dump(LookaheadAcceptance(
        "toy", {"vocab_size": 64, "sha256": "x"}, repetitive_records()).to_dict()))
    document = profile_document()
    profile.write_text(yaml.safe_dump(document))
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", acceptance, "--profile", profile,
                              "--decoding-lengths", "4,8", "--branch-lengths", "2,4", "--batches", 8, "-o", plan_path)
    assert code == 0, stderr
    plan, said = load_plan(plan_path), []
    assert serving_prices(plan, [4], 32, 2, said.append) == ({}, None) and "no target prefills" in said[0]
    document["target"]["prefill_seconds"] = {16: 0.016, 64: 0.064}
    profile.write_text(yaml.safe_dump(document))
    prices, basis = serving_prices(plan, [4], 32, 2, said.append)
    assert basis.startswith("the plan's acceptance records") and basis in said[-1]
    assert set(prices) == {"ours", "ours-fixed", "ours-ar", "setting-4"}
    prompts = [list(range(10, 30))] * 16
    alone, crowded = plan.schedule.entry_for(1), plan.schedule.entry_for(8)
    assert alone.speculate and not crowded.speculate
    # alone the schedule drafts and is priced above no drafting; at 8 in flight it is off: the same load, one price
    assert prices["ours"](prompts[:2], 1, 32, None) > prices["ours-ar"](prompts[:2], 1, 32, None)
    assert prices["ours"](prompts, 8, 32, None) == pytest.approx(prices["ours-ar"](prompts, 8, 32, None))
    # priced again at drafted steps measured to emit one token: drafting costs its rows and yields nothing
    plain = prices["ours-ar"](prompts[:2], 1, 32, None)
    assert prices["setting-4"](prompts[:2], 1, 32, MeasuredSteps(1.0, 1.0)) < plain
    # a request deciding per step runs both kinds: none drafted is no drafting's price, a mix lies between the two
    drafted = prices["ours"](prompts[:2], 1, 32, MeasuredSteps(3.0, 1.0))
    assert prices["ours"](prompts[:2], 1, 32, MeasuredSteps(3.0, 0.0)) == pytest.approx(plain)
    assert drafted > prices["ours"](prompts[:2], 1, 32, MeasuredSteps(3.0, 0.5)) > plain


def test_a_levels_measured_steps_are_its_drafted_steps_tokens_and_share():
    """LevelResult.measured_steps: a plain step emits one token, so the drafted steps emitted the rest; None where
    none drafted or no server reported its steps."""
    from specplan.serving import LevelResult, MeasuredSteps, RequestTiming

    def level(*requests: tuple[int, int | None, int | None]) -> LevelResult:
        timings = [RequestTiming(0.0, 0.1, 1.0, tokens, steps, drafted_steps=drafted)
                   for tokens, steps, drafted in requests]
        return LevelResult.summarize("ours", len(timings), timings, 0, "test")

    measured = level((16, 10, 2), (8, 8, 0)).measured_steps
    assert measured == pytest.approx(MeasuredSteps((24 - 16) / 2, 2 / 18))
    assert level((8, 8, 0)).measured_steps is None and level((8, None, None)).measured_steps is None


def test_a_load_of_the_prompts_a_lookahead_plan_was_solved_on_is_priced_on_their_own_records(run_cli, tmp_path):
    """A served subset of the solved prompts drafts as those prompts do: its price replays their records, in the
    order the load sends them; a load with a prompt the plan never saw is priced on all the records."""
    from test_schedule import profile_document

    from specplan.core.acceptance_schema import LookaheadAcceptance, LookaheadRecord
    from specplan.core.plan_schema import load_plan
    from specplan.planner.lookahead import plan_setting_prices, replay, served_records, solved_records
    from specplan.serving import MeasuredSteps, serving_prices

    phrase = list(range(10, 22))
    repeating = [LookaheadRecord(f"r{i}", "toy", phrase * 2 + [30 + i], (phrase * 4)[i:i + 40]) for i in range(3)]
    novel = [LookaheadRecord(f"n{i}", "toy", [40 + i, 41 + i, 42 + i], list(range(100 + 40 * i, 140 + 40 * i)))
             for i in range(3)]
    acceptance, profile, plan_path = (tmp_path / name for name in ("a.yaml", "p.yaml", "plan.yaml"))
    acceptance.write_text(yaml.safe_dump(LookaheadAcceptance(
        "toy", {"vocab_size": 512, "sha256": "x"}, repeating + novel).to_dict()))
    document = profile_document()
    document["target"]["prefill_seconds"] = {16: 0.016, 64: 0.064}
    profile.write_text(yaml.safe_dump(document))
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", acceptance, "--profile", profile,
                              "--decoding-lengths", "4,8", "--branch-lengths", "2,4", "--batches", 8, "-o", plan_path)
    assert code == 0, stderr
    plan = load_plan(plan_path)
    sent = [novel[1].prompt, repeating[0].prompt, novel[1].prompt]
    assert served_records(solved_records(plan), sent) == [novel[1], repeating[0]]
    assert served_records(solved_records(plan), sent + [[7, 8, 9]]) is None
    prices, basis = serving_prices(plan, [4], 40, 2, lambda line: None, [r.prompt for r in repeating])
    assert basis.startswith("the served prompts' own acceptance records (3 prompts)")
    served = plan_setting_prices(plan, {4}, 2, 40, repeating)[4]
    everything = plan_setting_prices(plan, {4}, 2, 40)[4]
    assert served.tokens_per_step == pytest.approx(replay(repeating, plan.settings, 4, 2).tokens_per_step)
    assert served.tokens_per_step > everything.tokens_per_step  # the novel outputs draft nothing
    level = [r.prompt for r in repeating]
    assert prices["setting-4"](level, 1, 40, None) == pytest.approx(
        prices["setting-4"](level, 1, 40, MeasuredSteps(served.tokens_per_step, 1.0)))
    _, unseen = serving_prices(plan, [4], 40, 2, lambda line: None, [[7, 8, 9]])
    assert unseen.startswith("the plan's acceptance records")
