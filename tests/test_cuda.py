"""The GPU path: forwards replayed as CUDA graphs, lossless decoding with them (greedy and sampled), a measured
GPU profile and a GPU bench. Skipped where no CUDA device is present (as in CI); on a GPU machine:
`pytest tests/test_cuda.py`."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest
import torch

from specplan.core.method_settings import RetrievalSettings, TrieSettings
from specplan.core.models import load_model
from specplan.decoder.api import load_forward
from specplan.decoder.batching import Request, Scheduler
from specplan.decoder.cuda_graphs import GRAPH_SIZES, enable_cuda_graphs, graph_size
from specplan.decoder.drafters import NoDrafter, SequoiaDrafter, TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.model import GRAPH_CACHE_SLOTS, ForwardItem, LeanModel, causal_mask
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.trie import Trie
from specplan.decoder.triforce import HierarchicalDrafter, StreamingDrafter

from toy import (
    VOCAB,
    assert_distributed_as_target,
    drafters_per_slot,
    first_tokens_distribution,
    hf_greedy,
    long_prompt,
    sample_first_two,
    toy_model,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def gpu_pair():
    """The tiny pair on the GPU with CUDA graphs; the transformers models stay on the CPU as the reference."""
    target, draft = load_model("tiny-random-llama"), load_model("tiny-random-llama-draft")
    return target, load_forward(target, "cuda"), load_forward(draft, "cuda")


@torch.inference_mode()
def test_graph_replays_match_eager_forwards_on_fresh_caches(gpu_pair):
    loaded, graphed, _ = gpu_pair
    assert graphed.graphed is not None
    eager = LeanModel(loaded.transformers_model(), "cuda")
    prompt = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(0))
    for round_ in range(3):  # a new cache each round: its graphs are its own, never an earlier cache's
        caches = [model.new_cache(128) for model in (graphed, eager)]
        for model, cache in zip((graphed, eager), caches):
            model.prefill(prompt, cache, logits=False)
        for n in (1, 4, 9, 4):
            tokens = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(round_ * 10 + n))
            positions = torch.arange(caches[0].length, caches[0].length + n)
            mask = causal_mask(caches[0].length, n, graphed.dtype, "cuda") if n > 1 else None
            replayed, expected = (model.forward(tokens, positions, cache, mask)
                                  for model, cache in zip((graphed, eager), caches))
            torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)
            for cache in caches:
                cache.commit(None, n)
        # 9 tokens padded to 16
        assert sorted(caches[0].graphs) == [(1, False), (4, False), (16, False)] and not caches[1].graphs
        del caches
        gc.collect()


@pytest.mark.parametrize("parents", [[-1], [-1, 0, 1, 2], [-1, 0, 0, 1, 1, 2, 3, 4, 5]], ids=lambda p: f"n{len(p)}")
def test_greedy_output_equals_transformers_greedy_on_the_gpu(parents, gpu_pair):
    loaded, target, draft = gpu_pair
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, parents) if len(parents) > 1 else None)
    caches = []
    for seed in range(3):
        prompt = torch.randint(0, 256, (int(8 + 5 * seed),), generator=torch.Generator().manual_seed(seed)).tolist()
        result = engine.generate(prompt, 40, SamplingParams())
        assert result.tokens == hf_greedy(loaded, prompt, 40)
        assert result.steps <= 40
        caches.append(engine.cache)
    # Generations of similar lengths keep one cache, so its graphs are captured once; the target forwards the
    # whole static tree each step (the cache is the model's: other tests' engines left their sizes' graphs on it).
    assert caches[0] is caches[1] is caches[2] and caches[0].max_len == GRAPH_CACHE_SLOTS
    assert (graph_size(len(parents), GRAPH_CACHE_SLOTS), False) in caches[0].graphs


def test_prompts_of_mixed_lengths_capture_their_graphs_once_and_ahead(gpu_pair):
    """Lookahead's graphs (a tree of any size up to decoding_length) are captured when a cache is made, and
    prompts alternating between cache sizes replay them instead of capturing anew."""
    loaded, target, _ = gpu_pair
    engine = SpeculativeEngine(target, TrieDrafter(Trie(TrieSettings(8, 3))))
    prompts = [long_prompt(length, seed) for seed, length in enumerate((100, 700, 120, 650))]
    graphs = []
    for prompt in prompts:
        cache = engine.prepare(len(prompt), 40)
        assert {(graph_size(n, cache.max_len), False) for n in range(1, 9)} <= set(cache.graphs)
        graphs.append({key: id(graph) for key, (graph, _) in cache.graphs.items()})
        assert engine.generate(prompt, 40, SamplingParams()).tokens == hf_greedy(loaded, prompt, 40)
        assert engine.cache is cache
    assert graphs[2] == graphs[0] and graphs[3] == graphs[1] and graphs[0] != graphs[1]


@torch.inference_mode()
def test_a_batched_graph_replays_the_eager_batched_forward(gpu_pair):
    """Four sequences of 1 to 5 rows over caches of different lengths and sizes: one batched graph's logits equal
    the eager batched forward's, and a second step of the same shape replays that graph."""
    loaded, graphed, _ = gpu_pair
    eager = LeanModel(loaded.transformers_model(), "cuda")
    for step in range(2):
        scored = []
        for model in (graphed, eager):
            items = []
            for b, (length, n, max_len) in enumerate([(30, 1, 512), (7, 5, 1024), (120, 3, 512), (64, 1, 512)]):
                cache = model.cache_for(max_len, f"batched.{b}", exact=True)
                model.prefill(torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(b)), cache,
                              logits=False)
                tokens = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(10 * step + b))
                mask = causal_mask(length, n, model.dtype, "cuda") if n > 1 else None
                items.append(ForwardItem(tokens, length + torch.arange(n), cache, mask))
            scored.append(model.forward_many(items))
        for replayed, expected in zip(*scored):
            torch.testing.assert_close(replayed, expected, atol=1e-4, rtol=1e-4)
        assert len(graphed.graphed.batch_graphs) == 1


