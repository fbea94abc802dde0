"""Would sharing a step's draft rows among the requests by their own yields beat the static schedule? (issue 51,
Deliver 3, priced before it is built into the decoder)

A Lookahead plan's schedule gives every sequence of a step of B the same decoding length (off, on this host's plans,
from B = 2). Its trie drafts cost no forward, so at every step each request can tell what a draft of any length would
have emitted (the shadow drafts of decoder/gate.py): a request copying its prompt lands long drafts, one writing new
text lands none. This replay runs C closed-loop clients over greedy outputs (an acceptance file's: the target's own
text, so every policy emits the same tokens) as the decoder's scheduler does: a trie per slot kept across its
requests, joiners prefilled before the next step, each step priced on the plan's profile, t(B, n) at the step's mean
rows per sequence and the sequences' contexts, plus the engine's overhead. Policies:

- `off`, and each fixed decoding length L (every sequence L nodes at every step);
- `schedule`: the plan's setting at each step's batch size and mean context;
- `shared`: each request's expected tokens at every length, the mean of its last YIELD_WINDOW steps' shadow yields
  there beside PRIOR_STEPS at the plan's replay (decoder/gate.py's window and prior), and the step's rows handed out
  one request's next length at a time, the most tokens per row first, the step's total kept where the batch's
  expected tokens per second peak (zero extra rows: off);
- `oracle`: the same allocation on the step's true yields: what no per-request decision can beat.

Prices, not measurements: whether a policy that wins here wins served is `plan bench`'s to say.

    .venv/bin/python bench/budget_replay.py plans/smollm2-135m.lookahead.cpu-2c.fp32.batched.yaml \
        [--acceptance FILE] [--concurrency 1,2,4,8,16] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specplan.core.acceptance_schema import LookaheadRecord, load_lookahead_acceptance
from specplan.core.method_settings import TrieSettings
from specplan.core.plan_schema import load_plan
from specplan.core.profile_schema import LatencyProfile, load_profile
from specplan.decoder.gate import PRIOR_STEPS, YIELD_WINDOW
from specplan.decoder.trie import Trie, accepted_run
from specplan.planner.closed_loop import SettingPrice
from specplan.planner.closed_loop import step_seconds as closed_loop_step
from specplan.planner.lookahead import replay, solved_records


@dataclass
class Sequence:
    """A request in flight: its text (prompt and greedy output), how far it has got, its recent shadow yields."""

    record: LookaheadRecord
    slot: int
    text: np.ndarray
    position: int
    end: int
    recent: dict[int, deque[float]] = field(default_factory=dict)  # length -> last yields at that length

    @property
    def context(self) -> int:
        return self.position - 1


# A step's drafts: per sequence, per decoding length, (rows the trie retrieved, tokens the step would emit)
Shadows = list[dict[int, tuple[int, int]]]
# (batch size, the sequences' contexts, their expected or true tokens per length) -> a decoding length per sequence
Policy = Callable[[int, list[int], list[dict[int, float]], Shadows], list[int]]


def shadows(sequences: list[Sequence], tries: dict[int, Trie], lengths: list[int]) -> Shadows:
    out = []
    for seq in sequences:
        per_length = {1: (1, 1)}
        for length in lengths:
            tokens, parents = tries[seq.slot].retrieve(seq.text, seq.position, length)
            accepted = accepted_run(tokens, parents, seq.text[seq.position:seq.end])
            per_length[length] = (len(tokens), min(accepted + 1, seq.end - seq.position))
        out.append(per_length)
    return out


def step_seconds(profile: LatencyProfile, rows: list[int], contexts: list[int]) -> float:
    """A step of len(rows) sequences, each its rows: the planner's price of a step at their mean rows."""
    return closed_loop_step(profile, len(rows), SettingPrice(1.0, rows=float(np.mean(rows))), contexts)


def allocate(profile: LatencyProfile, contexts: list[int], expected: list[dict[int, float]]) -> list[int]:
    """Each sequence's decoding length: from one node each, the next length of the sequence that adds the most
    expected tokens per extra row, one at a time, keeping the allocation whose expected tokens per second peak."""
    lengths = sorted(expected[0])
    chosen = [1] * len(expected)

    def rate(choice: list[int]) -> float:
        return sum(e[c] for e, c in zip(expected, choice)) / step_seconds(profile, choice, contexts)

    best, best_rate = list(chosen), rate(chosen)
    while True:
        upgrades = []
        for i, e in enumerate(expected):
            above = [length for length in lengths if length > chosen[i]]
            if above:
                step_up = above[0]
                upgrades.append(((e[step_up] - e[chosen[i]]) / (step_up - chosen[i]), -i, step_up))
        if not upgrades:
            return best
        gain, minus_i, step_up = max(upgrades)
        if gain <= 0:
            return best
        chosen[-minus_i] = step_up
        now = rate(chosen)
        if now > best_rate:
            best, best_rate = list(chosen), now


