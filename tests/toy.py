"""Shared test helpers: toy models over a tiny vocabulary, transformers' greedy reference, chi-square checks."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, PretrainedConfig

from specplan.decoder.model import LeanModel
from specplan.decoder.sampling import SamplingParams


def hf_greedy(loaded, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate; the explicit attention mask keeps it from masking pad-valued tokens."""
    ids = torch.tensor([prompt])
    out = loaded.transformers_model().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                               do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def long_prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, 256, (12,), generator=gen).tolist()
    body = torch.randint(0, 256, (length,), generator=gen).tolist()
    for start in range(0, length - 12, 97):
        body[start:start + 12] = motif  # repeated passages, as in real documents
    return body


VOCAB = 6
# Generations per distribution test: at this count the chi-square test tells the draft's distribution from the
# target's at p < 1e-6 (test_decoder.py: test_chi_square_detects_a_wrong_distribution)
SAMPLES = 3000
# Requests in flight when a distribution test draws its samples through the batching scheduler: a toy model's step
# is Python-bound, and 16 requests sharing each step drew samples fastest (2.3x one at a time; 64 was slower)
SAMPLE_CONCURRENCY = 16


def toy_config(family: str = "llama") -> PretrainedConfig:
    """A one-layer model over VOCAB tokens. Its widths are not whole 32-value blocks, so it runs on PyTorch's
    operators (the GPU's forward) on a CPU too; `llama-32`'s are: the CPU kernels run it, and its weights quantize to
    GGUF block types."""
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.5, tie_word_embeddings=False)
    if family == "llama-32":
        return LlamaConfig(**dict(common, hidden_size=32, intermediate_size=64))
    if family == "llama3":  # Llama 3.1's RoPE scaling, from an original context of 8
        return LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8})
    if family == "gemma2":  # soft caps small enough to bend the distributions
        return Gemma2Config(**common, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                            layer_types=["sliding_attention"], attn_logit_softcapping=1.5, final_logit_softcapping=2.0)
    return LlamaConfig(**common)


def toy_model(seed: int, noise: float = 0.0, family: str = "llama") -> tuple[AutoModelForCausalLM, LeanModel]:
    """Random logits over a toy vocabulary; `noise` perturbs the weights (a draft close to the target)."""
    config = toy_config(family)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(noise * parameter.std() * torch.randn_like(parameter))
    return model, LeanModel(model)


def assert_sequoia_samples_follow_the_target(target_hf, target, draft, rule: str) -> None:
    """The first two sampled tokens of a small Sequoia tree, verified by `rule`, follow transformers'
    distribution of `target_hf` (chi-square), and the draft was accepted often enough to matter. The samples share
    their steps through the batching scheduler."""
    from specplan.decoder.drafters import SequoiaDrafter
    from specplan.decoder.engine import SpeculativeEngine

    params = SamplingParams(temperature=0.8, top_p=0.95)
    prompt = [1, 4, 2, 5, 3]
    parents = [-1, 0, 0, 1, 1, 2, 3]
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, parents), rule=rule)
    counts, accepted = sample_first_tokens_batched(engine, lambda: SequoiaDrafter(draft, parents), prompt, params,
                                                SAMPLES)
    assert accepted > 0.2
    assert_distributed_as_target(counts, first_tokens_distribution(target_hf, prompt, params))


def sample_first_two(make_engine, prompt: list[int], params: SamplingParams, samples: int
                     ) -> tuple[np.ndarray, float]:
    """Counts of the first two generated tokens over `samples` seeds, and the share of first drafted steps that
    accepted a draft token."""
    counts = np.zeros((VOCAB, VOCAB))
    accepted = 0
    for seed in range(samples):
        result = make_engine().generate(prompt, 2, params, seed=seed)
        counts[result.tokens[0], result.tokens[1]] += 1
        accepted += first_drafted_step_accepted(result)
    return counts, accepted / samples


