"""Per-request drafting decisions (decoder/gate.py): a request whose drafts yield too little at the plan's price sits
steps out, probing again when PROBE_SHARE of the time it sat out pays what a probe is expected to lose, and its
tokens stay its own."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specplan.core.choices import CANDIDATE_SPEEDUP
from specplan.core.method_settings import TrieSettings
from specplan.core.plan_schema import BatchSchedule, Plan, PlanModels, Prediction, ScheduleEntry
from specplan.decoder import batching
from specplan.decoder.batching import Request, Scheduler
from specplan.decoder.drafters import Drafter, SequoiaDrafter, TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.gate import (
    MEASURED_AT_LEAST,
    MEASURED_STEPS,
    PROBE_SHARE,
    REASONS,
    RECENT_STEPS,
    SETTLED_STEPS,
    STALE_AFTER,
    UNTIMED_FIRST_STEPS,
    YIELD_WINDOW,
    DraftGate,
    DraftPasses,
    RecentYields,
    StepClock,
    probe_period,
    settle_step,
    shrunk_mean,
)
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.trie import Trie

from toy import drafters_per_slot


def test_a_request_stops_drafting_when_its_drafts_fail_and_probes_again():
    """Predicted 3 tokens a step for 1.5x (a drafted step costs 2 plain ones): a request emitting 1 token per drafted
    step falls below break-even (yield 1/3 of the prediction, 0.5x) within a few steps, then drafts once in the
    steps whose PROBE_SHARE pays what a probe loses at its yield (2 plain steps less the 3 r tokens it expects, r its
    window's mean beside the prior: settled at (2 + 8 / 3) / 10); one whose drafts land keeps drafting; where nothing
    is priced every step drafts."""
    gate = DraftGate(lambda batch, context: (3.0, 1.5))
    decisions = []
    for _ in range(400):
        decisions.append(gate.drafts(4, 100))
        gate.observe(1, 4)
    first_off = decisions.index(False)
    assert 1 < first_off <= 5
    probes = [step for step in range(first_off, len(decisions)) if decisions[step]]
    settled_loss = 2.0 - 3.0 * shrunk_mean(1.0, [1 / 3] * YIELD_WINDOW)
    assert settled_loss == pytest.approx(0.6)
    gaps = [later - earlier for earlier, later in zip(probes, probes[1:])]
    assert gaps[0] < gaps[-1]  # at first the window holds drafts before the stop: r nearer break-even, probes sooner
    assert set(gaps[YIELD_WINDOW:]) == {math.ceil(settled_loss / PROBE_SHARE)}
    landing = DraftGate(lambda batch, context: (3.0, 1.5))
    for _ in range(20):
        assert landing.drafts(1, 100)
        landing.observe(3, 4)
    unpriced = DraftGate(lambda batch, context: None)
    for _ in range(10):
        assert unpriced.drafts(8, 100)
        unpriced.observe(1, 4)


def test_an_idle_engines_recent_yields_set_a_joining_requests_prior_from_its_first_step():
    """A drafted step costs 2 plain ones (3 tokens predicted for 1.5x). After the engine's recent drafted steps
    yielded a fifth of the prediction, a request joining the idle engine sits its first step out (r = (2 + 8 x 0.2) /
    10: 1.08 tokens expected); after recent steps that landed it drafts, and its drafted steps join the engine's;
    steps more than RECENT_STEPS of the engine's old no longer count. Until its own first drafted step counts, its
    prior follows the engine's steps as they come: a burst joining a fresh engine learns from the first of it to
    draft; after that, the prior it decided that step at stays."""
    def joining(recent_yields: list[float], age: int = 0) -> DraftGate:
        recent = RecentYields()
        for ratio in recent_yields:
            recent.add(ratio)
        recent.step += age
        gate = DraftGate(lambda batch, context: (3.0, 1.5))
        gate.join(recent, None)
        return gate

    after_misses, after_landings = joining([0.2] * YIELD_WINDOW), joining([1.0] * YIELD_WINDOW)
    assert not after_misses.drafts(1, 100) and after_landings.drafts(1, 100)
    assert after_misses.prior == pytest.approx((2 + 0.2 * YIELD_WINDOW) / (2 + YIELD_WINDOW))
    after_landings.observe(1.5, 4)
    assert after_landings.recent.yields[-1] == (0, 0.5)
    long_ago = joining([0.2] * YIELD_WINDOW, age=RECENT_STEPS)
    assert long_ago.prior == 1.0 and long_ago.drafts(1, 100)
    fresh = RecentYields()
    first, second = (DraftGate(lambda batch, context: (3.0, 1.2)) for _ in range(2))  # 2.5 plain steps
    first.join(fresh, None)
    second.join(fresh, None)
    assert first.drafts(2, 100)
    first.observe(1, 4)  # a third of the prediction: (2 + 1 / 3) / 3 leaves 2.33 tokens expected
    assert not second.drafts(2, 100) and second.prior == pytest.approx(first.yield_ratio)
    second.drafting = True
    second.observe(3, 4)
    first.observe(3, 4)
    assert second.prior == pytest.approx((2 + 1 / 3) / 3) and second.follows is None
    unaided = DraftGate(lambda batch, context: (3.0, 1.5))  # the plan's prior alone: (2 + 0.5) / 3 pays
    assert unaided.drafts(1, 100)
    unaided.observe(1.5, 4)
    assert unaided.drafts(1, 100)


def test_of_a_burst_joining_a_fresh_engine_one_drafts_and_the_rest_follow_its_yield():
    """Three requests join an engine without a drafted step (2.5 plain steps for 3 tokens: r = 1 pays): one drafts the
    step, the others sit it out; a fourth run past its stop tokens (a warm-up's) drafts as it decided. Once the first
    step's yield is a third of the prediction, the rest expect (2 + 1 / 3) / 3 x 3 = 2.33 tokens and sit out; where
    the engine's recent steps yielded the prediction, all of a burst draft."""
    for recent_yield, rest_draft in ((None, False), (1.0, True)):
        recent = RecentYields()
        if recent_yield is not None:
            recent.add(recent_yield)
        gates = [DraftGate(lambda batch, context: (3.0, 1.2)) for _ in range(4)]
        for gate in gates[:3]:
            gate.join(recent, None)
        gates[3].join(recent, None, adds_to_recent=False)
        assert all(gate.drafts(4, 100) for gate in gates)
        settle_step(gates)
        assert [gate.drafting for gate in gates] == [True, rest_draft, rest_draft, True]
        for gate in gates:
            gate.observe(1, 4)
        assert [gate.drafts(4, 100) for gate in gates[:3]] == [False] * 3
    unpriced = [DraftGate(lambda batch, context: None) for _ in range(2)]  # the drafters' settings decide, as ever
    for gate in unpriced:
        gate.join(RecentYields(), None)
    assert all(gate.drafts(4, 100) for gate in unpriced)
    settle_step(unpriced)
    assert all(gate.drafting for gate in unpriced)


def test_skewed_yields_that_pay_on_average_keep_drafting():
    """Drafted steps emitting 1, 1, 1, 5 tokens (2 on average) where a drafted step costs 1.8 plain ones (3.6 tokens
    predicted for 2x): a mean over the last steps keeps the request drafting through its runs of short steps (a
    running average weighing the last step by 0.3 would stop it 18 times in these 40 steps)."""
    gate = DraftGate(lambda batch, context: (3.6, 2.0))
    for step in range(40):
        assert gate.drafts(1, 100)
        gate.observe(5 if step % 4 == 3 else 1, 4)


def test_steps_without_a_draft_do_not_count():
    """A trie with nothing to propose costs a plain step: a run of such steps leaves the request's yield as it was."""
    gate = DraftGate(lambda batch, context: (3.0, 1.5))
    for _ in range(20):
        assert gate.drafts(1, 100)
        gate.observe(1, 0)
    assert gate.yield_ratio == 1.0


def test_beside_others_a_drafting_step_without_a_draft_counts_its_one_token():
    """At 4 in flight the batch's step is a drafted one whether or not this request's trie matched: a step without a
    draft counts as the one token it emitted (a third of the plan's 3), as the plan's tokens per step count it."""
    gate = DraftGate(lambda batch, context: (3.0, 1.5))
    for _ in range(8):
        gate.drafts(4, 100)
        gate.overrule(True)  # drafting, as its batch's mean decided
        gate.observe(1, 0)
    assert gate.yield_ratio == pytest.approx(shrunk_mean(1.0, [1 / 3] * 8)) and gate.yield_ratio < 0.5


def test_the_plan_prices_drafted_steps_per_batch_size():
    entries = (ScheduleEntry(1, 2, True, 5, 2.4, 100.0, 1.3), ScheduleEntry(3, 3, True, 3, 1.8, 120.0, 1.05),
               ScheduleEntry(4, 16, False, None, 1.0, 130.0, 1.0))
    plan = Plan("lookahead", PlanModels(target="t"), Prediction(2.4, speedup=1.3))
    assert plan.predicted_at(1) == (2.4, 1.3)
    plan.schedule = BatchSchedule(None, entries)
    assert plan.predicted_at(2) == (2.4, 1.3) and plan.predicted_at(3) == (1.8, 1.05)
    assert plan.predicted_at(4) is None and plan.predicted_at(64) is None
    plan.schedule = BatchSchedule(None, (ScheduleEntry(1, 4, True, 5, 2.4, 100.0, 1.3, speedups=(1.3, 1.2, 1.1, 1.0)),))
    assert plan.predicted_at(3) == (2.4, 1.1) and plan.predicted_at(9) == (2.4, 1.0)  # beyond the last range: its last
    assert Plan("lookahead", PlanModels(target="t"), Prediction(2.4)).predicted_at(1) is None


PRICE_RARELY_PAID = (6.0, 1.05)  # a request must yield 95% of 6 tokens a step: the tiny models' drafts do not


@pytest.mark.parametrize("method", ["lookahead", "sequoia"])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_requests_sitting_steps_out_keep_their_own_greedy_tokens(method, concurrency, tiny_pair, monkeypatch):
    """At a price the drafts do not pay, every request soon sits out nearly every step, its drafter
    keeping up through the steps it sits out (a Sequoia draft model feeds them at the next drafted step); each
    request's greedy tokens equal its own tokens drafted at every step."""
    _, target, draft = tiny_pair
    make = {"lookahead": lambda: TrieDrafter(Trie(TrieSettings(decoding_length=8, branch_length=3))),
            "sequoia": lambda: SequoiaDrafter(draft, [-1, 0, 0, 1, 2, 3])}[method]
    idle_steps = []
    idle = Drafter.idle
    monkeypatch.setattr(Drafter, "idle", lambda self, root: idle_steps.append(root) or idle(self, root))
    gen = torch.Generator().manual_seed(3)
    requests = [Request(torch.randint(0, 250, (n,), generator=gen).tolist(), m)
                for n, m in ((7, 40), (30, 25), (12, 33), (50, 18), (4, 29))]
    engine = SpeculativeEngine(target, make(), pricing=lambda batch, context: PRICE_RARELY_PAID)
    results = {c.id: c.result.tokens for c in Scheduler(engine, drafters_per_slot(make), concurrency).run(requests)}
    assert len(idle_steps) > 40
    monkeypatch.setattr(Drafter, "idle", idle)
    for i, request in enumerate(requests):
        assert results[i] == SpeculativeEngine(target, make()).generate(request.prompt, request.max_new_tokens,
                                                                        SamplingParams()).tokens
    alone = SpeculativeEngine(target, make(), pricing=lambda batch, context: PRICE_RARELY_PAID)
    assert alone.generate(requests[0].prompt, 40, SamplingParams()).tokens == results[0]


def test_each_decision_says_why_and_a_request_counts_its_steps_by_why(tiny_pair):
    """The gate names each decision (REASONS), the batch's overruling included; a request's result counts its steps
    by why, the counts adding up to its steps (what `plan bench` reports of a served level)."""
    assert DraftGate(lambda batch, context: None).drafts(4, 100) and _decided([]).reason == "pays"
    assert not _decided([0.3] * 8).drafting and _decided([0.3] * 8).reason == "sits out"
    probing = DraftGate(lambda batch, context: (3.0, 1.5))
    probing.yields.extend([0.3] * 8)
    probing.idle_steps = 1000
    assert probing.drafts(4, 100) and probing.reason == "probe"
    timing = DraftGate(lambda batch, context: (3.0, 1.5), StepClock())
    assert timing.drafts(4, 100) and timing.reason == "timing"
    batch = [_decided([0.8] * 8), _decided([1.0] * 8), _decided([0.4] * 8)]
    settle_step(batch)
    assert [g.reason for g in batch] == ["pays", "pays", "batch"] and all(g.drafting for g in batch)
    assert {g.reason for g in (_decided([0.3]), probing, timing)} <= set(REASONS)
    _, target, _ = tiny_pair
    engine = SpeculativeEngine(target, TrieDrafter(Trie(TrieSettings(decoding_length=8, branch_length=3))),
                               pricing=lambda batch, context: PRICE_RARELY_PAID)
    result = engine.generate(list(range(3, 40)), 30, SamplingParams())
    assert sum(result.decisions.values()) == result.steps
    assert result.decisions.get("sits out: plain", 0) > 0
    assert set(result.decisions) <= {f"{why}: {kind}" for why in REASONS for kind in ("drafts", "plain")}
    tokens, speedup = PRICE_RARELY_PAID  # no clock: each decision priced at the plan's price, alone in its batch
    (cost, expected), = result.step_prices.values()
    assert list(result.step_prices) == [1] and cost == pytest.approx(tokens / speedup) and 0 < expected < cost
    unpriced = SpeculativeEngine(target).generate(list(range(3, 40)), 5, SamplingParams())
    assert unpriced.decisions == {} and unpriced.step_prices == {}


def test_the_clock_prices_a_drafted_step_once_both_kinds_are_timed():
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):
        assert clock.drafted_step_cost(2) is None
        clock.record(2, True, 0.030)
        clock.record(2, True, 0.036)
    assert clock.drafted_step_cost(2) is None  # no plain step at B = 2 yet
    for _ in range(MEASURED_AT_LEAST):
        clock.record(2, False, 0.020)
        clock.record(1, False, 0.010)
    assert clock.drafted_step_cost(2) == pytest.approx(0.033 / 0.020)
    assert clock.drafted_step_cost(1) is None


def test_a_request_whose_drafts_take_more_passes_than_the_timed_ones_is_priced_for_them():
    """Where a drafted step's forwards follow its text (DraftPasses: a TriForce chain's middle rounds), the clock
    times one pass apart: a request whose recent drafted steps took more than the mean of the steps the clock timed
    pays for the extra ones, and at a yield that drafts beside that load it sits out; one that took fewer pays less;
    a drafter whose forwards are its setting's pays the median; a request joining an idle engine, before it drafts,
    the passes of the engine's recent drafted steps."""
    clock = StepClock()
    for _ in range(UNTIMED_FIRST_STEPS + MEASURED_AT_LEAST):
        clock.step_done(1, False, 0.05)
        clock.step_done(1, True, 0.30, DraftPasses(0.16, 4, 1))  # 6 plain steps, four middle rounds of 40 ms
    assert clock.drafted_step_cost(1) == pytest.approx(6.0) and clock.pass_price(1) == pytest.approx((4.0, 0.8))
    gates = {passes: DraftGate(lambda batch, context: (8.0, 1.2), clock) for passes in (9, 3, None)}
    for passes, gate in gates.items():
        assert gate.drafts(1, 100) and gate.step_cost == pytest.approx(6.0)  # nothing of its own yet: the median
        gate.observe(7, 10, passes)  # 7 of the 8 tokens predicted: r = (2 + 7 / 8) / 3, 7.67 tokens expected
    decisions = {passes: gate.drafts(1, 100) for passes, gate in gates.items()}
    assert decisions == {9: False, 3: True, None: True}
    assert {passes: gate.step_cost for passes, gate in gates.items()} == pytest.approx({9: 10.0, 3: 5.2, None: 6.0})
    recent = RecentYields()  # an idle engine's recent drafted steps: their passes price a joiner's first
    for _ in range(3):
        recent.add(1.0)
        recent.add_passes(9)
    joiner = DraftGate(lambda batch, context: (8.0, 1.2), clock)
    joiner.join(recent, None)
    assert joiner.prior == 1.0 and not joiner.drafts(1, 100) and joiner.step_cost == pytest.approx(10.0)


def test_a_request_sitting_out_is_priced_by_the_rounds_its_shadow_chains_would_take():
    """A request sitting out counts no middle rounds of its own; the rounds its trie bottom's shadow says a chain would
    take (Drafter.shadow_passes) join its own, and its drafted step's price follows them: its text turned copyable
    prices a drafted step below the median of the steps the clock timed at its start, and it drafts again."""
    clock = StepClock()
    for _ in range(UNTIMED_FIRST_STEPS + MEASURED_AT_LEAST):
        clock.step_done(1, False, 0.05)
        clock.step_done(1, True, 0.30, DraftPasses(0.16, 4, 1))  # 6 plain steps, four middle rounds of 40 ms
    gate = DraftGate(lambda batch, context: (8.0, 1.2), clock)
    assert gate.drafts(1, 100)
    for emitted in (3, 2):  # r = (2 + 3 / 8 + 2 / 8) / 4: 5.25 tokens expected of a step priced 6
        gate.observe(emitted, 10, 4)
    assert not gate.drafts(1, 100) and gate.reason == "sits out"
    for _ in range(YIELD_WINDOW):
        gate.observe_shadow_passes([1])
    assert gate.drafts(1, 100) and gate.reason == "pays"
    assert gate.step_cost == pytest.approx(6.0 - (4 - 1) * 0.8)


def test_each_kinds_first_steps_at_a_batch_size_are_not_timed():
    """A forward's first calls at new shapes are dear: the engine's first UNTIMED_FIRST_STEPS steps of each kind at a
    batch size do not price it, the later ones do."""
    clock = StepClock()
    for _ in range(UNTIMED_FIRST_STEPS):
        clock.step_done(1, True, 0.5)
        clock.step_done(1, False, 0.1)
    assert clock.wanted(1) is True and clock.drafted_step_cost(1) is None
    for _ in range(MEASURED_AT_LEAST):
        clock.step_done(1, True, 0.25)
        clock.step_done(1, False, 0.1)
        clock.step_done(2, False, 0.2)
    assert clock.drafted_step_cost(1) == pytest.approx(2.5) and not clock.seconds.get((2, False))


def test_a_kind_timed_long_ago_is_timed_afresh():
    """A load drafting nearly every step times plain steps seldom: once STALE_AFTER drafted steps have been timed since
    the last plain one, the clock wants a plain step (every request's answer), and a fresh plain step reprices."""
    clock = StepClock()
    for _ in range(UNTIMED_FIRST_STEPS + MEASURED_AT_LEAST):
        clock.step_done(8, False, 0.080)  # a slow spell
        clock.step_done(8, True, 0.085)
    assert clock.wanted(8) is None and clock.drafted_step_cost(8) == pytest.approx(0.085 / 0.080)
    for _ in range(STALE_AFTER - 1):  # with the one drafted step timed after the last plain one: STALE_AFTER
        clock.step_done(8, True, 0.075)
    assert clock.wanted(8) is None  # not stale yet
    clock.step_done(8, True, 0.075)
    assert clock.wanted(8) is False and clock.wanted(8, drafted_too=False) is False
    gate = DraftGate(lambda batch, context: (3.0, 1.5), clock)
    assert gate.drafts(8, 100) is False and gate.reason == "timing"
    for _ in range(MEASURED_STEPS):
        clock.step_done(8, False, 0.055)
    assert clock.wanted(8) is None and clock.drafted_step_cost(8) == pytest.approx(0.075 / 0.055)


def test_measured_steps_replace_the_plans_price():
    """The plan prices a drafted step at 2 plain ones (3 tokens for 1.5x); a request yielding 1.5 tokens a drafted step
    stops drafting on that price, and keeps drafting where the steps measure a drafted one at 1.2 plain ones."""
    def decisions(clock: StepClock | None) -> list[bool]:
        gate = DraftGate(lambda batch, context: (3.0, 1.5), clock)
        made = []
        for _ in range(30):
            made.append(gate.drafts(1, 100))
            gate.observe(2 if len(made) % 2 else 1, 2)
        return made

    assert not all(decisions(None))
    measured = StepClock()
    for _ in range(MEASURED_AT_LEAST):
        measured.record(1, True, 0.024)
        measured.record(1, False, 0.020)
    assert all(decisions(measured))


@pytest.mark.parametrize("concurrency", [1, 3])
def test_the_scheduler_times_its_steps_and_outputs_stay_the_requests_own(concurrency, tiny_pair):
    """Steps in which every sequence drafted or none did are timed per batch size (a step after a prompt joined is
    not), and the decisions they price leave every request's greedy tokens its own."""
    _, target, _ = tiny_pair
    make = lambda: TrieDrafter(Trie(TrieSettings(decoding_length=8, branch_length=3)))  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    requests = [Request(torch.randint(0, 250, (n,), generator=gen).tolist(), m)
                for n, m in ((9, 30), (25, 22), (14, 35), (40, 18))]
    clock = StepClock()
    engine = SpeculativeEngine(target, make(), pricing=lambda batch, context: (2.0, 1.2), clock=clock)
    results = {c.id: c.result.tokens for c in Scheduler(engine, drafters_per_slot(make), concurrency).run(requests)}
    assert clock.seconds and all(0 < s < 10 for times in clock.seconds.values() for s in times)
    assert {batch for batch, _ in clock.seconds} <= set(range(1, concurrency + 1))
    for i, request in enumerate(requests):
        assert results[i] == SpeculativeEngine(target, make()).generate(request.prompt, request.max_new_tokens,
                                                                        SamplingParams()).tokens


def test_an_untimed_batch_size_drafts_then_sits_out_until_both_kinds_are_timed():
    clock = StepClock()
    gate = DraftGate(lambda batch, context: (3.0, 1.5), clock)
    assert gate.drafts(2, 100) and clock.wanted(2) is True
    for _ in range(MEASURED_AT_LEAST):
        clock.record(2, True, 0.03)
    assert not gate.drafts(2, 100) and clock.wanted(2) is False
    for _ in range(MEASURED_AT_LEAST):
        clock.record(2, False, 0.02)
    assert clock.wanted(2) is None and gate.drafts(2, 100)  # 1.5x a plain step for 3 tokens: drafting pays
    assert clock.wanted(1) is True


@torch.inference_mode()
@pytest.mark.parametrize("sitting_out, timed_drafted", [(1, True), (3, False)])
def test_a_step_where_most_sequences_draft_is_timed_as_a_drafted_one(tiny_pair, sitting_out, timed_drafted):
    """Where a few of a step's sequences sit out, the step costs nearly what one where all draft does, and at 8 in
    flight joiners whose draft models have their prompts to read may sit out every drafted step: a step where at least
    half the sequences draft is timed as a drafted step; one where fewer do, not at all."""
    _, target, draft = tiny_pair

    class SittingOut(SequoiaDrafter):
        def drafts_now(self) -> bool:
            return False

    slots = iter(range(4))

    def make() -> SequoiaDrafter:  # the first slots' drafters never draft
        return (SittingOut if next(slots) < sitting_out else SequoiaDrafter)(draft, [-1, 0, 0])

    engine = SpeculativeEngine(target, SequoiaDrafter(draft, [-1, 0, 0]), clock=StepClock())
    list(Scheduler(engine, drafters_per_slot(make), 4).run([Request(list(range(5 + i, 30 + i)), 12) for i in range(4)]))
    assert ((4, True) in engine.clock.seconds) == timed_drafted
    assert (4, False) not in engine.clock.seconds  # every step drafted, some sequences' at least


def test_a_request_just_under_break_even_probes_often_one_far_under_seldom():
    """A drafted step measured at 6 plain ones (a TriForce chain's, over a long context), 7 tokens predicted: a request
    whose drafts yielded 0.83 of that (5.8 tokens) loses 0.2 plain steps a probe and probes every 8 steps; one whose
    drafts yielded 0.4 (2.8 tokens: 3.2 lost) every 128. Their probes' yields are not fed back here."""
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):
        clock.record(1, True, 0.120)
        clock.record(1, False, 0.020)

    def probes(ratio: float) -> int:
        gate = DraftGate(lambda batch, context: (7.0, 1.4), clock)
        gate.prior = ratio
        gate.yields.extend([ratio] * YIELD_WINDOW)
        count = 0
        for _ in range(512):
            clock.begin_step()
            count += gate.drafts(1, 7680)
        return count

    assert probe_period(6.0 - 7.0 * 0.83) == 8 and probe_period(6.0 - 7.0 * 0.4) == 128
    assert probes(0.83) == 512 // 8 and probes(0.4) == 512 // 128


