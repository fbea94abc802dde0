"""`plan accept sequoia`: the positional acceptance vector of a draft/target pair, by teacher forcing.

For every prompt the target generates its own continuation (greedy at T = 0, sampled otherwise), then one
forward per model over prompt + continuation gives, at every continuation position, the target's and the
draft's distributions P and Q (temperature/top-p applied as in decoding). At each position:

- T = 0 (greedy variant): children are Q's top-k tokens in order; child k is accepted iff it is argmax P,
  so p_k is the fraction of positions where argmax P is Q's k-th most likely token (exact).
- T > 0 (Sequoia's Algorithm 1, children drawn from Q without replacement): p_k = P(children 1..k-1
  rejected and child k accepted). Given the state (residual R, draft D) before child i, the chance of
  accepting it is a_i = sum_x min(R(x), D(x)), and a rejected child is distributed as norm(max(D - R, 0)).
  Tracking the probability weight of each rejection path, instead of flipping the accept coin, gives
  p_k = E[prod_{i<k}(1 - a_i) a_k]. This is computed exactly by enumerating rejection paths when the
  support is small (at most EXACT_SUPPORT tokens), and otherwise estimated along `paths` random rejection
  paths (k = 1 is exact either way). Tokens outside the smallest set holding all but TAIL_MASS of both P
  and Q are merged into one bucket, which changes p_k by at most about TAIL_MASS.

Standard errors are over positions (the per-position values are independent draws given the data).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit

from specplan.core import progress
from specplan.core.acceptance_schema import DRAFT_SAMPLER_TOP_K, DraftChainTrace
from specplan.decoder.api import Forward
from specplan.decoder.draft_rules import draft_confidence
from specplan.decoder.sampling import SamplingParams, probabilities, sample

TAIL_MASS = 1e-6
EXACT_SUPPORT = 6


@njit(cache=True)
def _next_draft(D: np.ndarray, alive: np.ndarray, x: int) -> np.ndarray:
    """D with x removed and renormalised; uniform over the tokens not yet drawn when D runs out."""
    Dn = D.copy()
    Dn[x] = 0.0
    total = Dn.sum()
    if total <= 0.0:
        for i in range(Dn.shape[0]):
            Dn[i] = 1.0 if alive[i] else 0.0
        total = Dn.sum()
        if total <= 0.0:
            return Dn
    return Dn / total


@njit(cache=True)
def _residual(R: np.ndarray, D: np.ndarray) -> np.ndarray:
    Rn = np.maximum(R - D, 0.0)
    total = Rn.sum()
    return Rn / total if total > 0.0 else Rn


@njit(cache=True)
def _acceptance(R: np.ndarray, D: np.ndarray) -> float:
    a = 0.0
    for i in range(R.shape[0]):
        a += min(R[i], D[i])
    return min(a, 1.0)


@njit(cache=True)
def _exact(P, Q, width, out):
    """Enumerate every rejection path (depth-first, an explicit stack: numba cannot cache recursion)."""
    m = P.shape[0]
    R = np.empty((width, m))
    D = np.empty((width, m))
    residual = np.empty((width, m))
    alive = np.ones((width, m), dtype=np.bool_)
    weight = np.empty(width)
    next_x = np.zeros(width, dtype=np.int64)
    R[0] = P
    D[0] = Q
    weight[0] = 1.0
    k = 0
    entering = True
    while k >= 0:
        if entering:
            a = _acceptance(R[k], D[k])
            out[k] += weight[k] * a
            next_x[k] = 0
            if 1.0 - a <= 1e-15 or k + 1 >= width:
                next_x[k] = m  # no deeper level matters
            else:
                residual[k] = _residual(R[k], D[k])
            entering = False
        if next_x[k] >= m:
            k -= 1
            continue
        x = next_x[k]
        next_x[k] += 1
        reject = D[k, x] - R[k, x]
        if reject <= 0.0:
            continue
        alive[k + 1] = alive[k]
        alive[k + 1, x] = False
        D[k + 1] = _next_draft(D[k], alive[k + 1], x)
        R[k + 1] = residual[k]
        weight[k + 1] = weight[k] * reject
        k += 1
        entering = True


@njit(cache=True)
def _simulated(P, Q, width, paths, out):
    for _ in range(paths):
        R = P.copy()
        D = Q.copy()
        alive = np.ones(P.shape[0], dtype=np.bool_)
        weight = 1.0 / paths
        for k in range(width):
            a = _acceptance(R, D)
            out[k] += weight * a
            reject = 1.0 - a
            if reject <= 1e-15:
                break
            weight *= reject
            # Draw the rejected child from norm(max(D - R, 0)).
            u = np.random.random() * reject
            x = -1
            acc = 0.0
            for i in range(R.shape[0]):
                d = D[i] - R[i]
                if d > 0.0:
                    acc += d
                    x = i
                    if acc >= u:
                        break
            R = _residual(R, D)
            alive[x] = False
            D = _next_draft(D, alive, x)


@njit(cache=True)
def _positional_batch(P_flat, Q_flat, offsets, width, paths, exact_support, seed):
    np.random.seed(seed)
    rows = offsets.shape[0] - 1
    out = np.zeros((rows, width))
    for r in range(rows):
        P = P_flat[offsets[r]:offsets[r + 1]]
        Q = Q_flat[offsets[r]:offsets[r + 1]]
        if P.shape[0] <= exact_support:
            _exact(P, Q, width, out[r])
        else:
            _simulated(P, Q, width, paths, out[r])
    return out


def truncate_support(P: np.ndarray, Q: np.ndarray, tail: float = TAIL_MASS) -> tuple[np.ndarray, np.ndarray]:
    """The tokens carrying all but `tail` of both P's and Q's mass, plus one bucket for the rest."""
    order = np.argsort(-np.maximum(P, Q), kind="stable")
    P_sorted, Q_sorted = P[order], Q[order]
    rest_P = 1.0 - np.cumsum(P_sorted)
    rest_Q = 1.0 - np.cumsum(Q_sorted)
    keep = int(np.argmax((rest_P <= tail) & (rest_Q <= tail))) + 1
    bucket_P, bucket_Q = max(P_sorted[keep:].sum(), 0.0), max(Q_sorted[keep:].sum(), 0.0)
    if bucket_P > 0 or bucket_Q > 0:
        return np.append(P_sorted[:keep], bucket_P), np.append(Q_sorted[:keep], bucket_Q)
    return P_sorted[:keep].copy(), Q_sorted[:keep].copy()


def positional_sampled(P_rows: np.ndarray, Q_rows: np.ndarray, width: int, paths: int = 64, seed: int = 0,
                       exact_support: int = EXACT_SUPPORT, tail: float = TAIL_MASS) -> np.ndarray:
    """Per-position estimates [rows, width] of Sequoia's without-replacement positional acceptance."""
    P_parts, Q_parts, offsets = [], [], [0]
    for P, Q in zip(P_rows, Q_rows):
        P_small, Q_small = truncate_support(np.asarray(P, dtype=np.float64), np.asarray(Q, dtype=np.float64), tail)
        P_parts.append(P_small / P_small.sum())
        Q_parts.append(Q_small / Q_small.sum())
        offsets.append(offsets[-1] + len(P_small))
    return _positional_batch(np.concatenate(P_parts), np.concatenate(Q_parts), np.asarray(offsets, dtype=np.int64),
                             width, paths, exact_support, seed)