def first_drafted_step_accepted(result) -> bool:
    """Whether the generation's first step that scored draft tokens accepted one (a TriForce sequence's first step
    is plain)."""
    drafted = next((i for i, n in enumerate(result.drafted_per_step) if n > 0), None)
    return drafted is not None and result.accepted_per_step[drafted] > 1


def drafters_per_slot(make_drafter, first=None):
    """A drafter per batch slot (`first` for slot 0 if given), kept across the requests the slot serves, as
    Decoder.drafter_for_slot keeps them."""
    made = {} if first is None else {0: first}

    def drafter_for_slot(slot: int):
        if slot not in made:
            made[slot] = make_drafter()
            made[slot].use_slot(slot)
        return made[slot]

    return drafter_for_slot


def sample_first_tokens_batched(engine, make_drafter, prompt: list[int], params: SamplingParams, samples: int,
                                concurrency: int = SAMPLE_CONCURRENCY, tokens: int = 2) -> tuple[np.ndarray, float]:
    """sample_first_two through the continuous-batching scheduler, for the first `tokens` tokens (counts of
    VOCAB ** tokens): `concurrency` samples share every step (each its own seed, drafter and cache), as requests of
    a server do."""
    from specplan.decoder.batching import Request, Scheduler

    counts = np.zeros((VOCAB,) * tokens)
    accepted = 0
    scheduler = Scheduler(engine, drafters_per_slot(make_drafter, engine.drafter), concurrency)
    for completion in scheduler.run([Request(prompt, tokens, params, seed) for seed in range(samples)]):
        result = completion.result
        counts[tuple(result.tokens[:tokens])] += 1
        accepted += first_drafted_step_accepted(result)
    return counts, accepted / samples


def assert_distributed_as_target(counts: np.ndarray, expected: np.ndarray) -> None:
    later = tuple(range(1, counts.ndim))
    assert chi_square_p(counts.sum(later), expected.sum(later)) > 1e-3  # the first token
    assert chi_square_p(counts, expected) > 1e-3  # the first tokens together


def transformers_distribution(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """The next-token distribution transformers' sampling draws from: its own warpers, in the order its generate
    applies them (temperature, top-k, top-p), then a softmax. The reference of every distribution test, so that the
    decoder's own warping (decoder/sampling.py) is checked against transformers', not against itself."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    scores = warpers(torch.zeros(1, 1, dtype=torch.long), logits.float().reshape(1, -1))
    return torch.softmax(scores.double(), -1)[0].numpy()


def first_tokens_distribution(model: AutoModelForCausalLM, prompt: list[int], params: SamplingParams,
                              tokens: int = 2) -> np.ndarray:
    """The joint distribution of the first `tokens` sampled tokens ([VOCAB] * tokens), as transformers samples them
    from `model`."""
    with torch.inference_mode():
        first = transformers_distribution(model(torch.tensor([prompt])).logits[0, -1], params)
    if tokens == 1:
        return first
    joint = np.zeros((VOCAB,) * tokens)
    for x in range(VOCAB):
        if first[x] > 0:
            joint[x] = first[x] * first_tokens_distribution(model, prompt + [x], params, tokens - 1)
    return joint


def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    counts, expected = counts.ravel(), expected_probs.ravel() * counts.sum()
    assert counts[expected == 0].sum() == 0, "a token with zero target probability was emitted"
    keep = expected >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    wanted = np.append(expected[keep], expected[~keep].sum())
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    return float(chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue)


def tree_mask(parents: list[int], prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(parents)
    depth = [0] * n
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for v in range(n):
        allowed[v, v] = True
        if parents[v] >= 0:
            depth[v] = depth[parents[v]] + 1
            allowed[v] |= allowed[parents[v]]
    mask = torch.zeros(n, prefix + n)
    mask[:, prefix:] = torch.where(allowed, 0.0, float("-inf"))
    return mask, torch.tensor(depth)


def one_error(stderr: str) -> bool:
    """A CLI failure as the CLI prints it: exactly one error line, the last, beginning `plan: error:` (progress lines
    may precede it), and no traceback."""
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("plan: error:")]
    return len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in stderr