def test_requests_sitting_out_probe_together():
    """With a clock, requests whose drafts fail probe at the same steps (one draft forward for the batch's probes):
    their periods are powers of two, so a request whose window still holds drafts that landed (nearer break-even,
    probing more often) probes at every step the other does; once both windows hold only misses, at the same steps,
    once per period."""
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):  # a drafted step measured at 2 plain ones at B = 2
        clock.record(2, True, 0.040)
        clock.record(2, False, 0.020)
    gates = [DraftGate(lambda batch, context: (3.0, 1.5), clock) for _ in range(2)]
    decisions: list[list[bool]] = []
    for step in range(600):
        clock.begin_step()
        decisions.append([gate.drafts(2, 100) for gate in gates])
        gates[0].observe(1, 4)
        gates[1].observe(3 if step < 13 else 1, 4)  # the second's drafts land for a while, then fail
    assert all(second for first, second in decisions[40:] if first)
    settled = decisions[300:]
    assert all(first == second for first, second in settled)
    period = probe_period(2.0 - 3.0 * shrunk_mean(1.0, [1 / 3] * YIELD_WINDOW))
    assert period == 32 and sum(first for first, _ in settled) == pytest.approx(len(settled) / period, abs=1)


def test_a_request_starts_drafting_only_where_its_drafts_can_repay_the_start():
    """Once the clock has timed a draft model's reading of a prompt, a request whose draft has yet to read its own
    starts only if drafting its remaining tokens can save more than that reading costs: drafted steps of 3 tokens at
    2 plain steps save a third of the tokens left, against 100 tokens read at a tenth of a plain step each."""
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):
        clock.record(1, True, 0.040)
        clock.record(1, False, 0.020)
    gate = DraftGate(lambda batch, context: (3.0, 1.5), clock)
    assert gate.drafts(1, 100, start_tokens=100, remaining=20)  # no start timed yet: unpriced
    clock.record_start(100, 0.2)  # 10 plain steps
    assert clock.start_cost(1, 100) == pytest.approx(10.0)
    assert not DraftGate(lambda batch, context: (3.0, 1.5), clock).drafts(1, 100, start_tokens=100, remaining=20)
    assert DraftGate(lambda batch, context: (3.0, 1.5), clock).drafts(1, 100, start_tokens=100, remaining=40)
    assert DraftGate(lambda batch, context: (3.0, 1.5), clock).drafts(1, 100, start_tokens=0, remaining=5)


