"""The decoder's lean forward against transformers: chunked prefill, tree masks, compaction, static layout."""

from __future__ import annotations

import pytest
import torch

import specplan.decoder.model as model_module
from specplan.core.errors import UserError
from specplan.core.models import load_model
from specplan.decoder.model import LeanModel, causal_mask

from toy import tree_mask


@pytest.fixture(scope="module", params=[(name, kernels) for name in ("tiny-random-llama", "tiny-random-qwen2")
                                        for kernels in (True, False)],
                ids=lambda param: f"{param[0]}-{'kernels' if param[1] else 'operators'}")
def models(request):
    """A tiny model on either CPU forward: the kernels, and PyTorch's operators (the GPU's forward)."""
    name, kernels = request.param
    loaded = load_model(name)
    lean = LeanModel(loaded.model, kernels=kernels)
    assert (lean.kernels is not None) == kernels
    return loaded, lean


def reference_logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(ids[None]).logits[0]


@torch.inference_mode()
def test_chunked_prefill_then_single_steps_match_transformers(models):
    loaded, lean = models
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0))
    ref = reference_logits(loaded, ids)
    cache = lean.new_cache(64)
    last = lean.prefill(ids[:37], cache, chunk=8)
    torch.testing.assert_close(last, ref[36], atol=2e-5, rtol=1e-5)
    for t in range(37, 50):
        logits = lean.forward(ids[t:t + 1], torch.tensor([cache.length]), cache, None)[0]
        cache.commit(None, 1)
        torch.testing.assert_close(logits, ref[t], atol=2e-5, rtol=1e-5)


@torch.inference_mode()
def test_tree_forward_scores_every_branch_like_a_sequence(models):
    """Each tree node's logits equal those of its root path scored as a plain sequence."""
    loaded, lean = models
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 256, (20,), generator=gen)
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]
    tokens = torch.randint(0, 256, (len(parents),), generator=gen)
    cache = lean.new_cache(40)
    lean.prefill(prefix, cache)
    mask, depth = tree_mask(parents, cache.length)
    logits = lean.forward(tokens, cache.length + depth, cache, mask)
    for v in range(len(parents)):
        path, u = [], v
        while u >= 0:
            path.append(int(tokens[u]))
            u = parents[u]
        ref = reference_logits(loaded, torch.cat([prefix, torch.tensor(path[::-1])]))[-1]
        torch.testing.assert_close(logits[v], ref, atol=2e-5, rtol=1e-5)

    # Accept the path 0 -> 2 -> 5 and continue: the cache must hold exactly prefix + that path.
    cache.commit(torch.tensor([0, 2, 5]), 3)
    nxt = torch.tensor([7])
    step = lean.forward(nxt, torch.tensor([cache.length]), cache, None)[0]
    ref = reference_logits(loaded, torch.cat([prefix, tokens[[0, 2, 5]], nxt]))[-1]
    torch.testing.assert_close(step, ref, atol=2e-5, rtol=1e-5)


@torch.inference_mode()
def test_static_layout_matches_dynamic(models):
    _, lean = models
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2))
    dynamic = lean.new_cache(48)
    lean.prefill(ids[:24], dynamic)
    static = lean.new_cache(48)
    lean.prefill(ids[:24], static)
    n = 6
    positions = torch.arange(24, 24 + n)
    expected = lean.forward(ids[24:], positions, dynamic, causal_mask(24, n, lean.dtype, "cpu"))
    mask = torch.full((n, 48), float("-inf"))
    mask[:, :24 + n] = causal_mask(24, n, lean.dtype, "cpu")
    got = lean.forward(ids[24:], positions, static, mask, slots=positions.clone())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_limited_vocabulary_scores_only_the_kept_ids(models):
    loaded, full = models
    limited = LeanModel(loaded.model)
    limited.limit_vocabulary(100, always=[258])
    assert limited.lm_head.shape[0] == 101
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(3))
    expected = full.prefill(ids, full.new_cache(32))
    logits = limited.prefill(ids, limited.new_cache(32))
    kept = torch.zeros(full.shape.vocab, dtype=torch.bool)
    kept[:100] = kept[258] = True
    torch.testing.assert_close(logits[kept], expected[kept], atol=1e-5, rtol=1e-5)
    assert torch.isneginf(logits[~kept]).all()
    with pytest.raises(UserError, match="already limited"):
        limited.limit_vocabulary(50)
    with pytest.raises(UserError, match="outside"):
        LeanModel(loaded.model).limit_vocabulary(full.shape.vocab + 1)


