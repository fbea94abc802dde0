"""Every architecture and RoPE variant of the lean forward, and the transformers backend on architectures the lean
forward does not run (GPT-NeoX, OLMo-2) and on Llama as a cross-check, against transformers' own model in fp32.

The reference is the target's own decoding as transformers runs it: the prompt in one forward, then one token per
forward over its cache (for RoPE variants that depend on the sequence length, that is what fixes each token's
rotation; Phi-3's generate re-encodes the whole sequence once it outgrows the original context). The tiny models
run past their RoPE's original context (64) and their sliding windows (16, 32).
"""

from __future__ import annotations

import pytest
import torch

from specplan.core.method_settings import TrieSettings
from specplan.core.models import TINY_FAMILIES, TINY_GENERIC_FAMILIES, TINY_ORIGINAL_CONTEXT, load_model
from specplan.decoder.api import load_forward
from specplan.decoder.drafters import SequoiaDrafter, TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.model import LeanModel
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.trie import Trie

from toy import assert_sequoia_samples_follow_the_target, hf_greedy, toy_model, tree_mask

NEW_FAMILIES = [f for f in TINY_FAMILIES if f not in ("llama", "qwen2")]  # those two: tests/test_lean_model.py
# lean: the CPU kernels; operators: the lean forward on PyTorch's operators (a GPU's, and a CPU's without a compiler).
# The edit loop (make test-fast) runs every family on the kernels; the other backends' sweeps are `slow`.
CASES = ([pytest.param((f, "lean"), id=f"{f}-lean") for f in NEW_FAMILIES]
         + [pytest.param((f, "operators"), id=f"{f}-operators", marks=pytest.mark.slow) for f in NEW_FAMILIES]
         + [pytest.param((f, "transformers"), id=f"{f}-transformers", marks=pytest.mark.slow)
            for f in TINY_GENERIC_FAMILIES + ("llama",)])
PROMPT_LENGTH = TINY_ORIGINAL_CONTEXT - 4  # the tree and the steps cross the original context and the windows
TREE_PROMPT_LENGTH = TINY_ORIGINAL_CONTEXT - 2  # the tree's deeper nodes lie past the original context
ATOL = 1e-4


@pytest.fixture(scope="module", params=CASES)
def family(request):
    """(family, loaded model, the forward under test)."""
    name, backend = request.param
    loaded = load_model(f"tiny-random-{name}")
    return name, loaded, forward_on(loaded, backend)


def forward_on(loaded, backend: str):
    if backend == "operators":
        forward = LeanModel(loaded.model, kernels=False)
        assert forward.kernels is None
        return forward
    forward = load_forward(loaded, "cpu", backend=backend)
    assert forward.backend == backend and (backend != "lean" or forward.kernels is not None)
    return forward