def test_a_reading_is_priced_at_the_load_the_engine_recently_ran_at():
    """A request alone for a step of an engine that ran 8 sequences a few steps ago (a closed loop's level starting:
    its burst joins at the next step) prices its draft model's reading at B = 8: where the schedule drafts nothing
    there, it does not start, though drafting pays at B = 1 (unpriced reading and all); where the load is its own
    batch size, or its drafter reads nothing, the decision is the step's alone."""
    clock = StepClock()
    off_from_two = lambda batch, context: (3.0, 1.5) if batch == 1 else None  # noqa: E731
    assert DraftGate(off_from_two, clock).drafts(1, 100, start_tokens=100, remaining=60, load=1)
    gate = DraftGate(off_from_two, clock)
    assert not gate.drafts(1, 100, start_tokens=100, remaining=60, load=8) and gate.reason == "start not repaid"
    assert DraftGate(off_from_two, clock).drafts(1, 100, start_tokens=0, remaining=60, load=8)
    for _ in range(MEASURED_AT_LEAST):  # priced at B = 8 too: there a drafted step of 3 tokens costs 2.5 plain steps
        clock.record(8, True, 0.250)
        clock.record(8, False, 0.100)
    clock.record_start(100, 0.2)  # 2 plain steps at B = 8
    everywhere = lambda batch, context: (3.0, 1.5)  # noqa: E731
    assert DraftGate(everywhere, clock).drafts(1, 100, start_tokens=100, remaining=60, load=8)  # saves 10 > 2
    assert not DraftGate(everywhere, clock).drafts(1, 100, start_tokens=100, remaining=10, load=8)  # 1.7 < 2


