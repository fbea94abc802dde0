"""A TriForce chain's length chosen per step (decoder/chain_length.py): what a chain's prefixes would have emitted, the
choice among the lengths a schedule prices, its refreshing the longest, the clock's prices, and greedy identity."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from specplan.core.errors import UserError
from specplan.core.method_settings import RetrievalSettings, TriForceSettings
from specplan.core.plan_schema import (
    BatchSchedule,
    ChainLength,
    Plan,
    PlanModels,
    Prediction,
    ScheduleEntry,
    load_plan,
    save_plan,
)
from specplan.decoder.batching import Request, Scheduler
from specplan.decoder.chain_length import LENGTH_PRIOR, LENGTH_PROBE_SHARE, LENGTH_WINDOW, ChainLengths
from specplan.decoder.drafters import TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.gate import MEASURED_AT_LEAST, UNTIMED_FIRST_STEPS, DraftGate, StepClock
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.trie import Trie
from specplan.decoder.triforce import HierarchicalDrafter, bottom_trie_settings
from specplan.show import describe_schedule

from toy import drafters_per_slot, long_prompt

# gamma2 4 and 5 (5 and 6 nodes) as the shipped cpu-2c plan prices them at 16 sequences: the longer chain is the
# better on the traces (6.34 x 1.171 / 6.34 against 5.69 x 1.125 / 5.69 tokens per plain step's time)
SHORTER = ChainLength(5, 5.69, (1.1245,))
LONGER = ChainLength(6, 6.34, (1.1708,))


def test_the_longest_chain_is_kept_until_its_last_positions_stop_paying():
    chains = ChainLengths()
    chains.begin_step()
    assert chains.choose((SHORTER, LONGER), 16, 6) is LONGER  # the traces' prior alone: the schedule's length
    assert chains.choose((SHORTER, LONGER), 16, 5) is SHORTER  # never longer than the entry's
    assert chains.choose((SHORTER,), 16, 6) is None  # the entry's length unpriced: the entry holds
    for _ in range(LENGTH_WINDOW):  # the load of the cpu-2c runs: 5.50 tokens a step at gamma2 5, 5.40 at 4
        chains.observe({5: 5, 6: 5})
        chains.observe({5: 6, 6: 6})
        chains.observe({5: 5, 6: 6} if len(chains.yields[6]) % 10 < 2 else {5: 5, 6: 5})
    longer_gain = chains.mean_yield(LONGER) * 1.1708 / 6.34
    shorter_gain = chains.mean_yield(SHORTER) * 1.1245 / 5.69
    assert shorter_gain > longer_gain
    period = 1 << math.ceil(math.log2((1.0 - longer_gain / shorter_gain) / LENGTH_PROBE_SHARE))
    choices = {}
    for _ in range(4 * period):
        chains.begin_step()
        choices[chains.step] = chains.choose((SHORTER, LONGER), 16, 6).decoding_length
    # the longer one refreshed at the steps numbered a multiple of its period, within LENGTH_PROBE_SHARE of the time
    assert [step for step, nodes in choices.items() if nodes == 6] == [period * k for k in range(1, 5)]
    assert (1.0 - longer_gain / shorter_gain) / period <= LENGTH_PROBE_SHARE
    for _ in range(LENGTH_WINDOW):  # chains that land to their end again: the longest pays once more
        chains.observe({5: 6, 6: 7})
    chains.begin_step()
    assert chains.choose((SHORTER, LONGER), 16, 6) is LONGER
    assert chains.mean_yield(LONGER) == pytest.approx((LENGTH_PRIOR * 6.34 + 7 * LENGTH_WINDOW)
                                                      / (LENGTH_PRIOR + LENGTH_WINDOW))


def test_a_length_whose_steps_cost_more_than_its_price_is_left_once_timed(tiny_pair):
    """The shorter chain wins on the plan's prices; timed at 1.2 times its price (the longer at its own), it loses.
    The engine feeds the timing: a drafted step's seconds over the clock's plain step at that batch size."""
    _, target, _ = tiny_pair
    chains = ChainLengths()
    for _ in range(LENGTH_WINDOW):
        chains.observe({5: 5, 6: 5})
    chains.begin_step()
    assert chains.choose((SHORTER, LONGER), 16, 6) is SHORTER
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):
        clock.record(16, False, 0.1)
    engine = SpeculativeEngine(target, clock=clock, chains=chains)
    shorter_price, longer_price = 5.69 / 1.1245, 6.34 / 1.1708
    for _ in range(UNTIMED_FIRST_STEPS + MEASURED_AT_LEAST):
        engine.step_timed(16, True, 0.1 * 1.2 * shorter_price, 1.0, SHORTER)
        engine.step_timed(16, True, 0.1 * longer_price, 1.0, LONGER)
    assert chains.price_error(5) == pytest.approx(1.2) and chains.price_error(6) == pytest.approx(1.0)
    assert chains.price_error(4) == pytest.approx(1.2)  # untimed: the nearest length's
    chains.begin_step()
    assert chains.choose((SHORTER, LONGER), 16, 6) is LONGER


@torch.inference_mode()
def _drafted_step(target, prompt: list[int], nodes: int) -> tuple[int, dict[int, int]]:
    """A fresh hierarchy's first drafted step (its sequence's second: the first is plain) at `nodes` per chain: the
    tokens it emitted and its prefix yields."""
    drafter = HierarchicalDrafter(target, TrieDrafter(Trie(bottom_trie_settings(2))), 2, 5,
                                  RetrievalSettings(256, 8, 16))
    drafter.draft_nodes(nodes)
    run = SpeculativeEngine(target, drafter).start(prompt, 8, SamplingParams(), 0)
    for _ in range(2):
        run.decide(1)
        run.advance(target.forward(*run.propose()))
    return run.accepted_per_step[1], drafter.prefix_yields()


def test_a_chains_prefix_yields_are_what_each_shorter_setting_emits(tiny_pair):
    """At T = 0 a shorter setting's chain is the drafted one's prefix to a round's end, so what it would have emitted
    is read off exactly: each shorter setting run from the same state emits just that."""
    _, target, _ = tiny_pair
    landed = 0
    for seed in range(4):
        prompt = long_prompt(300, seed)
        emitted, prefixes = _drafted_step(target, prompt, 6)
        assert sorted(prefixes) == [2, 3, 4, 5, 6] and prefixes[6] == emitted
        for nodes in range(2, 6):
            assert _drafted_step(target, prompt, nodes)[0] == prefixes[nodes], (seed, nodes)
        landed += emitted > 2
    assert landed  # some chain landed beyond its first draft: the prefixes differ
    assert HierarchicalDrafter(target, TrieDrafter(Trie(bottom_trie_settings(2))), 2, 5,
                               RetrievalSettings(256, 8, 16)).prefix_yields() == {}


def test_every_request_keeps_its_greedy_tokens_whatever_length_each_step_chooses(tiny_pair, monkeypatch):
    """The engine chooses each step's chain length among the priced ones (a random model's chains land seldom, so the
    shorter ones win, and the longest is refreshed): several lengths drafted, and each request's greedy tokens equal
    its one-request tokens at every concurrency."""
    _, target, _ = tiny_pair
    lengths = tuple(ChainLength(n, 1.0 + 0.6 * (n - 1), (1.2, 1.15, 1.1)) for n in range(2, 6))
    schedule = BatchSchedule(None, (ScheduleEntry(1, 3, True, 5, 3.4, 10.0, 1.1, speedups=(1.2, 1.15, 1.1)),),
                             chain_lengths=lengths)

    def make():
        return HierarchicalDrafter(target, TrieDrafter(Trie(bottom_trie_settings(2))), 2, 4,
                                   RetrievalSettings(256, 8, 16))

    requests = [Request(long_prompt(300 + 30 * i, i), 24 + 4 * i) for i in range(4)]
    alone = [SpeculativeEngine(target, make()).generate(r.prompt, r.max_new_tokens, SamplingParams()).tokens
             for r in requests]
    drafted = []
    propose_many = HierarchicalDrafter.propose_many

    def recorded(drafters, *args):
        drafted.extend(d.gamma2 for d in drafters)
        return propose_many(drafters, *args)

    monkeypatch.setattr(HierarchicalDrafter, "propose_many", staticmethod(recorded))
    for concurrency in (1, 3):
        engine = SpeculativeEngine(target, make(), schedule=schedule, chains=ChainLengths())
        results = {c.id: c.result.tokens for c in Scheduler(engine, drafters_per_slot(make), concurrency).run(requests)}
        assert [results[i] for i in range(len(requests))] == alone, concurrency
        assert engine.chains.yields[2]
    assert len(set(drafted)) >= 2 and 4 in drafted


def test_a_chosen_length_is_priced_against_the_clocks_timing_of_the_plans_setting():
    """The clock times drafted steps as of the plan's setting (a step of another length scaled by their prices), so a
    chosen length's step costs the measured price times its own price over the setting's."""
    clock = StepClock()
    for _ in range(MEASURED_AT_LEAST):
        clock.record(4, True, 0.30)
        clock.record(4, False, 0.10)
    gate = DraftGate(lambda batch, context: (6.0, 1.5), clock)  # the setting: 4 plain steps' price
    gate.drafts(4, 100)
    assert gate.step_cost == pytest.approx(3.0)
    gate.drafts(4, 100, price=(4.0, 1.6))  # a shorter chain: 2.5 plain steps on the plan's prices
    assert gate.step_cost == pytest.approx(3.0 * 2.5 / 4.0)


def _triforce_plan(lengths: tuple[ChainLength, ...]) -> Plan:
    schedule = BatchSchedule(100, (ScheduleEntry(1, 2, True, 3, 2.0, 10.0, 1.2, speedups=(1.2, 1.1)),),
                             chain_lengths=lengths)
    return Plan("triforce", PlanModels(target="tiny-random-llama"), Prediction(2.0, 1.2),
                settings=TriForceSettings(1, 2, 256, 8, 64, 4096, "trie"), schedule=schedule)


def test_a_schedules_chain_lengths_round_trip_and_bad_ones_fail_in_one_line(tmp_path):
    plan = _triforce_plan((ChainLength(2, 1.5, (1.1, 1.0)), ChainLength(3, 2.0, (1.2, 1.1))))
    save_plan(plan, tmp_path / "plan.yaml")
    assert load_plan(tmp_path / "plan.yaml").schedule == plan.schedule
    assert "chain length chosen up to the entry's among gamma2=1, gamma2=2," in describe_schedule(plan.schedule,
                                                                                                 "triforce")
    document = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    for change, message in [(lambda d: d["schedule"]["chain_lengths"][1].update(decoding_length=4),
                             "chain length exceeds the plan's 3"),
                            (lambda d: d["schedule"]["chain_lengths"][0].update(speedups=[]), "non-empty list"),
                            (lambda d: d["schedule"].update(chain_lengths={"a": 1}), "must be a list")]:
        broken = yaml.safe_load(yaml.safe_dump(document))
        change(broken)
        with pytest.raises(UserError, match=message):
            Plan.from_dict(broken, "plan.yaml")
    lookahead = yaml.safe_load(open("plans/smollm2-135m.lookahead.cpu-2c-amx.fp32.batched.yaml"))
    lookahead["schedule"]["chain_lengths"] = document["schedule"]["chain_lengths"]
    with pytest.raises(UserError, match="'chain_lengths' are a TriForce schedule's"):
        Plan.from_dict(lookahead, "plan.yaml")