def positional_greedy(target_logits: torch.Tensor, draft_logits: torch.Tensor, width: int) -> np.ndarray:
    """Per-position indicators [rows, width]: argmax P is Q's k-th most likely token."""
    target_best = target_logits.argmax(-1, keepdim=True)
    top = torch.topk(draft_logits.float(), width, dim=-1).indices
    return (top == target_best).double().numpy()


def chain_trace(target_logits: torch.Tensor, draft_logits: torch.Tensor, prompt_tokens: int,
                width: int) -> DraftChainTrace:
    """The draft's argmax against the target's at each row ([rows, vocab] each), with the draft's confidence as
    llama.cpp's draft sampler reports it (the top-1 probability among its top DRAFT_SAMPLER_TOP_K logits), and the
    target's token's rank among the draft's top `width` (`width` where it is none of them)."""
    confidence = draft_confidence(draft_logits, DRAFT_SAMPLER_TOP_K)
    hits = positional_greedy(target_logits, draft_logits, width)  # [rows, width] one-hot where among the top
    ranks = np.where(hits.any(1), hits.argmax(1), width)
    # the hit is rank 0 of the one ranking (two top-k calls may order bf16's exact ties apart)
    return DraftChainTrace(ranks == 0, confidence.double().numpy(), prompt_tokens, ranks)