def random_ids(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (count,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def reference_logits(loaded, prompt: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """transformers: the prompt in one forward, then each continuation token in its own forward over the cache;
    the logits after the prompt and after each continuation token ([1 + len(continuation), vocab])."""
    model = loaded.transformers_model()  # the lean forward under test freed the loaded copy
    out = model(prompt[None], use_cache=True)
    rows, cache = [out.logits[0, -1]], out.past_key_values
    sequence = prompt.tolist()
    for token in continuation.tolist():
        sequence.append(token)
        if loaded.config.model_type == "phi3" and len(sequence) > TINY_ORIGINAL_CONTEXT:
            # Phi-3's generate scores a sequence past the original context over all of it, re-encoded
            rows.append(model(torch.tensor([sequence])).logits[0, -1])
            continue
        out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
        rows.append(out.logits[0, -1])
        cache = out.past_key_values
    return torch.stack(rows)


@torch.inference_mode()
def test_prefill_and_single_steps_match_transformers(family):
    name, loaded, lean = family
    ids = random_ids(PROMPT_LENGTH + 40, 0)
    reference = reference_logits(loaded, ids[:PROMPT_LENGTH], ids[PROMPT_LENGTH:])
    cache = lean.new_cache(len(ids))
    last = lean.prefill(ids[:PROMPT_LENGTH], cache, chunk=24)
    torch.testing.assert_close(last, reference[0], atol=ATOL, rtol=1e-4)
    for t in range(PROMPT_LENGTH, len(ids)):
        logits = lean.forward(ids[t:t + 1], torch.tensor([cache.length]), cache, None)[0]
        cache.commit(None, 1)
        torch.testing.assert_close(logits, reference[t - PROMPT_LENGTH + 1], atol=ATOL, rtol=1e-4,
                                   msg=lambda m, t=t: f"{name}, position {t}: {m}")


@torch.inference_mode()
def test_tree_forward_and_a_non_contiguous_commit_match_transformers(family):
    """A tree scored in one forward across the original context: each node's logits are those of its root path
    decoded token by token; after committing the path 0 -> 2 -> 5 -> 8, the next step's are the path's."""
    name, loaded, lean = family
    prompt = random_ids(TREE_PROMPT_LENGTH, 1)
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 5, 8]
    tokens = random_ids(len(parents), 2)
    cache = lean.new_cache(TREE_PROMPT_LENGTH + 40)
    lean.prefill(prompt[:-1], cache, prompt_length=TREE_PROMPT_LENGTH)
    tokens[0] = prompt[-1]  # the root is the prompt's last token, as the engine scores it
    mask, depth = tree_mask(parents, cache.length)
    logits = lean.forward(tokens, cache.length + depth, cache, mask)
    for v in range(len(parents)):
        path, u = [], v
        while u > 0:
            path.append(int(tokens[u]))
            u = parents[u]
        reference = reference_logits(loaded, prompt, torch.tensor(path[::-1], dtype=torch.long))[-1]
        torch.testing.assert_close(logits[v], reference, atol=ATOL, rtol=1e-4,
                                   msg=lambda m, v=v: f"{name}, node {v}: {m}")
    kept = [0, 2, 5, 8]
    cache.commit(torch.tensor(kept), len(kept))
    following = random_ids(12, 3)
    reference = reference_logits(loaded, prompt, torch.cat([tokens[kept[1:]], following]))
    for i, token in enumerate(following.tolist()):
        step = lean.forward(torch.tensor([token]), torch.tensor([cache.length]), cache, None)[0]
        cache.commit(None, 1)
        torch.testing.assert_close(step, reference[len(kept) + i], atol=ATOL, rtol=1e-4,
                                   msg=lambda m, i=i: f"{name}, step {i} after the commit: {m}")


@pytest.mark.parametrize("drafter", ["sequoia", "lookahead"])
def test_greedy_speculation_equals_transformers_generate(family, drafter):
    """64 new tokens from a prompt just short of the original context: a Sequoia tree with the family's tiny draft,
    and a Lookahead trie, both token-identical to transformers' greedy generate."""
    name, loaded, lean = family
    prompt = random_ids(PROMPT_LENGTH, 4).tolist()
    expected = hf_greedy(loaded, prompt, 64)
    if drafter == "sequoia":
        backend = "operators" if isinstance(lean, LeanModel) and lean.kernels is None else lean.backend
        draft = forward_on(load_model(f"tiny-random-{name}-draft"), backend)
        proposer = SequoiaDrafter(draft, [-1, 0, 0, 1, 1, 2, 3, 5])
    else:
        proposer = TrieDrafter(Trie(TrieSettings.sized(8, 4)))
    engine = SpeculativeEngine(lean, proposer)
    result = engine.generate(prompt, 64, SamplingParams())
    assert result.tokens == expected[:len(result.tokens)] and len(result.tokens) == 64
    if drafter == "sequoia":
        assert sum(result.accepted_per_step) > len(result.accepted_per_step)  # it speculated, and was accepted


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "gemma2"])
@pytest.mark.parametrize("rule", ["sequoia", "specinfer"])
def test_sampled_output_is_distributed_as_the_target(family, rule):
    """Llama 3.1's RoPE and Gemma 2's soft caps and window (4 tokens, the prompt and tree run past it): the first
    two sampled tokens of a Sequoia tree, verified by either rule, follow transformers' distribution (chi-square)."""
    target_hf, target = toy_model(10, family=family)
    _, draft = toy_model(10, noise=0.3, family=family)
    assert_sequoia_samples_follow_the_target(target_hf, target, draft, rule)