def test_a_lone_request_after_a_batch_does_not_read_its_draft_prompt_for_one_step(tiny_pair):
    """A schedule that drafts at B = 1 only: on a fresh scheduler a lone request drafts (its draft model reads its
    prompt); after two requests ran together, the next one alone for its first steps prices the reading at B = 2,
    where nothing drafts, and reads nothing while those steps are among the last LOAD_STEPS (its output unchanged)."""
    _, target, draft = tiny_pair
    make = lambda: SequoiaDrafter(draft, [-1, 0, 1])  # noqa: E731
    prompts = [list(range(5 + k, 45 + k)) for k in range(3)]

    def scheduled() -> Scheduler:
        engine = SpeculativeEngine(target, make(), pricing=lambda batch, context: (2.5, 1.5) if batch == 1 else None,
                                   clock=StepClock())
        return Scheduler(engine, drafters_per_slot(make), 2)

    alone = next(scheduled().run([Request(prompts[2], 8)])).result
    assert alone.drafted_steps > 0
    scheduler = scheduled()
    list(scheduler.run([Request(prompt, 8) for prompt in prompts[:2]]))
    after = next(scheduler.run([Request(prompts[2], 8)])).result
    assert after.drafted_steps == 0 and after.decisions.get("start not repaid: plain", 0) > 0
    assert after.tokens == alone.tokens
    assert max(scheduler.recent_batches) == 2 and len(scheduler.recent_batches) <= batching.LOAD_STEPS


def test_the_clock_learns_what_a_draft_models_start_costs(tiny_pair):
    _, target, draft = tiny_pair
    clock = StepClock()
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, [-1, 0, 0, 1]), pricing=lambda b, c: (2.0, 1.2),
                               clock=clock)
    engine.generate(list(range(5, 45)), 12, SamplingParams())
    assert len(clock.start_rates) == 1 and clock.start_rates[0] > 0


def test_an_untimed_batch_size_is_priced_from_the_nearest_timed_one():
    """A drafted step measured at 4 plain ones at B = 2, where the plan priced 2 (3 tokens for 1.5x): at B = 3, where
    the plan prices 2.5 (3 tokens for 1.2x), the estimate is 4 x 2.5 / 2 = 5 plain steps: 3 tokens do not pay it;
    at B = 4 (3 tokens for 3x) 4 x 1 / 2 = 2: they do. Both lie within TIMED_NEAR_FACTOR of B = 2 and time nothing of
    their own. Beyond it (B = 5, priced as B = 4) a batch size times its own steps: plain only where the estimate does
    not pay (none of its steps drafted to time it), drafted first where it does; B = 1 always times its own."""
    prices = {1: (3.0, 1.5), 2: (3.0, 1.5), 3: (3.0, 1.2), 4: (3.0, 3.0), 5: (3.0, 3.0), 6: (3.0, 1.2)}
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):
        clock.record(2, True, 0.080)
        clock.record(2, False, 0.020)
    gate = DraftGate(lambda batch, context: prices[batch], clock)
    assert gate._step_cost(3, 100, 2.5) == pytest.approx(5.0)
    assert not gate.drafts(3, 100) and clock.wanted(3) is None and gate.reason == "sits out"
    assert gate._step_cost(4, 100, 1.0) == pytest.approx(2.0)  # 4 x 1 / 2: 3 tokens pay it
    assert gate.drafts(4, 100) and clock.wanted(4) is None and gate.reason == "pays"
    assert gate.drafts(5, 100) and clock.wanted(5) is True and gate.reason == "timing"
    assert not gate.drafts(6, 100) and clock.wanted(6, drafted_too=False) is False
    assert clock.wanted(1) is True


