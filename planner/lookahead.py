"""Lookahead's decoding length L_d and branch length L_b, chosen by replaying the trie offline.

For greedy decoding the replay is exact: given the target's own greedy outputs, in the dataset's order, it
runs the trie as the decoder would (prompt branches, retrieval, longest matching branch plus the bonus token,
insertion of the emitted tokens, elimination at the end of each request) and counts target steps. Each step's
cost is t(n, L) from the latency profile for the draft's actual size n at the current context L, plus the
host's work around it: o(n), the decoding engine's overhead per step (profiled with t; zero for a profile
without it), and h, the trie's retrieval and insertion, timed in this replay (the decoder's own trie calls,
on the machine that solves). So

    predicted speedup = sum over emitted tokens of (t(1, L) + o(1))
                        / sum over steps of (t(n_step, L_step) + o(n_step) + h_step).

On a CPU the host's share is a few percent of a forward; on a GPU, where smollm2-135m's forward takes 3 ms,
it was close to a forward's cost.

With `batches` (a profile with t(B, n)), the plan also gets a schedule: for every batch size B up to the largest
profiled, the decoding length under the chosen trie (or none) that gives the most output tokens per second over
the batch, B x tokens/step / (t(B, n) + o(n, B) + B h) with n the replay's mean draft size and h its trie time per
step, against B / (t(B, 1) + o(1, B)) without drafting; at the replays' mean context. Each decoding length is
replayed exactly under the chosen trie with its retrieval capped there (the trie learns the same text either way).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from specplan.core.acceptance_schema import LookaheadAcceptance, LookaheadRecord, load_lookahead_acceptance
from specplan.core.choices import MIN_SPEEDUP
from specplan.core.errors import UserError
from specplan.core.fileio import shown
from specplan.core.method_settings import TrieSettings
from specplan.core.model_names import same_model
from specplan.core.plan_schema import BatchSchedule, Plan, PlanModels, Prediction, RowSharing
from specplan.core.profile_schema import LatencyProfile, load_profile
from specplan.core.provenance import provenance
from specplan.decoder.trie import Trie, accepted_run
from specplan.planner.closed_loop import SettingPrice, schedule_table
from specplan.planner.closed_loop import step_seconds as served_step_seconds

DECODING_LENGTHS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
BRANCH_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass(frozen=True)
class ReplayResult:
    decoding_length: int
    branch_length: int
    tokens: int
    steps: int
    step_sizes: np.ndarray  # draft size (root included) per step
    step_contexts: np.ndarray  # tokens in the cache before each step
    step_tokens: np.ndarray  # tokens emitted by each step
    trie_seconds: float  # the replay's time in the trie's retrieval and insertion calls

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps


def replay(records: list[LookaheadRecord], settings: TrieSettings, decoding_length: int | None = None,
           requests_per_trie: int | None = None) -> ReplayResult:
    """The trie of `settings` run over the records as the decoder runs it; `decoding_length`: retrieval capped at
    that many nodes (a schedule's setting under the plan's trie); `requests_per_trie`: a fresh trie every that many
    records (a server's slots, each learning from its own requests only; None: one trie learns from them all)."""
    trie = Trie(settings)
    decoding_length = decoding_length or settings.decoding_length
    tokens = steps = 0
    sizes: list[int] = []
    contexts: list[int] = []
    emitted_per_step: list[int] = []
    trie_seconds = 0.0
    for index, record in enumerate(records):
        if requests_per_trie and index % requests_per_trie == 0:
            trie = Trie(settings)
        elif index:
            trie.end_request()
        sequence = np.array(record.prompt + record.output, dtype=np.int64)
        position = len(record.prompt)
        end = len(sequence)
        trie.insert(sequence, 0, position, from_prompt=True)
        while position < end:
            started = time.perf_counter()
            draft_tokens, draft_parents = trie.retrieve(sequence, position, decoding_length)
            trie_seconds += time.perf_counter() - started
            accepted = accepted_run(draft_tokens, draft_parents, sequence[position:end])
            emitted = min(accepted + 1, end - position)
            sizes.append(len(draft_tokens))
            contexts.append(position - 1)
            emitted_per_step.append(emitted)
            started = time.perf_counter()
            trie.insert(sequence, position, position + emitted)
            trie_seconds += time.perf_counter() - started
            position += emitted
            tokens += emitted
            steps += 1
    return ReplayResult(decoding_length, settings.branch_length, tokens, steps, np.array(sizes),
                        np.array(contexts), np.array(emitted_per_step), trie_seconds)


def predicted_speedup(result: ReplayResult, profile: LatencyProfile) -> tuple[float, float]:
    """(speedup over autoregressive decoding, seconds per step on average) from the profile and the replay's
    trie time."""
    forwards = sum(float(profile.latency(n, L)) for n, L in zip(result.step_sizes, result.step_contexts))
    step_seconds = forwards + float(profile.engine_overhead(result.step_sizes).sum()) + result.trie_seconds
    # Autoregressive decoding spends t(1, L) + o(1) per token; a step's tokens sit at about the step's context.
    ar_seconds = sum(float(profile.latency(1, L)) * k for L, k in zip(result.step_contexts, result.step_tokens))
    ar_seconds += float(profile.engine_overhead(1)) * result.tokens
    return ar_seconds / step_seconds, step_seconds / result.steps


@dataclass(frozen=True)
class LookaheadCandidate:
    decoding_length: int
    branch_length: int
    tokens_per_step: float
    speedup: float | None
    step_seconds: float | None


def solve_lookahead(acceptance_path: str | Path, profile_path: str | Path | None,
                    decoding_lengths: tuple[int, ...] = DECODING_LENGTHS,
                    branch_lengths: tuple[int, ...] = BRANCH_LENGTHS,
                    largest_batch: int | None = None, stand_in: bool = False, contexts: tuple[int, ...] = (),
                    output_tokens: int | None = None, min_speedup: float = MIN_SPEEDUP,
                    share_rows: tuple[int, int] | None = None) -> tuple[Plan, list[LookaheadCandidate]]:
    """The best (L_d, L_b) and the ranked grid; with `largest_batch`, the plan's schedule up to that batch size.
    `stand_in`: the acceptance file is another model's outputs, priced on the profile's model (a modeled GPU).
    `contexts`: the schedule's tables, one priced at each (default: one, at the replay's mean context).
    `output_tokens`: solved for requests of that many new tokens (a trie drafts an output's later tokens better, having
    read more of it: a plan solved on long outputs overrates short requests).
    `min_speedup`: the schedule drafts at a batch size only where predicted that much faster than none.
    `share_rows`: (L_d, L_b) of a trie whose rows the requests of a step share by their own yields (RowSharing), priced
    at the schedule's first context."""
    acceptance = load_lookahead_acceptance(acceptance_path)
    records = acceptance.cut(output_tokens)
    profile = load_profile(profile_path) if profile_path is not None else None
    if stand_in and (profile is None or not profile.models.get("target")):
        raise UserError("--stand-in prices another model's outputs on a profile's model: give --profile")
    if profile is not None:
        measured = profile.models.get("target")
        if measured and not stand_in and not same_model(measured, acceptance.target):
            raise UserError(f"{acceptance_path} and {profile_path}: the outputs are from "
                            f"{shown(acceptance.target)} but the profile is for {shown(measured)}")
        max_n = min(max(curve) for curve in (profile.target_by_context or {0: profile.target_t_seconds}).values())
        decoding_lengths = tuple(d for d in decoding_lengths if d <= max_n)
    grid = [(d, b) for d in decoding_lengths for b in branch_lengths if b < d]
    if not grid:
        raise UserError("no (L_d, L_b) pair to search: L_d must be >= 2 and within the profile's sizes")
    start = time.perf_counter()
    replays = _search(records, grid)
    seconds = time.perf_counter() - start
    candidates = _choose(replays, profile)
    plan = _assemble(candidates[0], replays, acceptance, acceptance_path, profile, profile_path, decoding_lengths,
                     branch_lengths)
    if output_tokens is not None:
        plan.inputs["acceptance"]["output_tokens"] = output_tokens
    if stand_in:
        plan.models = replace(plan.models, target=profile.models["target"])
        plan.inputs["acceptance"]["stands_in"] = (f"measured for {acceptance.target}, standing in for "
                                                  f"{plan.models.target}")
    plan.solver.update(seconds=seconds, top=[asdict(c) for c in candidates[:10]])
    if contexts and largest_batch is None:
        raise UserError("--contexts prices a schedule per batch size at each context: it goes with --batches")
    if largest_batch is not None:
        if profile is None:
            raise UserError("a schedule per batch size is priced on a profile: give --profile")
        plan.schedule, rates = lookahead_schedule(records, plan.settings, profile, largest_batch,
                                                  decoding_lengths, contexts, min_speedup)
        plan.solver["schedule"] = {"algorithm": "the most output tokens/s over the batch at every batch size, "
                                                "each decoding length replayed under the plan's trie",
                                   "min_speedup": min_speedup, "tokens_per_second": rates}
    if share_rows is not None:
        if largest_batch is None:
            raise UserError("--share-rows prices a step's rows at every batch size: it goes with --batches")
        plan.sharing = row_sharing(records, TrieSettings.sized(*share_rows), profile, largest_batch,
                                   decoding_lengths, plan.schedule.context, min_speedup)
    return plan, candidates


def row_sharing(records: list[LookaheadRecord], trie: TrieSettings, profile: LatencyProfile, largest_batch: int,
                decoding_lengths: tuple[int, ...], context: int, min_speedup: float = MIN_SPEEDUP) -> RowSharing:
    """The table a step's rows are shared by (core/plan_schema.py: RowSharing): each of `decoding_lengths` up to the
    trie's replayed under it (every request's prior), and a step's seconds at every batch size up to the largest
    profiled and every number of rows per sequence up to the trie's decoding length, the trie's retrieval at its
    full length included (sharing retrieves it every step, decoder/sharing.py), and one sequence's forward at every
    total of rows where the profile timed them all (`--row-totals`); a step drafts only where its allocation is
    expected `min_speedup` times as fast as none, the schedule's margin."""
    largest = min(largest_batch, max(profile.batch_sizes))
    lengths = sorted({d for d in decoding_lengths if 2 <= d < trie.decoding_length} | {trie.decoding_length})
    replays = {d: replay(records, trie, d) for d in lengths}
    longest = replays[trie.decoding_length]
    host = longest.trie_seconds / longest.steps
    try:
        steps = {batch: tuple(served_step_seconds(profile, batch, SettingPrice(1.0, float(rows), host), [context])
                              for rows in range(1, trie.decoding_length + 1)) for batch in range(1, largest + 1)}
    except (UserError, ValueError) as exc:
        raise UserError(f"--share-rows: the profile does not price {trie.decoding_length} rows per sequence at every "
                        f"batch size ({exc}): profile larger --sizes, or share a shorter trie") from None
    # one sequence's forward at every total a table step reaches, where profiled (from two sequences, one drafting:
    # 4 rows; below, no step falls between uniform ones)
    totals = min(profile.every_size_up_to, largest * trie.decoding_length)
    row_seconds = tuple(float(t) for t in profile.latency(np.arange(1, totals + 1), context)) if totals >= 4 else ()
    return RowSharing(trie, context, {1: 1.0, **{d: result.tokens_per_step for d, result in replays.items()}}, steps,
                      min_speedup, row_seconds)


def lookahead_schedule(records: list[LookaheadRecord], settings: TrieSettings, profile: LatencyProfile,
                       largest_batch: int, decoding_lengths: tuple[int, ...], contexts: tuple[int, ...] = (),
                       min_speedup: float = MIN_SPEEDUP) -> tuple[BatchSchedule, dict[str, list[float | None]]]:
    """The setting per batch size (see the module's docstring), ranges of equal settings merged, priced at the
    replay's mean context, or one table per context of `contexts`; and every setting's predicted tokens/s per batch
    size 1, 2, ... in the first table ({"off": [...], "L_d=4": [...]}; None: not priced)."""
    largest = min(largest_batch, max(profile.batch_sizes))
    lengths = sorted({d for d in decoding_lengths if 2 <= d < settings.decoding_length} | {settings.decoding_length})
    replays = {d: replay(records, settings, d) for d in lengths}
    priced_at = contexts or (int(round(float(np.mean(replays[settings.decoding_length].step_contexts)))),)
    prices = {d: setting_price(result) for d, result in replays.items()}
    tables, rates = [], {}
    for context in sorted(priced_at):
        table, table_rates = schedule_table(prices, profile, largest, context, "lookahead", min_speedup)
        tables.append(table)
        rates = rates or table_rates
    return BatchSchedule.by_context(tables), rates


def setting_price(result: ReplayResult) -> SettingPrice:
    """A decoding length's yield and cost per sequence and step, from its replay."""
    return SettingPrice(result.tokens_per_step, float(np.mean(result.step_sizes)), result.trie_seconds / result.steps)


def plan_setting_prices(plan: Plan, decoding_lengths: set[int], requests_per_trie: int | None = None,
                        output_tokens: int | None = None, records: list[LookaheadRecord] | None = None
                        ) -> dict[int, SettingPrice]:
    """Each of `decoding_lengths` (the plan's schedule's, fixed settings') priced under the plan's trie, replayed on
    `records` (default: the acceptance file the plan was solved on), a fresh trie every `requests_per_trie` records
    (see replay), each output cut to its first `output_tokens` (default: as the plan was solved)."""
    records = records if records is not None else solved_records(plan, output_tokens)
    return {d: setting_price(replay(records, plan.settings, d, requests_per_trie)) for d in sorted(decoding_lengths)}


def served_records(records: list[LookaheadRecord], prompts: list[list[int]]) -> list[LookaheadRecord] | None:
    """Of `records` (a plan's solved_records), those whose prompts a load sends, in the order the load first sends
    them: that load's own replay, for a served subset of the prompts a plan was solved on drafts as those prompts do,
    not as all of them. None when a prompt is not among them (an unseen load, priced on all the records)."""
    by_prompt = {tuple(record.prompt): record for record in records}
    sent = list(dict.fromkeys(tuple(prompt) for prompt in prompts))
    if not sent or any(prompt not in by_prompt for prompt in sent):
        return None
    return [by_prompt[prompt] for prompt in sent]


def solved_records(plan: Plan, output_tokens: int | None = None) -> list[LookaheadRecord]:
    """The records of the acceptance file a Lookahead plan was solved on, each output cut to its first
    `output_tokens` (default: as the plan was solved, `plan solve lookahead --max-new-tokens`)."""
    acceptance = plan.inputs["acceptance"]
    return load_lookahead_acceptance(acceptance["file"]).cut(output_tokens or acceptance.get("output_tokens"))


def _search(records: list[LookaheadRecord], grid: list[tuple[int, int]]) -> dict[tuple[int, int], ReplayResult]:
    """The replay of every (L_d, L_b) of the grid."""
    replay(records[:1], TrieSettings.sized(*grid[0]))  # compiles the trie's calls before the timed replays
    return {(d, b): replay(records, TrieSettings.sized(d, b)) for d, b in grid}


def _choose(replays: dict[tuple[int, int], ReplayResult], profile: LatencyProfile | None) -> list[LookaheadCandidate]:
    """Every pair, best first: by predicted speedup with a profile, by tokens per step without one; ties go to
    the smaller decoding length, then branch length."""
    candidates = []
    for (d, b), result in replays.items():
        speedup, step = predicted_speedup(result, profile) if profile is not None else (None, None)
        candidates.append(LookaheadCandidate(d, b, result.tokens_per_step, speedup, step))
    if profile is not None:
        return sorted(candidates, key=lambda c: (-c.speedup, c.decoding_length, c.branch_length))
    return sorted(candidates, key=lambda c: (-c.tokens_per_step, c.decoding_length, c.branch_length))


def _assemble(best: LookaheadCandidate, replays: dict[tuple[int, int], ReplayResult],
              acceptance: LookaheadAcceptance, acceptance_path: str | Path, profile: LatencyProfile | None,
              profile_path: str | Path | None, decoding_lengths: tuple[int, ...],
              branch_lengths: tuple[int, ...]) -> Plan:
    """The plan file for the chosen pair: the trie settings, the prediction, the inputs and the grid."""
    best_replay = replays[(best.decoding_length, best.branch_length)]
    details: dict = {"replayed_tokens": best_replay.tokens}
    if profile is not None:
        details.update(engine_overhead_seconds=float(profile.engine_overhead(best_replay.step_sizes).mean()),
                       trie_seconds=best_replay.trie_seconds / best_replay.steps)
    # Outside fp32 the text depends on the forward's size: the replay is exact for the decoding settings only.
    replay_exact = (acceptance.decoded_with == (best.decoding_length, best.branch_length)
                    if acceptance.decoded_with and acceptance.dtype != "fp32" else None)
    return Plan(
        method="lookahead",
        models=PlanModels(target=acceptance.target, dtype=profile.dtype or None if profile is not None else None,
                          backend=profile.backend if profile is not None else None),
        prediction=Prediction(best.tokens_per_step, best.speedup, best.step_seconds,
                              latency_source=profile.source if profile is not None else None,
                              replay_exact=replay_exact, details=details),
        inputs={"acceptance": {"file": str(acceptance_path), "records": len(acceptance.records),
                               "dataset": acceptance.extra.get("dataset")},
                **({"profile": profile.plan_inputs(profile_path)} if profile is not None else {}),
                "grid": {"decoding_lengths": list(decoding_lengths), "branch_lengths": list(branch_lengths)}},
        solver={"seconds": 0.0, "algorithm": "exact greedy replay of the trie over the (L_d, L_b) grid", "top": []},
        provenance=provenance([acceptance_path] + ([profile_path] if profile_path else [])),
        sampling={"temperature": 0.0},
        settings=TrieSettings.sized(best.decoding_length, best.branch_length),
        tokenizer=acceptance.tokenizer,
    )