class MeanYields:
    """A request's expected tokens at each length: the mean of its last `window` steps' shadow yields there beside
    `prior_steps` pseudo-steps at the plan's replay (decoder/gate.py's estimate)."""

    def __init__(self, predicted: dict[int, float], window: int, prior_steps: int) -> None:
        self.predicted, self.window, self.prior_steps = predicted, window, prior_steps

    def expected(self, seq: Sequence) -> dict[int, float]:
        out = {}
        for length, prior in self.predicted.items():
            recent = seq.recent.get(length) or ()
            out[length] = ((self.prior_steps * prior + sum(recent)) / (self.prior_steps + len(recent))
                           if recent else prior)
        return out

    def observe(self, seq: Sequence, per_length: dict[int, tuple[int, int]]) -> None:
        for length, (_, emitted) in per_length.items():
            seq.recent.setdefault(length, deque(maxlen=self.window)).append(emitted)


class AfterLastStep:
    """Every request's expected tokens at each length given what its last step's longest draft would have emitted
    (none, one, two, three or more accepted): the engine's mean over its steps that followed each, beside
    `prior_steps` pseudo-steps at the plan's replay. Lookahead's drafts land in runs (a request copying its prompt)."""

    BUCKETS = 4

    def __init__(self, predicted: dict[int, float], prior_steps: int) -> None:
        self.predicted, self.prior_steps = predicted, prior_steps
        self.sums = {b: dict.fromkeys(predicted, 0.0) for b in range(self.BUCKETS)}
        self.counts = dict.fromkeys(range(self.BUCKETS), 0)

    def _bucket(self, seq: Sequence) -> int | None:
        last = seq.recent.get(max(self.predicted))
        return None if not last else min(last[-1] - 1, self.BUCKETS - 1)

    def expected(self, seq: Sequence) -> dict[int, float]:
        bucket = self._bucket(seq)
        if bucket is None:
            return dict(self.predicted)
        n, sums = self.counts[bucket], self.sums[bucket]
        return {length: (self.prior_steps * prior + sums[length]) / (self.prior_steps + n)
                for length, prior in self.predicted.items()}

    def observe(self, seq: Sequence, per_length: dict[int, tuple[int, int]]) -> None:
        bucket = self._bucket(seq)
        if bucket is not None:
            self.counts[bucket] += 1
            for length, (_, emitted) in per_length.items():
                self.sums[bucket][length] += emitted
        seq.recent[max(self.predicted)] = deque([per_length[max(self.predicted)][1]], maxlen=1)


Estimator = MeanYields | AfterLastStep