def test_a_batch_size_the_load_settles_at_times_its_own_price():
    """B = 4 borrows B = 2's measured price (5 plain steps: within TIMED_NEAR_FACTOR) while it is passed through, and
    a request yielding 0.8 of the plan's 6 tokens sits out. Once SETTLED_STEPS of its steps are timed (plain ones, all
    that a load sitting out runs) it times its own drafted steps, the request's yield coming within CANDIDATE_SPEEDUP
    of the borrowed price, and its own ratio (4 plain steps) prices the drafts from then on: they pay."""
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):
        clock.record(2, True, 0.100)
        clock.record(2, False, 0.020)
    gate = DraftGate(lambda batch, context: (6.0, 1.5), clock)
    gate.yields.extend([0.75] * YIELD_WINDOW)  # r = (2 x 1 + 8 x 0.75) / 10 = 0.8
    assert not gate.drafts(4, 100) and gate.reason == "sits out" and gate.step_cost == pytest.approx(5.0)
    for _ in range(SETTLED_STEPS - 1):
        clock.step_done(4, False, 0.025)
    assert clock.wanted(4) is None and not gate.drafts(4, 100)
    clock.step_done(4, False, 0.025)
    assert gate.drafts(4, 100) and gate.reason == "timing"
    for _ in range(UNTIMED_FIRST_STEPS + MEASURED_AT_LEAST):
        clock.step_done(4, True, 0.100)
    assert clock.wanted(4) is None
    assert gate.drafts(4, 100) and gate.reason == "pays" and gate.step_cost == pytest.approx(4.0)


def test_a_probe_counts_the_reading_its_drafter_does_first():
    """A drafted step measured at 2 plain ones: a request sitting out probes once PROBE_SHARE of its idle steps pays
    what the probe loses at its yield. A draft model that must read each step sat out (1 token a step, a tenth of a
    plain step each, at 2 in flight) costs more than that share: such a request does not probe."""
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):
        clock.record(2, True, 0.040)
        clock.record(2, False, 0.020)
    clock.record_start(10, 0.020)

    def probes(reads_idle_steps: bool) -> int:
        gate, count = DraftGate(lambda batch, context: (3.0, 1.5), clock), 0
        for _ in range(8):
            gate.yields.append(0.3)  # drafts that yield a third of the prediction: below break-even
        for _ in range(200):
            clock.begin_step()
            count += gate.drafts(2, 100, start_tokens=gate.idle_steps if reads_idle_steps else 0, remaining=500)
        return count

    loss = 2.0 - 3.0 * shrunk_mean(1.0, [0.3] * 8)
    assert probes(False) == pytest.approx(200 / probe_period(loss), abs=1)
    assert probes(True) == 0


def test_a_probe_whose_draft_reads_first_waits_for_a_reading_timed():
    """Requests sitting out probe together; where their draft models must read their prompts first and no reading is
    timed yet, none probes (a reading's cost unknown, no probe can be held to its share); once one is timed (a request
    that started drafting because its drafts pay), their probes are priced with it: here cheap enough to go ahead."""
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):
        clock.record(4, True, 0.040)
        clock.record(4, False, 0.020)

    def sitting_out() -> list[DraftGate]:
        gates = [DraftGate(lambda batch, context: (3.0, 1.5), clock) for _ in range(4)]
        for gate in gates:
            gate.yields.extend([0.3] * YIELD_WINDOW)  # below break-even
            gate.idle_steps = 1000  # long enough that a probe is due
        return gates

    clock.step = probe_period(2.0 - 3.0 * shrunk_mean(1.0, [0.3] * YIELD_WINDOW)) - 1  # probes at its multiples
    clock.begin_step()
    assert not any(gate.drafts(4, 500, start_tokens=400, remaining=50) for gate in sitting_out())
    assert all(gate.drafts(4, 500) for gate in sitting_out())  # nothing to read: due probes go ahead
    clock.record_start(400, 0.004)  # a tenth of a plain step for the 400 tokens
    assert all(gate.drafts(4, 500, start_tokens=400, remaining=50) for gate in sitting_out())


def test_a_draft_model_reads_the_steps_it_sat_out_before_drafting_timed_apart(tiny_pair):
    """A Sequoia drafter that sat steps out has their roots to read first: its start tokens count them, and it reads
    them (and its prompt, at its first drafted step) in a forward of their own, timed apart, so that the rest of the
    step is what a drafted step costs; the last root it sat out is fed with the step's root, as after any leaf."""
    _, target, draft = tiny_pair
    drafter = SequoiaDrafter(draft, [-1, 0, 0, 1])
    drafter.reset(list(range(5, 25)), 64)
    assert drafter.start_tokens() == 19
    SequoiaDrafter._read_first([drafter])
    assert drafter.start_tokens() == 0 and drafter.cache.length == 19
    assert drafter.started_reading[0] == 19 and drafter.reading_seconds > 0 and not drafter.started_now
    for root in (24, 30, 31):
        drafter.idle(root)
    assert drafter.start_tokens() == 2  # the last root sat out is what the drafted step's chain feeds
    SequoiaDrafter._read_first([drafter])
    assert drafter.started_reading[0] == 2 and drafter.cache.length == 21 and drafter.pending == [31]
    SequoiaDrafter._read_first([drafter])
    assert drafter.started_reading is None and drafter.reading_seconds == 0.0


@torch.inference_mode()
def test_a_step_whose_drafters_read_first_is_timed_less_their_reading(tiny_pair, monkeypatch):
    """At 8 in flight nearly every drafted step has some draft model catching up on steps it sat out: the clock times
    such a step less that reading. The first step of 4 requests (each draft model reading its long prompt there) is
    timed as a drafted step at 4, at less than its drafters' reading (the steps after a join timed, for this test)."""
    _, target, draft = tiny_pair
    monkeypatch.setattr(batching, "UNTIMED_AFTER_JOIN", 0)
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, [-1, 0]), pricing=lambda batch, context: (1.5, 1.2),
                               clock=StepClock())
    recorded: list[tuple[int, bool, float]] = []
    record = engine.clock.record
    engine.clock.record = lambda *step: (recorded.append(step), record(*step))
    reads: list[float] = []
    propose_many = SequoiaDrafter.propose_many

    def noting_reads(drafters, *args):
        trees = propose_many(drafters, *args)
        reads.append(sum(drafter.reading_seconds for drafter in drafters))
        return trees

    monkeypatch.setattr(SequoiaDrafter, "propose_many", staticmethod(noting_reads))
    scheduler = Scheduler(engine, drafters_per_slot(lambda: SequoiaDrafter(draft, [-1, 0])), concurrency=4)
    scheduler.recent_yields.add(1.0)  # a drafted step of the load before: the four draft their first step together
    list(scheduler.run([Request([5 + (i * 7 + j) % 90 for j in range(400)], 8) for i in range(4)]))
    assert recorded[0][:2] == (4, True)
    assert 0 < recorded[0][2] < reads[0]


