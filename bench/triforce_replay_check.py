"""A greedy TriForce plan's steps, decoded, against the step path its acceptance traces replay.

At T = 0 the traces are 0/1, so the planner's replay is one deterministic path: from position p, middle
rounds of 1 + (the bottom's recorded run of accepted drafts for gamma1) tokens until the chain holds gamma2,
then the top keeps the chain up to the middle level's first miss plus one token. This prints, per prompt,
(chain, emitted) for every step of the decoder and of that path, and the first step where they part: where
the replay's tokens/step prediction goes wrong.

    python bench/triforce_replay_check.py --plan plans/smollm2-135m.triforce-7680.cpu-2c-avx2.fp32.yaml \
        --acceptance acceptance/smollm2-135m.triforce.haystack.cpu-2c-avx2.fp32.yaml --prompts 4
"""

from __future__ import annotations

from step_breakdown import plan_with_prompts  # bench/ is on the path of a script run from it

from core.acceptance_schema import load_triforce_acceptance
from decoder.sampling import SamplingParams


def first_proposal_runs(bottom: list[int], gamma1: int) -> list[int]:
    """An older acceptance file's runs: the 0/1 first-proposal trace, up to gamma1 ones in a row."""
    runs = []
    for q in range(len(bottom)):
        run = 0
        while run < gamma1 and q + run < len(bottom) and bottom[q + run]:
            run += 1
        runs.append(run)
    return runs


def replayed_steps(middle: list[int], runs: list[int], gamma2: int) -> list[tuple[int, int]]:
    steps, p = [], 0
    while p < len(middle):
        chain, q = 0, p
        while chain < gamma2:
            run = runs[q] if q < len(runs) else 0
            chain += run + 1
            q += run + 1
        kept = 0
        while kept < chain and p + kept < len(middle) and middle[p + kept]:
            kept += 1
        steps.append((chain, kept + 1))
        p += kept + 1
    return steps


def main() -> None:
    args, decoder, prompts = plan_with_prompts(__doc__, "--acceptance", 4)
    s = decoder.plan.settings
    if s.bottom == "none" or not s.speculate or decoder.plan.sampling.get("temperature", 0.0) != 0.0:
        raise SystemExit("needs a greedy, speculating plan with a bottom drafter")
    entry = next(e for e in load_triforce_acceptance(args.acceptance).entries
                 if (e.context, e.budget, e.chunk, e.stride) == (s.context, s.budget, s.chunk,
                                                                               s.stride))
    decoder.restart()  # a fresh drafter, as `plan bench` starts its prompts with
    drafter = decoder.engine.drafter
    chains: list[int] = []
    update = drafter.update

    def recording_update(tree, accepted, next_token):
        chains.append(tree.size - 1)
        update(tree, accepted, next_token)

    drafter.update = recording_update
    for prompt, trace in zip(prompts, entry.traces):
        chains.clear()
        result = decoder.engine.generate(prompt.ids, args.max_new_tokens, SamplingParams())
        decoded = list(zip(chains, result.accepted_per_step))
        runs = trace.bottom_runs[s.gamma1 - 1].tolist() if trace.bottom_runs is not None else \
            first_proposal_runs([int(v) for v in trace.bottom], s.gamma1)
        replayed = replayed_steps([int(v) for v in trace.middle], runs, s.gamma2)
        parted = next((i for i, (a, b) in enumerate(zip(decoded, replayed)) if a != b),
                      None if len(decoded) == len(replayed) else min(len(decoded), len(replayed)))
        print(f"{prompt.id}: {len(result.tokens)} tokens, decoder {len(decoded)} steps, replay {len(replayed)} "
              f"steps; " + ("same path" if parted is None else f"first differing step {parted}"))
        print(f"  decoder (chain, emitted): {decoded}")
        print(f"  replay  (chain, emitted): {replayed}")


if __name__ == "__main__":
    main()