def closed_loop(records: list[LookaheadRecord], settings: TrieSettings, profile: LatencyProfile, concurrency: int,
                max_new_tokens: int, lengths: list[int], policy: Policy,
                estimator: Estimator) -> tuple[float, float, float]:
    """(output tokens per second, the same over the decoding steps' time alone, rows per sequence per step) of
    `concurrency` clients sending `records` in order, each slot's trie of `settings`."""
    queue = deque(records)
    tries = {slot: Trie(settings) for slot in range(concurrency)}
    held: dict[int, list[int]] = {slot: [] for slot in range(concurrency)}
    free = list(range(concurrency))
    running: list[Sequence] = []
    now, prefills, tokens, rows_total, sequence_steps = 0.0, 0.0, 0, 0, 0
    while queue or running:
        while queue and free:  # a finished request's client sends its next at once
            record, slot = queue.popleft(), free.pop(0)
            text = np.array(record.prompt + record.output[:max_new_tokens], dtype=np.int64)
            shared = len(os.path.commonprefix([record.prompt, held[slot]]))
            prefill = profile.prompt_prefill("target", max(len(record.prompt) - 1 - shared, 1)) or 0.0
            now, prefills = now + prefill, prefills + prefill
            tries[slot].insert(text, 0, len(record.prompt), from_prompt=True)
            running.append(Sequence(record, slot, text, len(record.prompt), len(text)))
        contexts = [seq.context for seq in running]
        drafts = shadows(running, tries, lengths)
        choice = policy(len(running), contexts, [estimator.expected(seq) for seq in running], drafts)
        rows = [drafts[i][length][0] for i, length in enumerate(choice)]
        now += step_seconds(profile, rows, contexts)
        rows_total += sum(rows)
        sequence_steps += len(rows)
        still = []
        for seq, length, per_length in zip(running, choice, drafts):
            emitted = per_length[length][1]
            estimator.observe(seq, per_length)
            tries[seq.slot].insert(seq.text, seq.position, seq.position + emitted)
            seq.position += emitted
            tokens += emitted
            if seq.position < seq.end:
                still.append(seq)
            else:
                tries[seq.slot].end_request()
                held[seq.slot] = seq.record.prompt
                free.append(seq.slot)
                free.sort()
        running = still
    return tokens / now, tokens / (now - prefills), rows_total / sequence_steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("--acceptance", help="greedy outputs to replay (default: the plan's own acceptance file)")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=YIELD_WINDOW, help="the steps a request's expected yields "
                        "are the mean of")
    parser.add_argument("--prior-steps", type=int, default=PRIOR_STEPS, help="pseudo-steps at the plan's replay in "
                        "that mean")
    parser.add_argument("--estimate", choices=("mean", "after-last"), default="mean", help="a request's expected "
                        "yields: its own recent mean (the gate's), or the engine's after steps like its last")
    parser.add_argument("--requests", type=int, help="the first this many records only")
    parser.add_argument("--trie", metavar="L_D,L_B", help="a larger trie than the plan's (its decoding and branch "
                        "lengths): the lengths the requests may share, the schedule kept")
    args = parser.parse_args()
    plan = load_plan(args.plan)
    profile = load_profile(plan.inputs["profile"]["file"])
    records = (load_lookahead_acceptance(args.acceptance).cut(args.max_new_tokens) if args.acceptance
               else solved_records(plan, args.max_new_tokens))[:args.requests]
    settings = TrieSettings.sized(*(int(x) for x in args.trie.split(","))) if args.trie else plan.settings
    lengths = sorted(length for length in plan.inputs["grid"]["decoding_lengths"]
                     if length <= settings.decoding_length)
    # each length's tokens per step on the workload the plan was solved on: a request's prior
    solved = solved_records(plan, args.max_new_tokens)
    predicted = {1: 1.0, **{length: replay(solved, settings, length).tokens_per_step for length in lengths}}
    schedule = plan.schedule

    def fixed(length: int) -> Policy:
        return lambda batch, contexts, expected, drafts: [length] * batch

    def scheduled(batch, contexts, expected, drafts):
        entry = schedule.entry_for(batch, int(np.mean(contexts)))
        return [entry.decoding_length if entry.speculate else 1] * batch

    def shared(batch, contexts, expected, drafts):
        return allocate(profile, contexts, expected)

    def oracle(batch, contexts, expected, drafts):
        return allocate(profile, contexts, [{length: float(y) for length, (_, y) in d.items()} for d in drafts])

    policies: dict[str, Policy] = {"off": fixed(1), **{f"L_d={length}": fixed(length) for length in lengths},
                                   "schedule": scheduled, "shared": shared, "oracle": oracle}
    source = args.acceptance or plan.inputs["acceptance"]["file"]
    print(f"{args.plan} (trie L_d={settings.decoding_length}, L_b={settings.branch_length}): {len(records)} requests "
          f"of {args.max_new_tokens} tokens from {source}, priced on "
          f"{plan.inputs['profile']['file']}; tokens/s, prefills included (rows per sequence per step)")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        def estimator() -> Estimator:
            if args.estimate == "mean":
                return MeanYields(predicted, args.window, args.prior_steps)
            return AfterLastStep(predicted, args.prior_steps)

        rates = {name: closed_loop(records, settings, profile, concurrency, args.max_new_tokens, lengths, policy,
                                   estimator()) for name, policy in policies.items()}
        fixed_names = ["off"] + [f"L_d={length}" for length in lengths]
        line = ", ".join(f"{name} {rate:.1f} ({rows:.2f})" for name, (rate, _, rows) in rates.items())
        print(f"C={concurrency:>2}: {line}")
        for what, k in (("served", 0), ("decoding alone", 1)):
            best_fixed = max(fixed_names, key=lambda name: rates[name][k])
            print(f"      {what}: shared / schedule {rates['shared'][k] / rates['schedule'][k]:.3f}, shared / best "
                  f"fixed ({best_fixed}) {rates['shared'][k] / rates[best_fixed][k]:.3f}, oracle / schedule "
                  f"{rates['oracle'][k] / rates['schedule'][k]:.3f}")


if __name__ == "__main__":
    main()