def test_a_shadowed_request_never_probes_and_resumes_when_its_shadow_drafts_pay():
    """A drafter whose drafts cost no forward (a trie) drafts in the shadow of the steps its request sits out: the
    request stops where its drafts fail, never probes, and drafts again as soon as its shadow drafts would pay."""
    gate = DraftGate(lambda batch, context: (3.0, 1.5), shadowed=True)
    decisions = []
    for _ in range(6):
        decisions.append(gate.drafts(1, 100))
        gate.observe(1, 4)
    assert not decisions[-1]
    for _ in range(100):  # the text stays unpredictable: shadow drafts emit 1
        assert not gate.drafts(1, 100)
        gate.observe(1, 0)
        gate.observe_shadow(1)
    resumed = None
    for step in range(20):  # then predictable: 4 tokens a drafted step
        if gate.drafts(1, 100):
            resumed = step
            break
        gate.observe(1, 0)
        gate.observe_shadow(4)
    assert resumed is not None and resumed <= 4


def _walk(tree, text: list[int]) -> int | None:
    """What a drafted step of `tree` emits where the text after its root is `text` (the greedy walk); None where the
    text ends before the walk does."""
    node, matched = 0, 0
    for token in text:
        child = next((i for i, p in enumerate(tree.parents) if p == node and tree.tokens[i] == token), None)
        if child is None:
            return matched + 1
        node, matched = child, matched + 1
        if node not in tree.parents:
            return matched + 1
    return None


def test_a_tries_shadow_drafts_settle_to_what_drafting_would_have_emitted():
    """Sitting out every step of a text, a trie drafter's shadow drafts settle to exactly what a drafted step would
    have emitted at each of those steps (a twin drafter fed the same text drafts there for real), and each step
    without a match is one unmatched shadow of one token."""
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3]
    text = [4, 5, 1, 2, 3, 4, 6, 7, 1, 2, 3, 4, 5, 9, 1, 2, 8, 1, 2, 3, 4, 6, 7, 1, 2, 3, 4, 5, 0, 0]
    settings = TrieSettings(decoding_length=6, branch_length=3)

    def fed(steps: int) -> TrieDrafter:
        drafter = TrieDrafter(Trie(settings))
        drafter.reset(prompt, 128)
        root = prompt[-1]
        for token in text[:steps]:
            drafter.update(drafter.idle(root), [0], token)
            root = token
        return drafter

    shadowed, settled, unmatched = TrieDrafter(Trie(settings)), [], []
    shadowed.reset(prompt, 128)
    root = prompt[-1]
    for token in text:
        shadowed.update(shadowed.idle(root), [0], token)
        for shadow in shadowed.shadow_yields():
            (settled if shadow.matched else unmatched).append(shadow.emitted)
        root = token
    expected, without_match = [], 0
    for step in range(len(text)):
        twin = fed(step)
        tree = twin.propose(prompt[-1] if step == 0 else text[step - 1], SamplingParams(), "deterministic", None)
        without_match += tree.size == 1
        emitted = _walk(tree, text[step:]) if tree.size > 1 else None
        if emitted is not None:
            expected.append(emitted)
    assert len(expected) > 10 and max(expected) > 2
    assert sorted(settled) == sorted(expected)
    assert without_match > 0 and unmatched == [1] * without_match


def test_a_shadow_step_without_a_match_counts_as_a_drafted_one_would():
    """A trie without a match scores its root alone: at one sequence such a step is a plain one and does not count,
    beside others it rides the batch's drafted step and counts as its one token (`observe`). Its shadow counts the
    same way: a plan's tokens per step count such steps, and a mean over matched shadows alone overstated r."""
    for batch, counts in ((1, False), (4, True)):
        sitting_out = DraftGate(lambda batch, context: (2.0, 1.2), shadowed=True)
        sitting_out.drafts(batch, 100)
        sitting_out.observe_shadow(1, matched=False)
        drafting = DraftGate(lambda batch, context: (2.0, 1.2), shadowed=True)
        assert drafting.drafts(batch, 100)
        drafting.observe(1, 0)
        assert list(sitting_out.yields) == list(drafting.yields) == ([0.5] if counts else [])


def _decided(yields: list[float], start_tokens: int = 0) -> DraftGate:
    """A gate priced at 3 tokens for 1.5x (a drafted step costs 2 plain ones), its request's drafts having yielded
    `yields` of that, having decided the coming step of 4 sequences."""
    gate = DraftGate(lambda batch, context: (3.0, 1.5))
    gate.yields.extend(yields)
    gate.drafts(4, 100, start_tokens=start_tokens)
    return gate


def test_a_steps_requests_draft_all_or_none_by_their_mean_yield():
    """Two requests whose drafts pay (expected 2.4 and 3 tokens for a 2-plain-step price) and two whose drafts do not
    (1.2, 1.5): the mean expected, 2.0, pays, so all four draft; with the last at 0.3 (mean 1.8), none does. A request
    whose drafter would read tokens first is not made to draft."""
    paying = [_decided([0.8] * 8), _decided([1.0] * 8), _decided([0.4] * 8), _decided([0.5] * 8)]
    assert [g.drafting for g in paying] == [True, True, False, False]
    settle_step(paying)
    assert all(g.drafting for g in paying) and all(g.idle_steps == 0 for g in paying)
    losing = [_decided([0.8] * 8), _decided([1.0] * 8), _decided([0.4] * 8), _decided([0.1] * 8)]
    settle_step(losing)
    assert not any(g.drafting for g in losing) and [g.idle_steps for g in losing] == [1, 1, 2, 2]
    reading = [_decided([1.0] * 8), _decided([1.0] * 8), _decided([0.5] * 8, start_tokens=40)]
    settle_step(reading)
    assert [g.drafting for g in reading] == [True, True, False]


def test_firm_decisions_are_not_made_one_kind():
    """A probe (a request sitting out drafts once to see its yield again) and a step timing the clock stand."""
    probing = DraftGate(lambda batch, context: (3.0, 1.5))
    probing.yields.extend([0.3] * 8)
    probing.idle_steps = 1000  # long enough sitting out that a probe is due
    assert probing.drafts(4, 100) and probing.firm
    gates = [probing, _decided([0.3] * 8), _decided([0.3] * 8)]
    settle_step(gates)
    assert [g.drafting for g in gates] == [True, False, False]


# A TriForce step at B = 8 over long contexts as a served step log timed it: a drafted step 6.25 plain steps, a lone
# chain beside 7 plain sequences 1.1 plain steps more than a plain step, a fifth of what all eight chains add (its
# middle rounds at B = 1); drafting alone costs the batch 8.4 of its requests' plain steps, where all eight chains cost
# each request 5.25. What k of the 8 drafting add, as shares of that, at k = 0, 1, 2, 4, 8
CHAIN_MIX = ([0, 1, 2, 4, 8], [0.0, 0.2, 0.3, 0.5, 1.0])


def _gates_at_8(yields: list[list[float]], mix: tuple[list[int], list[float]] | None) -> list[DraftGate]:
    """Gates priced at 9.5 tokens for a drafted step of 6.25 plain steps at B = 8, their requests' drafts having
    yielded `yields`; what k of the 8 drafting add to a step, `mix` (None: the plan priced no mix)."""
    gates = []
    for own in yields:
        gate = DraftGate(lambda batch, context: (9.5, 9.5 / 6.25), mix_share=(
            None if mix is None else lambda batch, drafting, context: float(np.interp(drafting, *mix))))
        gate.yields.extend(own)
        gate.drafts(8, 100)
        gates.append(gate)
    return gates


def test_requests_ride_a_probes_step_where_they_gain_what_they_add_else_a_step_drafts_all_or_none():
    """At B = 8, a drafted step priced 6.25 plain steps. Beside a probe (firm), each of the next two drafters adds
    8 x 5.25 x 0.1 = 4.2 of the batch's plain steps: a request expecting 7.6 tokens gains 6.6 and one sitting out at
    5.5 gains 4.5, so both draft; those expecting 3.4 would gain 2.4 and sit out. Where the plan priced no mix, each
    request's own decision stands. Without a probe, a request expecting 13.3 among seven at 3.4 (mean 4.65) does not
    draft alone, whatever it would gain: the batch's mean settles the step."""
    for mix, near_rides in ((CHAIN_MIX, True), (None, False)):
        probe, paying, near, *sitting = _gates_at_8([[0.1] * 8, [0.75] * 8, [0.475] * 8] + [[0.2] * 8] * 5, mix)
        probe.idle_steps = 10_000
        assert probe.drafts(8, 100) and probe.reason == "probe" and probe.firm
        assert paying.reason == "pays" and near.reason == "sits out" and near.expected == pytest.approx(5.51)
        settle_step([probe, paying, near, *sitting])
        assert probe.drafting and paying.drafting and near.drafting == near_rides
        assert not any(g.drafting for g in sitting)
    strong, *rest = _gates_at_8([[1.5] * 8] + [[0.2] * 8] * 7, CHAIN_MIX)
    assert strong.reason == "pays" and strong.expected == pytest.approx(13.3)
    settle_step([strong, *rest])
    assert not strong.drafting and strong.reason == "batch"