@pytest.mark.parametrize("method", ["one-token", "sequoia"])
def test_requests_sharing_batched_graphs_keep_their_greedy_tokens(method, gpu_pair):
    """Eight requests, four in flight, joining and leaving: every step's forward is one batched graph (the draft's
    levels too), and each request's tokens equal transformers' greedy tokens."""
    loaded, target, draft = gpu_pair

    def make():
        return SequoiaDrafter(draft, [-1, 0, 0, 1, 2]) if method == "sequoia" else NoDrafter()

    prompts = [torch.randint(0, 256, (5 + 7 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(8)]
    requests = [Request(prompt, 12 + 3 * (i % 4)) for i, prompt in enumerate(prompts)]
    target.graphed.batch_graphs.clear()
    results = {c.id: c.result.tokens for c in Scheduler(SpeculativeEngine(target, make()),
                                                        drafters_per_slot(make), 4).run(requests)}
    assert target.graphed.batch_graphs and (method != "sequoia" or draft.graphed.batch_graphs)
    for i, request in enumerate(requests):
        assert results[i] == hf_greedy(loaded, request.prompt, request.max_new_tokens), i


def test_compiled_backend_greedy_equals_transformers_greedy_on_the_gpu():
    """The forward through torch.compile, captured in the graphs: a Sequoia tree and its draft stay exact."""
    target, draft = load_model("tiny-random-llama"), load_model("tiny-random-llama-draft")
    target_forward, draft_forward = (load_forward(m, "cuda", backend="compiled") for m in (target, draft))
    assert target_forward.backend == draft_forward.backend == "compiled"
    engine = SpeculativeEngine(target_forward, SequoiaDrafter(draft_forward, [-1, 0, 0, 1, 2]))
    for seed in range(2):
        prompt = torch.randint(0, 256, (int(8 + 5 * seed),), generator=torch.Generator().manual_seed(seed)).tolist()
        assert engine.generate(prompt, 30, SamplingParams()).tokens == hf_greedy(target, prompt, 30)


@pytest.mark.parametrize("decoding_length, branch_length", [(6, 3), (16, 4)])
def test_trie_greedy_output_equals_transformers_greedy_on_the_gpu(decoding_length, branch_length, gpu_pair):
    """Lookahead's trees change size every step: padded to a few graph sizes, the output stays exact."""
    loaded, target, _ = gpu_pair
    engine = SpeculativeEngine(target, TrieDrafter(Trie(TrieSettings(decoding_length, branch_length))))
    for seed in range(3):
        prompt = long_prompt(120, seed)
        result = engine.generate(prompt, 60, SamplingParams())
        assert result.tokens == hf_greedy(loaded, prompt, 60)
        assert result.tokens_per_step > 1.0
    assert {size for size, _ in engine.cache.graphs} <= set(GRAPH_SIZES)


@pytest.mark.parametrize("bottom", ["trie", "streaming-draft"])
def test_hierarchy_greedy_equals_transformers_greedy_on_the_gpu(bottom, gpu_pair):
    loaded, target, draft = gpu_pair
    make = {"trie": lambda: TrieDrafter(Trie(TrieSettings(decoding_length=4, branch_length=3, window=6))),
            "streaming-draft": lambda: StreamingDrafter(draft, gamma=2, sinks=4, window=64)}[bottom]
    drafter = HierarchicalDrafter(target, make(), 2, 4, RetrievalSettings(384, 8, 16))
    engine = SpeculativeEngine(target, drafter)
    for seed in range(2):
        prompt = long_prompt(400, seed)
        result = engine.generate(prompt, 60, SamplingParams())
        assert result.tokens == hf_greedy(loaded, prompt, 60)
        assert result.tokens_per_step > 1.0
    assert drafter.retrieval.builds >= 4  # built for each prompt and rebuilt along the way
    # The top verify hands out its root's queries from a graph of its own instead of running eagerly.
    assert any(row == 0 for _, row in engine.cache.graphs)


@pytest.fixture(scope="module")
def gpu_toy_pair():
    target_hf, _ = toy_model(10)
    draft_hf, _ = toy_model(10, noise=0.6)
    target, draft = LeanModel(target_hf, "cuda"), LeanModel(draft_hf, "cuda")
    enable_cuda_graphs(target)
    enable_cuda_graphs(draft)
    return target_hf, target, draft


@pytest.mark.parametrize("hierarchy", [False, True], ids=["sequoia", "triforce"])
def test_sampling_on_the_gpu_is_distributed_as_the_target(hierarchy, gpu_toy_pair):
    target_hf, target, draft = gpu_toy_pair
    params = SamplingParams(temperature=1.0)
    prompt = [int(x) for x in np.random.default_rng(32).integers(0, VOCAB, 40)]
    if hierarchy:
        drafter = HierarchicalDrafter(target, StreamingDrafter(draft, gamma=2, sinks=2, window=8), 2, 4,
                                      RetrievalSettings(budget=16, chunk=4, stride=8))
    else:
        drafter = SequoiaDrafter(draft, [-1, 0, 0, 1, 2])
    engine = SpeculativeEngine(target, drafter)  # one engine, so its caches and graphs serve every seed
    counts, accepted = sample_first_two(lambda: engine, prompt, params, 4000)
    assert accepted > 0.2
    assert_distributed_as_target(counts, first_tokens_distribution(target_hf, prompt, params))


def test_measured_gpu_profile(run_cli, tmp_path):
    from specplan.core.profile_schema import load_profile
    from specplan.profiler.latency import _local_gpu_name

    gpu = _local_gpu_name()
    if gpu is None:
        pytest.skip(f"{torch.cuda.get_device_name(0)} is not in the roofline catalogue")
    out = tmp_path / "gpu.yaml"
    code, _, stderr = run_cli("profile", "--target", "tiny-random-llama", "--draft", "tiny-random-llama-draft",
                              "--gpu", gpu, "--contexts", "16,256", "--sizes", "1,2,4,8", "--repeats", "3",
                              "--budgets", "64", "-o", out)
    assert code == 0, stderr
    profile = load_profile(out)
    assert profile.source == "measured"
    assert all(0 < t < 0.1 for t in profile.target_t_seconds.values())
    assert profile.draft_step_seconds > 0 and profile.retrieval_build(256, 64) > 0


def test_bench_on_the_gpu(bench_tiny_sequoia):
    report_path = bench_tiny_sequoia(24, "hf,ours-ar", "--device", "cuda")
    summary = json.loads(report_path.read_text())["summary"]
    for name in ("ours", "ours-ar"):
        assert summary[name]["identical_to_hf"] == summary[name]["compared"] == 2
        assert summary[name]["decode_tokens_per_second"] > 0


@pytest.mark.parametrize("offload", ["weights", "kv"])
def test_offloaded_targets_decode_their_greedy_tokens_on_the_gpu(offload):
    """The target's later layers (weights) or its KV cache (kv) in pinned host memory, copied on a side stream into
    two device buffers every forward (decoder/offload.py): a Sequoia tree verified on it gives transformers' greedy
    tokens, and the copies did happen."""
    target, draft = load_model("tiny-random-llama"), load_model("tiny-random-llama-draft")
    streamed = load_forward(target, "cuda", offload=offload, resident_layers=1 if offload == "weights" else None)
    assert streamed.graphed is None
    engine = SpeculativeEngine(streamed, SequoiaDrafter(load_forward(draft, "cuda"), [-1, 0, 0, 1, 1, 2, 3]))
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    assert engine.generate(prompt, 40, SamplingParams()).tokens == hf_greedy(target, prompt, 40)
    if offload == "weights":
        assert streamed.layer_stream.copied_layers > 0 and streamed.layer_stream.host[0]["wo"].is_pinned()
    else:
        cache = engine.cache
        assert cache.stream.copied_rows > 0 and cache.k.is_pinned() and cache.k.device.type == "cpu"