@pytest.mark.parametrize("kernels", [False, True])
@torch.inference_mode()
def test_bf16_model_matches_transformers_on_either_cpu_forward(kernels):
    """PyTorch's operators and the CPU kernels (which read bf16 on any host) both keep a bf16 model's keys and
    values in bf16, and its logits are transformers' bf16 logits up to bf16 rounding, for a prefill in 16-row
    chunks, single steps and a masked block."""
    loaded = load_model("tiny-random-llama", "bf16")
    lean = LeanModel(loaded.model, kernels=kernels)
    assert (lean.kernels is not None) == kernels
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(5))
    ref = reference_logits(loaded, ids).float()
    cache = lean.new_cache(64)
    assert cache.k.dtype == torch.bfloat16
    rows = [lean.prefill(ids[:30], cache, chunk=16)]
    for t in range(30, 40):
        rows.append(lean.forward(ids[t:t + 1], torch.tensor([cache.length]), cache, None)[0])
        cache.commit(None, 1)
    rows += list(lean.forward(ids[40:], torch.arange(40, 48), cache, causal_mask(40, 8, lean.dtype, "cpu")))
    logits = torch.stack(rows).float()
    assert torch.stack(rows).dtype == torch.bfloat16
    torch.testing.assert_close(logits, ref[29:], atol=0.125, rtol=0.02)  # a few bf16 steps (1/32 at 4-8)
    assert (logits.argmax(-1) == ref[29:].argmax(-1)).float().mean() >= 0.9


def test_caches_are_kept_per_role_and_grow_in_blocks():
    """cache_for hands a role its kept cache, emptied: without CUDA graphs one per role, serving any sequence it holds
    and replaced by a larger one in whole CACHE_BLOCK_SLOTS (a server slot's prefix copied along); with graphs up to
    KEPT_GRAPH_CACHES sizes (the graphs captured over a cache live on it), least recently used out."""
    lean = LeanModel(load_model("tiny-random-llama").model)
    block = model_module.CACHE_BLOCK_SLOTS
    target = lean.cache_for(100, "target")
    assert target.max_len == block
    target.length = 7
    assert lean.cache_for(100, "target") is target and target.length == 0
    draft = lean.cache_for(100, "draft")
    assert draft is not target and lean.cache_for(block, "target") is target  # any sequence the cache holds
    assert lean.cache_for(100, "streaming", exact=True).max_len == 100
    target.k[:, :, :50], target.length, target.held = 1.0, 50, list(range(50))
    grown = lean.cache_for(block + 1, "target", keep=True)
    assert grown.max_len == 2 * block and grown.length == 50 and grown.held == target.held
    assert bool((grown.k[:, :, :50] == 1.0).all()) and bool((grown.k[:, :, 50:] == 0.0).all())
    assert lean.cache_for(100, "target") is grown and grown.length == 0  # one kept: the larger
    assert lean.cache_for(3 * block - 9, "target").max_len == 3 * block
    assert model_module.cache_slots(3 * block - 9, 3 * block - 5) == 3 * block - 5  # within the model's context

    lean.graphed = object()  # cache_for only asks whether graphs are on; no GPU needed to check what it keeps
    sizes = [model_module.GRAPH_CACHE_SLOTS * k for k in range(1, model_module.KEPT_GRAPH_CACHES + 2)]
    kept = {size: lean.cache_for(size - 5, "target") for size in sizes[:-1]}  # rounded up to the slot multiple
    assert [cache.max_len for cache in kept.values()] == sizes[:-1]
    assert all(lean.cache_for(size, "target") is kept[size] for size in sizes[:-1])  # alternating: no new cache
    lean.cache_for(sizes[-1], "target")  # one size more: the least recently used (the first) goes
    assert lean.cache_for(sizes[1], "target") is kept[sizes[1]]
    assert lean.cache_for(sizes[0], "target") is not kept[sizes[0]]