def test_a_probe_is_priced_as_a_lone_drafter_where_the_plan_priced_its_mix():
    """A request sitting out at B = 8 expecting 5.7 tokens of a drafted step priced 6.25 plain steps: as a share of
    the batch's drafted step its probe loses 0.55 plain steps and is due after 18 steps sat out; alone beside seven
    plain sequences it loses 8.4 - 4.7 = 3.7 and waits 122."""
    for mix, due in ((None, 18), (CHAIN_MIX, 122)):
        for idle, probes in ((due - 2, False), (due + 1, True)):
            gate = _gates_at_8([[0.5] * 8], mix)[0]
            gate.idle_steps = idle
            assert gate.drafts(8, 100) == probes and gate.reason == ("probe" if probes else "sits out")


def _step_kinds_keeping_greedy_tokens(tiny_pair, concurrency: int) -> list[set[bool]]:
    """Lookahead requests at `concurrency` in flight, at a price some of their drafts pay: each step's drafting
    decisions (of steps with more than one sequence), each request's greedy tokens checked to be its own."""
    _, target, _ = tiny_pair
    make = lambda: TrieDrafter(Trie(TrieSettings(decoding_length=6, branch_length=3)))  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    motif = torch.randint(0, 250, (6,), generator=gen).tolist()
    requests = [Request(motif * 3 + torch.randint(0, 250, (n,), generator=gen).tolist(), m)
                for n, m in ((7, 30), (3, 25), (12, 33), (5, 18))]
    engine = SpeculativeEngine(target, make(), pricing=lambda batch, context: (1.6, 1.2))
    kinds = []
    step = Scheduler.step

    def recorded(scheduler):
        done = step(scheduler)
        if len(scheduler.running) > 1:
            kinds.append({run.run.drafter.drafting for run in scheduler.running})
        return done

    Scheduler.step = recorded
    try:
        results = {c.id: c.result.tokens for c in Scheduler(engine, drafters_per_slot(make), concurrency).run(requests)}
    finally:
        Scheduler.step = step
    for i, request in enumerate(requests):
        assert results[i] == SpeculativeEngine(target, make()).generate(request.prompt, request.max_new_tokens,
                                                                        SamplingParams()).tokens
    return kinds


@pytest.mark.parametrize("concurrency", [2, 4])
def test_steps_where_some_requests_draft_keep_every_requests_greedy_tokens(concurrency, tiny_pair, monkeypatch):
    """Every other request made to sit each step out (as a probe's step with riders leaves them): each request's
    greedy tokens its own."""
    from specplan.decoder import engine as engine_module

    def alternate(gates: list[DraftGate]) -> None:
        for index, gate in enumerate(gates):
            gate.overrule(index % 2 == 0)

    monkeypatch.setattr(engine_module, "settle_step", alternate)
    assert any(len(kind) == 2 for kind in _step_kinds_keeping_greedy_tokens(tiny_pair, concurrency))


@pytest.mark.parametrize("concurrency", [2, 4])
def test_steps_settled_by_the_mean_keep_every_requests_greedy_tokens(concurrency, tiny_pair, monkeypatch):
    """Where the requests' decisions differ, the batch's steps drafted by all or none (but the first, where one drafts
    for a burst joining a fresh engine); each request's greedy tokens its own."""
    from specplan.decoder import engine as engine_module

    mixed = []

    def resolved(gates):
        mixed.append(len({gate.drafting for gate in gates}) > 1)
        settle_step(gates)

    monkeypatch.setattr(engine_module, "settle_step", resolved)
    kinds = _step_kinds_keeping_greedy_tokens(tiny_pair, concurrency)
    assert kinds and all(len(kind) == 1 for kind in kinds[1:]) and any(mixed)


def test_a_drafted_step_is_timed_though_one_trie_has_no_match(tiny_pair):
    """At 4 in flight, every request choosing to draft: a step is a drafted one for the clock when some trees hold
    draft tokens, though a request whose text the trie cannot match drafts nothing (were such steps not timed, a batch
    size where one request always misses would time no drafted step, and the clock, wanting one, would draft there
    forever)."""
    _, target, _ = tiny_pair
    make = lambda: TrieDrafter(Trie(TrieSettings(decoding_length=6, branch_length=3)))  # noqa: E731
    gen = torch.Generator().manual_seed(7)
    motif = torch.randint(0, 250, (5,), generator=gen).tolist()
    requests = [Request(motif * 4, 24), Request(motif * 4, 24), Request(motif * 4, 24), Request([3], 24)]
    clock = StepClock()
    engine = SpeculativeEngine(target, make(), pricing=lambda batch, context: (1.2, 1.0), clock=clock)
    list(Scheduler(engine, drafters_per_slot(make), 4).run(requests))
    assert len(clock.seconds.get((4, True), ())) >= MEASURED_AT_LEAST


def test_a_step_whose_drafter_cannot_draft_yet_leaves_the_requests_yield_alone(tiny_pair):
    """A TriForce sequence's first step is plain whatever its decision (its forward gives the query of the first
    build): beside another sequence it is not a drafted step without a draft, whose one token would count against
    the request's yield (it did: a third of the price, every request of a C = 4 load then sitting out for ~50 steps)."""
    from specplan.core.method_settings import RetrievalSettings
    from specplan.decoder.triforce import HierarchicalDrafter, bottom_trie_settings

    from toy import long_prompt

    _, target, _ = tiny_pair

    def make():
        return HierarchicalDrafter(target, TrieDrafter(Trie(bottom_trie_settings(2))), 2, 4,
                                   RetrievalSettings(256, 8, 16))

    engine = SpeculativeEngine(target, make(), pricing=lambda batch, context: (3.0, 1.5))
    scheduler = Scheduler(engine, drafters_per_slot(make), 2)
    scheduler.recent_yields.add(1.0)  # a drafted step of the load before: both draft once ready
    for i in range(2):
        scheduler.submit(Request(long_prompt(300 + 30 * i, i), 12))
    scheduler.step()
    runs = [entry.run for entry in scheduler.running]
    assert len(runs) == 2 and all(run.tree.size == 1 for run in runs)
    assert all(not run.gate.yields and run.decisions == {"not ready: plain": 1} for run in runs)
    scheduler.step()
    assert all(run.tree.size > 1 and len(run.gate.yields) == 1 for run in runs)


def test_a_request_whose_drafts_miss_does_not_draft_to_time_the_clock():
    """Nothing timed yet at B = 8: a request at the plan's yield drafts to time the drafted step; one whose drafts
    emitted a third of the plan's tokens expects less than the planned price (3 tokens for 1.5x: 2 plain steps) and
    times plain steps instead. In one step their answers differ and neither is firm: the batch's mean settles it."""
    clock = StepClock()
    fresh, missing = (DraftGate(lambda batch, context: (3.0, 1.5), clock) for _ in range(2))
    for _ in range(6):
        missing.drafts(8, 100)
        missing.observe(1, 4)
    assert fresh.drafts(8, 100) and not fresh.firm
    assert not missing.drafts(8, 100) and not missing.firm and clock.wanted(8, drafted_too=False) is False
    settle_step([fresh, missing])  # mean expected (3 + 1.5) / 2 >= 2
    assert fresh.drafting and missing.drafting


