"""TriForce: the retrieval cache, the streaming drafter, and the hierarchy's losslessness (greedy and sampled)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoder.drafters import NoDrafter, TrieDrafter
from decoder.engine import SpeculativeEngine
from decoder.sampling import SamplingParams
from decoder.trie import Trie, TrieSettings
from decoder.triforce import HierarchicalDrafter, RetrievalCache, RetrievalSettings, StreamingDrafter
from specplan.errors import UserError

from toy import VOCAB, assert_distributed_as_target, first_two_distribution, hf_greedy, sample_first_two


def long_prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, 256, (12,), generator=gen).tolist()
    body = torch.randint(0, 256, (length,), generator=gen).tolist()
    for start in range(0, length - 12, 97):
        body[start:start + 12] = motif  # repeated passages, as in real documents
    return body


@torch.inference_mode()
def test_retrieval_cache_keeps_sink_tail_and_best_chunks(tiny_pair):
    _, target, _ = tiny_pair
    prompt = long_prompt(203, 0)
    full = target.new_cache(256)
    target.prefill(torch.tensor(prompt), full, logits=False)
    queries = torch.randn(target.shape.layers, target.shape.heads, target.shape.head_dim)
    retrieval = RetrievalCache(target, RetrievalSettings(budget=64, chunk=8), scratch=16)
    retrieval.build(full, queries)
    cache = retrieval.cache
    assert cache.length == 64 + 203 % 8
    group = target.shape.heads // target.shape.kv_heads
    for layer in range(target.shape.layers):
        for head in range(target.shape.kv_heads):
            keys = full.k[layer, head, :200].view(25, 8, -1)
            q = queries[layer, head * group:(head + 1) * group].sum(0)
            scores = keys.mean(1) @ q
            best = [0] + [c for c in torch.argsort(scores[1:], descending=True)[:7].add(1).tolist()]
            expected = torch.cat([keys[c] for c in best] + [full.k[layer, head, 200:203]])
            torch.testing.assert_close(cache.k[layer, head, :cache.length], expected)
    # Inserting overwrites the lowest-ranked slots, from the last one down.
    assert retrieval.insert(full, 195, 198)
    torch.testing.assert_close(cache.k[:, :, 61:64].flip(2), full.k[:, :, 195:198])


def bottoms(target, draft):
    return {
        "streaming-draft": lambda: StreamingDrafter(draft, gamma=2, sinks=4, window=64),
        "trie": lambda: TrieDrafter(Trie(TrieSettings(decoding_length=4, branch_length=3, window=6))),
        "two-level": NoDrafter,
    }


@pytest.mark.parametrize("bottom", ["streaming-draft", "trie", "two-level"])
def test_hierarchy_greedy_equals_transformers_greedy(bottom, tiny_pair):
    loaded, target, draft = tiny_pair
    make = bottoms(target, draft)[bottom]
    for seed, (gamma1, gamma2, budget, chunk, stride) in enumerate([(2, 4, 384, 8, 16), (1, 3, 256, 16, 32)]):
        prompt = long_prompt(400, seed)
        drafter = HierarchicalDrafter(target, make(), gamma1, gamma2, RetrievalSettings(budget, chunk, stride))
        result = SpeculativeEngine(target, drafter).generate(prompt, 60, SamplingParams())
        assert result.tokens == hf_greedy(loaded, prompt, 60)
        assert drafter.retrieval.builds >= 2  # rebuilt along the way
        assert result.tokens_per_step > 1.0


def test_streaming_only_drafter_is_lossless(tiny_pair):
    loaded, target, _ = tiny_pair
    prompt = long_prompt(300, 5)
    drafter = StreamingDrafter(target, gamma=3, sinks=4, window=48)  # the target itself, short window
    result = SpeculativeEngine(target, drafter).generate(prompt, 50, SamplingParams())
    assert result.tokens == hf_greedy(loaded, prompt, 50)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.5, 0.8)])
def test_hierarchy_sampling_is_distributed_as_the_target(temperature, top_p, toy_pair):
    target_hf, target, draft = toy_pair
    params = SamplingParams(temperature=temperature, top_p=top_p)
    prompt = [int(x) for x in np.random.default_rng(32).integers(0, VOCAB, 40)]  # two uncertain tokens
    drafters = []

    def make_engine() -> SpeculativeEngine:
        drafters.append(HierarchicalDrafter(target, StreamingDrafter(draft, gamma=2, sinks=2, window=8), 2, 4,
                                            RetrievalSettings(budget=16, chunk=4, stride=8)))
        return SpeculativeEngine(target, drafters[-1])

    counts, accepted = sample_first_two(make_engine, prompt, params, 4000)
    middle_corrections = np.mean([d.stats["rounds"] > 2 for d in drafters])  # a middle rejection cut a round
    assert accepted > 0.2 and middle_corrections > 0.1
    assert_distributed_as_target(counts, first_two_distribution(target_hf, prompt, params))


@pytest.mark.parametrize("settings, gammas, message", [
    (RetrievalSettings(budget=60, chunk=8), (2, 4), "does not divide"),
    (RetrievalSettings(budget=512, chunk=8), (2, 4), "not below the context"),
    (RetrievalSettings(budget=64, chunk=8), (4, 2), "gamma1 <= gamma2"),
])
def test_bad_settings(settings, gammas, message, tiny_pair):
    _, target, _ = tiny_pair
    with pytest.raises(UserError, match=message):
        drafter = HierarchicalDrafter(target, NoDrafter(), *gammas, settings)
        SpeculativeEngine(target, drafter).generate(long_prompt(300, 0), 4, SamplingParams())