@dataclass
class AcceptanceRun:
    per_position: np.ndarray  # [positions, width]
    chains: list[DraftChainTrace] = field(default_factory=list)  # per prompt, at T = 0
    prompt_tokens: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def positional(self) -> np.ndarray:
        return self.per_position.mean(axis=0)

    @property
    def stderr(self) -> np.ndarray:
        n = self.per_position.shape[0]
        return self.per_position.std(axis=0, ddof=1) / np.sqrt(n) if n > 1 else np.zeros(self.per_position.shape[1])


@torch.inference_mode()
def continuation(model: Forward, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                 generator: torch.Generator, stop_ids: Collection[int]) -> list[int]:
    """The target's own continuation, one token per forward."""
    cache = model.new_cache(len(prompt) + max_new_tokens)
    logits = model.prefill(torch.tensor(prompt), cache)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(sample(probabilities(logits[None], params), generator)[0]) if not params.greedy \
            else int(logits.argmax())
        out.append(token)
        if token in stop_ids:
            break
        logits = model.forward(torch.tensor([token]), torch.tensor([cache.length]), cache, None)[0]
        cache.commit(None, 1)
    return out


@torch.inference_mode()
def sequence_logits(model: Forward, tokens: list[int], first: int, chunk: int = 256) -> torch.Tensor:
    """Logits predicting tokens[first:] (rows first-1 .. len-2), from one chunked causal pass."""
    from specplan.decoder.model import causal_mask

    cache = model.new_cache(len(tokens))
    ids = torch.tensor(tokens)
    rows = []
    for begin in range(0, len(tokens) - 1, chunk):
        piece = ids[begin:min(begin + chunk, len(tokens) - 1)]
        n = piece.shape[0]
        positions = torch.arange(begin, begin + n)
        keep_from = max(first - 1 - begin, 0)
        logits = model.forward(piece, positions, cache, causal_mask(begin, n, model.dtype, model.device),
                               logits_rows=slice(keep_from, n) if keep_from < n else slice(n, n))
        cache.commit(None, n)
        rows.append(logits.float())
    return torch.cat(rows)


def measure_sequoia(target: Forward, draft: Forward, prompts: list[list[int]], params: SamplingParams,
                    width: int, max_new_tokens: int, stop_ids: Collection[int], seed: int = 0, paths: int = 64,
                    on_prompt=None) -> AcceptanceRun:
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    run = AcceptanceRun(np.zeros((0, width)))
    for index, prompt in enumerate(prompts):
        generated = continuation(target, prompt, max_new_tokens, params, generator, stop_ids)
        tokens = prompt + generated
        target_logits = sequence_logits(target, tokens, len(prompt))
        draft_logits = sequence_logits(draft, tokens, len(prompt))
        if params.greedy:
            blocks.append(positional_greedy(target_logits, draft_logits, width))
            run.chains.append(chain_trace(target_logits, draft_logits, len(prompt), width))
        else:
            P = probabilities(target_logits, params).double().numpy()
            Q = probabilities(draft_logits, params).double().numpy()
            blocks.append(positional_sampled(P, Q, width, paths, seed + index))
        run.prompt_tokens.append(len(prompt))
        run.generated_tokens.append(len(generated))
        if on_prompt is not None:
            on_prompt(len(generated))
    run.per_position = np.concatenate(blocks) if blocks else np.zeros((0, width))
    run.seconds = time.perf_counter() - start
    return run