def test_a_request_run_past_its_stop_tokens_times_the_drafted_steps_its_clock_wants_whatever_it_yields():
    """Nothing timed at B = 8: a request whose text is the load's and whose drafts emitted a tenth of the plan's tokens
    times plain steps; one run past its stop tokens (a warm-up's: its text no evidence of the load's) drafts to time
    the drafted step the load will be priced at, and the step's mean does not overrule it. Once the drafted steps
    are timed, it times plain ones as any request would, and then decides by its yield."""
    clock = StepClock()
    recent = RecentYields()
    load, past_stop = (DraftGate(lambda batch, context: (3.0, 1.5), clock) for _ in range(2))
    load.join(recent, None)
    past_stop.join(recent, None, adds_to_recent=False)
    for gate in (load, past_stop):
        gate.yields.extend([0.1] * YIELD_WINDOW)
    assert not load.drafts(8, 100) and load.reason == "timing"
    assert past_stop.drafts(8, 100) and past_stop.reason == "timing" and past_stop.firm
    settle_step([load, past_stop])
    assert past_stop.drafting and not load.drafting
    for _ in range(MEASURED_AT_LEAST):
        clock.record(8, True, 0.020)
    assert not past_stop.drafts(8, 100) and past_stop.reason == "timing" and not past_stop.firm
    for _ in range(MEASURED_AT_LEAST):
        clock.record(8, False, 0.010)
    assert not past_stop.drafts(8, 100) and past_stop.reason == "sits out"


def test_a_batch_within_the_timing_band_drafts_the_step_its_clock_wants():
    """Plain steps timed at B = 4, drafted ones not (3 tokens for 1.5x: 2 plain steps): a request whose yield comes
    within CANDIDATE_SPEEDUP of paying drafts to time one, one below sits out, and neither is firm. Their mean (1.86
    tokens) pays no drafted step but lies within the band: the step drafts, or the clock, wanting one, never times
    it; a mean below the band (1.44) does not."""
    for sitting_out, drafts in ((0.45, True), (0.1, False)):
        clock = StepClock()
        for _ in range(MEASURED_AT_LEAST):
            clock.record(4, False, 0.010)
        timing, low = (DraftGate(lambda batch, context: (3.0, 1.5), clock) for _ in range(2))
        timing.yields.extend([0.6] * 8)
        low.yields.extend([sitting_out] * 8)
        assert timing.drafts(4, 100) and timing.reason == "timing" and not timing.firm
        assert not low.drafts(4, 100) and low.reason == "sits out" and not low.firm
        mean = (timing.expected + low.expected) / 2
        assert mean < 2.0 and (mean >= CANDIDATE_SPEEDUP * 2.0) == drafts
        settle_step([timing, low])
        assert timing.drafting == drafts and low.drafting == drafts


def test_a_setting_priced_just_below_break_even_is_timed_and_drafted_where_measured_to_pay():
    """An off entry's candidate (2 tokens for 0.95x: 2.1 plain steps) within CANDIDATE_SPEEDUP of paying: a fresh
    request drafts to time it, then drafts on where the steps measure a drafted one at 1.2 plain ones and sits out
    where at 2.4; one priced far below (0.8x) times plain steps only."""
    for measured, drafts in ((1.2, True), (2.4, False)):
        clock = StepClock()
        gate = DraftGate(lambda batch, context: (2.0, 0.95), clock, shadowed=True)
        assert gate.drafts(1, 100) and gate.reason == "timing"
        for _ in range(MEASURED_AT_LEAST):
            clock.record(1, True, 0.010 * measured)
            clock.record(1, False, 0.010)
        assert gate.drafts(1, 100) == drafts and gate.reason == ("pays" if drafts else "sits out")
    far = DraftGate(lambda batch, context: (2.0, 0.8), StepClock(), shadowed=True)
    assert not far.drafts(1, 100) and far.clock.wanted(1, drafted_too=False) is False
    assert 0.8 < CANDIDATE_SPEEDUP < 0.95


def test_a_request_joining_a_batch_takes_its_yield_as_prior_and_one_joining_an_idle_engine_the_engines(tiny_pair,
                                                                                                        monkeypatch):
    """At 2 in flight, a third request joins when the short second one ends: its prior is the mean r of the last
    step's requests (the load in flight), not the plan's; once the engine is idle, the next request's prior is the
    engine's recent drafted steps'. Every request's tokens stay its own."""
    _, target, _ = tiny_pair
    make = lambda: TrieDrafter(Trie(TrieSettings(decoding_length=6, branch_length=3)))  # noqa: E731
    gen = torch.Generator().manual_seed(7)
    motif = torch.randint(0, 250, (5,), generator=gen).tolist()
    engine = SpeculativeEngine(target, make(), pricing=lambda batch, context: (2.5, 1.2))
    runs, priors_on_admission = [], []
    start = engine.start
    monkeypatch.setattr(engine, "start", lambda *args, **kwargs: runs.append(start(*args, **kwargs)) or runs[-1])
    scheduler = Scheduler(engine, drafters_per_slot(make), 2)
    admit = scheduler._admit

    def admit_noting_the_batch_yield():
        if scheduler.waiting and scheduler.free_slots:
            priors_on_admission.append(scheduler.batch_yield)
        return admit()

    monkeypatch.setattr(scheduler, "_admit", admit_noting_the_batch_yield)
    requests = [Request(motif * 4, 30), Request(motif * 3, 6), Request(motif * 2 + [9], 12)]
    results = {c.id: c.result.tokens for c in scheduler.run(requests)}
    assert priors_on_admission[0] is None and runs[0].gate.prior == runs[1].gate.prior == 1.0
    joined = priors_on_admission[1]
    assert joined is not None and joined != 1.0 and runs[2].gate.prior == joined
    assert scheduler.batch_yield is None
    recent = [ratio for _, ratio in scheduler.recent_yields.yields]
    assert len(recent) == YIELD_WINDOW
    results[3] = next(iter(scheduler.run([Request(motif * 4, 8)]))).result.tokens
    assert runs[3].gate.prior == pytest.approx((2 + sum(recent)) / (2 + YIELD_WINDOW)) != 1.0
    for i, request in enumerate(requests + [Request(motif * 4, 8)]):
        assert results[i] == SpeculativeEngine(target, make()).generate(request.prompt, request.max_new_tokens,
                                                                        SamplingParams()).tokens


def test_a_request_run_past_its_stop_token_keeps_its_drafted_steps_out_of_the_engines_recent_yields(tiny_pair,
                                                                                                     monkeypatch):
    """`ignore_eos` (the serving bench's warm-up, on reversed prompts) runs a request on past its stop token into text
    no request has, which a trie drafts well (it repeats itself): none of its drafted steps enter the prior of the
    requests joining the engine next, while it takes that prior as any request does. Its tokens are its own."""
    _, target, _ = tiny_pair
    make = lambda: TrieDrafter(Trie(TrieSettings(decoding_length=6, branch_length=3)))  # noqa: E731
    motif = torch.randint(0, 250, (5,), generator=torch.Generator().manual_seed(7)).tolist()
    prompt = motif * 4
    plain = SpeculativeEngine(target, make()).generate(prompt, 40, SamplingParams()).tokens
    stop = plain[6]
    engine = SpeculativeEngine(target, make(), stop_ids={stop}, pricing=lambda batch, context: (2.5, 1.2))
    runs = []
    start = engine.start
    monkeypatch.setattr(engine, "start", lambda *args, **kwargs: runs.append(start(*args, **kwargs)) or runs[-1])
    scheduler = Scheduler(engine, drafters_per_slot(make), 1)
    scheduler.recent_yields.add(0.5)
    result = next(iter(scheduler.run([Request(prompt, 40, ignore_eos=True)]))).result
    assert result.tokens == plain and result.stop_reason == "length"
    assert runs[0].gate.prior == pytest.approx((2 + 0.5) / 3)
    assert any(runs[0].drafted_per_step) and list(scheduler.recent_yields.yields) == [(0, 0.5)]
    after = next(iter(scheduler.run([Request(prompt, 40)]))).result
    assert after.tokens == plain[:plain.index(stop) + 1] and len(scheduler.recent_yields.yields) > 1
