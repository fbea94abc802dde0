"""Verification rules: walk a scored token tree from the root and return the accepted path and the next token.

Every rule is lossless: with greedy parameters the output is the target's argmax chain; otherwise the
emitted tokens are distributed exactly as the target's (temperature/top-k/top-p applied).

- GreedyMatch: descend into the child holding the target's argmax; the next token is that argmax.
- SampleMatch: for drafts with no distribution (top-k of Q, a trie): draw y from P at the node and
  descend into the child holding y, if any; otherwise y is the next token.
- SequoiaRule (Sequoia's Algorithm 1): children were drawn from Q without replacement. Residual R = P,
  draft D = Q; child x is accepted with probability min(1, R[x] / D[x]); on rejection R = norm(max(R - D, 0)),
  D[x] = 0 (uniform over not-yet-rejected tokens if D is exhausted), D = norm(D). If no child is accepted,
  the next token is drawn from R.
- SpecInferRule: children drawn i.i.d. from Q; the same loop with D = Q throughout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specplan.core.errors import UserError
from specplan.decoder.sampling import SamplingParams, probabilities
from specplan.decoder.tree import DETERMINISTIC, WITH_REPLACEMENT, WITHOUT_REPLACEMENT, DraftTree


class VerificationRule(ABC):
    name: str
    draw: str  # how the drafter must choose children for this rule

    def walk(self, tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
             generator: torch.Generator | None) -> tuple[list[int], int]:
        """Accepted node indices (root first) and the token that follows them."""
        path = [0]
        while True:
            node = path[-1]
            child, token = self.step(tree, node, target_logits[node], params, generator)
            if child is None:
                return path, token
            path.append(child)

    @abstractmethod
    def step(self, tree: DraftTree, node: int, logits: torch.Tensor, params: SamplingParams,
             generator: torch.Generator | None) -> tuple[int | None, int]:
        """From an accepted node: (the accepted child, -1), or (None, the next token)."""


def _child_with_token(tree: DraftTree, node: int, token: int) -> int | None:
    for child in tree.children[node]:
        if tree.tokens[child] == token:
            return child
    return None


def greedy_path(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    """The greedy walk given the target's argmax at every node."""
    path = [0]
    while (child := _child_with_token(tree, path[-1], argmax[path[-1]])) is not None:
        path.append(child)
    return path, argmax[path[-1]]


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, device=generator.device if generator is not None else None))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


class GreedyMatch(VerificationRule):
    name = "greedy"
    draw = DETERMINISTIC

    def walk(self, tree, target_logits, params, generator):
        if target_logits.device.type == "cpu":  # the accepted nodes' rows only: fewer rows to read
            return super().walk(tree, target_logits, params, generator)
        # On a GPU each row's argmax read on its own is a device synchronization: read them all in one.
        return greedy_path(tree, target_logits.argmax(dim=-1).tolist())

    def step(self, tree, node, logits, params, generator):
        token = int(logits.argmax())
        child = _child_with_token(tree, node, token)
        return (child, -1) if child is not None else (None, token)


class SampleMatch(VerificationRule):
    name = "sample-match"
    draw = DETERMINISTIC

    def step(self, tree, node, logits, params, generator):
        token = _draw(probabilities(logits[None], params)[0], generator)
        child = _child_with_token(tree, node, token)
        return (child, -1) if child is not None else (None, token)


class SequoiaRule(VerificationRule):
    name = "sequoia"
    draw = WITHOUT_REPLACEMENT
    update_draft = True

    def step(self, tree, node, logits, params, generator):
        residual = probabilities(logits[None], params)[0].double()
        children = tree.children[node]
        if children:
            draft = tree.draft_probs[node].double().clone()
            rejected = torch.zeros_like(draft, dtype=torch.bool)
            for child in children:
                x = tree.tokens[child]
                if _uniform(generator) * draft[x] < residual[x]:  # probability min(1, R[x] / D[x])
                    return child, -1
                leftover = (residual - draft).clamp_(min=0)
                if leftover.sum() > 0:
                    residual = leftover / leftover.sum()
                if self.update_draft:
                    draft[x] = 0
                    rejected[x] = True
                    if draft.sum() <= 0:
                        draft = (~rejected).double()
                    draft /= draft.sum()
        return None, _draw(residual, generator)


class SpecInferRule(SequoiaRule):
    name = "specinfer"
    draw = WITH_REPLACEMENT
    update_draft = False


RULES = {rule.name: rule for rule in (GreedyMatch, SampleMatch, SequoiaRule, SpecInferRule)}


def choose_rule(name: str | None, params: SamplingParams, drafter_draws: tuple[str, ...]) -> VerificationRule:
    """The rule to use: greedy at T = 0; otherwise the named one (default Sequoia's), checked against what the
    drafter can produce. Deterministic drafters are verified by sample matching."""
    if params.greedy:
        if name not in (None, "greedy"):
            raise UserError(f"the {name} verification rule needs a temperature > 0 (T = 0 verifies by greedy match)")
        return GreedyMatch()
    if name == "greedy":
        raise UserError("the greedy verification rule needs temperature 0")
    if drafter_draws == (DETERMINISTIC,):
        if name not in (None, "sample-match"):
            raise UserError(f"this drafter proposes deterministic drafts; the {name} verification rule does not apply")
        return SampleMatch()
    rule = RULES.get(name or "sequoia")
    if rule is None:
        raise UserError(f"unknown verification rule {name!r} (choose from {', '.join(RULES)})")
    if rule.draw not in drafter_draws:
        raise UserError(f"the {rule.name} verification rule needs children drawn {rule.draw.replace('_', ' ')}")
    return rule()