def run_sequoia_acceptance(target_name: str, draft_name: str, dataset: str, samples: int | None,
                           params: SamplingParams, width: int, max_new_tokens: int, dtype: str, chat: bool,
                           seed: int, paths: int, output: str, log=progress.say,
                           draft_dtype: str | None = None, draft_vocab: int | None = None,
                           backend: str = "auto") -> dict:
    """Measure and write an acceptance/sequoia file; returns its document."""
    from specplan.core.acceptance_schema import SequoiaAcceptance
    from specplan.core.errors import UserError
    from specplan.core.fileio import write_yaml
    from specplan.core.models import check_same_vocabulary, load_model
    from specplan.core.prompts import encode_prompt, uses_chat_template
    from specplan.core.provenance import provenance
    from specplan.decoder.api import load_forward
    from specplan.profiler.datasets import read_dataset, spread_sample

    if width < 1:
        raise UserError(f"the width (child ranks measured) must be >= 1, got {width}")
    if max_new_tokens < 1:
        raise UserError(f"the number of new tokens must be >= 1, got {max_new_tokens}")
    prompts = spread_sample(read_dataset(dataset), samples)
    if not prompts:
        raise UserError(f"{dataset}: no prompts")
    draft_dtype = draft_dtype or dtype
    log(f"loading {target_name} ({dtype}) and {draft_name} ({draft_dtype})")
    target = load_model(target_name, dtype, log=log)
    draft = load_model(draft_name, draft_dtype, log=log)
    check_same_vocabulary(target, draft)
    encoded = [encode_prompt(target.tokenizer, p.text, chat) for p in prompts]
    limit = target.config.max_position_embeddings
    too_long = [p.id for p, ids in zip(prompts, encoded) if len(ids) + max_new_tokens > limit]
    if too_long:
        raise UserError(f"prompt {too_long[0]} plus {max_new_tokens} new tokens exceeds the context of {limit}")
    bar = progress.Steps(len(prompts), "accept", "prompts")
    target_forward = load_forward(target, "cpu", backend=backend)
    log(f"backend: {target_forward.backend}")
    run = measure_sequoia(target_forward, load_forward(draft, "cpu", draft_vocab, backend), encoded, params, width,
                          max_new_tokens, target.stop_token_ids, seed, paths,
                          on_prompt=lambda n: bar.update())
    bar.close()
    acceptance = SequoiaAcceptance(
        positional=run.positional, stderr=run.stderr, target=target.name, draft=draft.name,
        temperature=params.temperature, top_p=params.top_p, samples=int(run.per_position.shape[0]),
        chains=run.chains,
        extra={
            "dtype": dtype,
            "draft_dtype": draft_dtype,
            "backend": target_forward.backend,
            **({"draft_vocab": draft_vocab} if draft_vocab is not None else {}),
            "method": "greedy top-k match" if params.greedy else
                      f"Algorithm 1 without replacement (exact for supports <= {EXACT_SUPPORT}, "
                      f"else {paths} rejection paths; tail mass {TAIL_MASS})",
            "dataset": {"spec": dataset, "prompts": len(prompts),
                        "chat_template": uses_chat_template(target.tokenizer, chat),
                        "categories": sorted({p.category for p in prompts})},
            "max_new_tokens": max_new_tokens,
            "generated_tokens": int(sum(run.generated_tokens)),
            "seed": seed,
            "seconds": round(run.seconds, 1),
            "provenance": provenance(),
        })
    document = acceptance.to_dict()
    write_yaml(output, document)
    return document
