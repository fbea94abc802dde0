"""Many requests at once: the batched forward, the continuous-batching scheduler, and a request's output not
depending on who shares its steps (greedy identity, sampled distributions)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from specplan.core.choices import DEFAULT_PROMPT_CACHE_MIB
from specplan.core.method_settings import RetrievalSettings, TrieSettings
from specplan.core.models import load_model
from specplan.decoder.batching import Request, Scheduler
from specplan.decoder.cuda_graphs import batch_buffers, batch_logits, graph_size, stage_batch, static_items
from specplan.decoder.drafters import NoDrafter, SequoiaDrafter, TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.model import ForwardItem, KVCache, LeanModel, causal_mask, prefill_together
from specplan.decoder.prompt_cache import PromptCache
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.tree import DETERMINISTIC
from specplan.decoder.trie import Trie
from specplan.decoder.triforce import HierarchicalDrafter, StreamingDrafter

from toy import (
    SAMPLES,
    VOCAB,
    assert_distributed_as_target,
    drafters_per_slot,
    first_tokens_distribution,
    hf_greedy,
    long_prompt,
    one_error,
    toy_model,
)

PROMPT_LENGTHS = (5, 17, 40, 9, 23, 3, 60, 11)  # eight requests of different lengths and finish times
NEW_TOKENS = (20, 7, 30, 15, 25, 12, 18, 9)


def drafters(target, draft) -> dict:
    shared = Trie(TrieSettings(decoding_length=8, branch_length=3))
    return {
        "one-token": NoDrafter,
        "lookahead": lambda: TrieDrafter(Trie(TrieSettings(decoding_length=8, branch_length=3))),
        "lookahead-shared": lambda: TrieDrafter(shared, shared=True),
        "sequoia": lambda: SequoiaDrafter(draft, [-1, 0, 0, 1, 2, 3]),
    }


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@torch.inference_mode()
@pytest.mark.parametrize("kernels", [True, False])
def test_a_batched_forward_scores_each_sequence_as_its_own_forward(kernels, tiny_pair):
    """Sequences of 1 to 5 rows over caches of different lengths, one forward: each item's logits equal that item
    scored alone (the rows share every matmul; the CPU kernels: one ragged attention call; PyTorch's operators, a
    GPU's forward: attention per sequence)."""
    loaded, target, _ = tiny_pair
    target = target if kernels else LeanModel(loaded.model, kernels=False)
    assert (target.kernels is not None) == kernels
    items, alone = [], []
    for b, (length, n) in enumerate([(30, 1), (7, 5), (120, 3), (64, 1)]):
        for copy in (items, alone):
            cache = target.cache_for(256, f"test.{len(items) + len(alone)}")
            target.prefill(torch.randint(0, 250, (length,), generator=torch.Generator().manual_seed(b)), cache,
                           logits=False)
            tokens = torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(10 + b))
            mask = causal_mask(length, n, target.dtype, "cpu") if n > 1 else None
            copy.append(ForwardItem(tokens, length + torch.arange(n), cache, mask))
    together = target.forward_many(items)
    for item, scored, single in zip(items, together, alone):
        torch.testing.assert_close(scored, target.forward(*single), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(item.cache.k[:, :, :item.cache.length + item.tokens.shape[0]],
                                   single.cache.k[:, :, :single.cache.length + single.tokens.shape[0]])


@torch.inference_mode()
def test_a_batched_graphs_static_layout_scores_each_sequence_as_its_own_forward(tiny_pair):
    """What a batched CUDA graph computes (decoder/cuda_graphs.py: GraphedForward.many), run eagerly on the CPU: the
    items staged into one graph's buffers (rows padded to the graph's count, masks over every cache slot, caches
    of different sizes), the static-layout forward over all of them, each item's logits taken out: equal to each
    item scored alone, and each cache's new keys where the dynamic forward writes them."""
    loaded, _, _ = tiny_pair
    target = LeanModel(loaded.model, kernels=False)
    items, alone = [], []
    for b, (length, n, max_len) in enumerate([(30, 1, 256), (7, 5, 512), (120, 3, 256), (64, 1, 128)]):
        for copy in (items, alone):
            cache = target.cache_for(max_len, f"static.{len(items) + len(alone)}")
            target.prefill(torch.randint(0, 250, (length,), generator=torch.Generator().manual_seed(b)), cache,
                           logits=False)
            tokens = torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(10 + b))
            mask = causal_mask(length, n, target.dtype, "cpu") if n > 1 else None
            copy.append(ForwardItem(tokens, length + torch.arange(n), cache, mask, slice(n - 1, n) if b == 1 else None))
    caches = [item.cache for item in items]
    rows = graph_size(5, min(cache.max_len - cache.length for cache in caches))
    assert rows == 8
    buffers = batch_buffers(caches, rows, target.device, target.dtype)
    stage_batch(buffers, items, rows)
    logits = torch.cat(target._forward_operators(static_items(buffers, caches, rows), buffers["slots"]))
    for item, scored, single in zip(items, batch_logits(logits, items, rows), alone):
        torch.testing.assert_close(scored, target.forward(*single), rtol=1e-4, atol=1e-4)
        end = item.cache.length + item.tokens.shape[0]
        torch.testing.assert_close(item.cache.k[:, :, :end], single.cache.k[:, :, :end])


@torch.inference_mode()
def test_prompts_prefilled_together_fill_each_cache_as_a_prefill_alone(tiny_pair):
    _, target, _ = tiny_pair
    pieces = [torch.tensor(p[:-1]) for p in prompts()[:4]]
    together = [target.cache_for(256, f"together.{i}") for i in range(4)]
    prefill_together(target, pieces, together, [len(p) + 1 for p in pieces])
    for i, (tokens, cache) in enumerate(zip(pieces, together)):
        alone = target.cache_for(256, f"alone.{i}")
        target.prefill(tokens, alone, logits=False, prompt_length=len(tokens) + 1)
        assert cache.length == alone.length == len(tokens) and cache.prompt_length == alone.prompt_length
        torch.testing.assert_close(cache.k[:, :, :cache.length], alone.k[:, :, :alone.length], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[:, :, :cache.length], alone.v[:, :, :alone.length], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["one-token", "lookahead", "lookahead-shared", "sequoia"])
@pytest.mark.parametrize("concurrency", [3, 8])
def test_every_request_gets_its_own_greedy_tokens_under_load(method, concurrency, tiny_pair):
    """Eight requests of different lengths and finish times, three (or all eight) in flight, the rest joining as
    others leave: each request's greedy tokens equal its own one-request greedy tokens and transformers'."""
    loaded, target, draft = tiny_pair
    make = drafters(target, draft)[method]
    requests = [Request(p, n) for p, n in zip(prompts(), NEW_TOKENS)]
    engine = SpeculativeEngine(target, make())
    scheduler = Scheduler(engine, drafters_per_slot(make), concurrency)
    order, results = [], {}
    for completion in scheduler.run(requests):
        assert completion.error is None
        order.append(completion.id)
        results[completion.id] = completion.result.tokens
    assert order != sorted(order) or concurrency == 1  # requests finished out of order: they shared steps
    for i, request in enumerate(requests):
        assert results[i] == SpeculativeEngine(target, make()).generate(request.prompt, request.max_new_tokens,
                                                                        SamplingParams()).tokens
    for i in (1, 6):
        assert results[i] == hf_greedy(loaded, requests[i].prompt, requests[i].max_new_tokens)


@pytest.mark.parametrize("method", ["one-token", "lookahead", "sequoia"])
def test_prompts_prefilled_in_chunks_along_the_decode_steps_keep_every_request_its_own_tokens(method, tiny_pair):
    """Chunked prefill: a joining request's prompt enters its cache 16 tokens a step, in the same forwards as the
    running sequences' trees (a 60-token prompt over four steps, the others decoding meanwhile); every request's
    greedy tokens equal its own one-request greedy tokens."""
    _, target, draft = tiny_pair
    make = drafters(target, draft)[method]
    requests = [Request(p, n) for p, n in zip(prompts(3), NEW_TOKENS)]
    scheduler = Scheduler(SpeculativeEngine(target, make()), drafters_per_slot(make), 3, prefill_chunk=16)
    rows = []
    forward_many = target.forward_many
    target.forward_many = lambda items: rows.append(
        [(item.tokens.shape[0], item.logits_rows == slice(0, 0)) for item in items]) or forward_many(items)
    try:
        results = {c.id: c.result.tokens for c in scheduler.run(requests)}
    finally:
        del target.forward_many
    chunks = [sum(n for n, prompt in step if prompt) for step in rows]
    assert max(chunks) == 16 and all(0 <= c <= 16 for c in chunks)
    assert any(c == 16 and any(not prompt for _, prompt in step) for c, step in zip(chunks, rows))  # beside trees
    for i, request in enumerate(requests):
        assert results[i] == SpeculativeEngine(target, make()).generate(request.prompt, request.max_new_tokens,
                                                                        SamplingParams()).tokens, i


def counted_prefills(target, monkeypatch) -> list[int]:
    """The prompt tokens each prefill of `target` computes, alone, batched or in chunks along the steps, appended as
    they run."""
    import specplan.decoder.batching as batching

    prefilled: list[int] = []
    alone, together, chunk = target.prefill, batching.prefill_together, batching.prompt_item
    monkeypatch.setattr(target, "prefill", lambda tokens, *a, **k: prefilled.append(len(tokens)) or alone(
        tokens, *a, **k))
    monkeypatch.setattr(batching, "prefill_together", lambda model, pieces, *a: prefilled.extend(
        len(p) for p in pieces) or together(model, pieces, *a))
    monkeypatch.setattr(batching, "prompt_item", lambda model, tokens, cache: prefilled.append(len(tokens)) or chunk(
        model, tokens, cache))
    return prefilled


@pytest.mark.parametrize("method", ["one-token", "lookahead", "sequoia"])
def test_a_slot_keeps_the_prefix_a_next_prompt_shares_and_the_tokens_stay_its_own(method, tiny_pair, monkeypatch):
    """Prompts sharing a 20-token head (a chat template's system turn), one repeating an earlier prompt exactly, one
    continuing an earlier prompt and its output (a conversation's next turn), two slots: the slots prefill only
    what their caches do not hold, and every request's greedy tokens equal its own one-request greedy tokens.
    A one-request generation in between (slot 0's cache) leaves no stale prefix behind."""
    _, target, draft = tiny_pair
    make = drafters(target, draft)[method]
    gen = torch.Generator().manual_seed(7)
    head = torch.randint(0, 250, (20,), generator=gen).tolist()
    tails = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (6, 11, 3, 9)]
    prefilled = counted_prefills(target, monkeypatch)
    engine = SpeculativeEngine(target, make())
    scheduler = Scheduler(engine, drafters_per_slot(make), 2)
    requests = [Request(head + tail, 12) for tail in tails]
    results = {c.id: c.result.tokens for c in scheduler.run(requests)}
    requests += [Request(requests[3].prompt, 10), Request(requests[1].prompt + results[1] + tails[0], 12)]
    results.update({c.id: c.result.tokens for c in scheduler.run(requests[4:])})
    assert sum(prefilled) < sum(len(r.prompt) - 1 for r in requests) - 40  # the heads were not computed again
    engine.generate(list(reversed(head)) + tails[2], 5, SamplingParams())  # slot 0's cache, taken and refilled
    requests.append(Request(head + tails[2], 9))
    results.update({c.id: c.result.tokens for c in scheduler.run(requests[6:])})
    monkeypatch.undo()
    for i, request in enumerate(requests):
        assert results[i] == SpeculativeEngine(target, make()).generate(
            request.prompt, request.max_new_tokens, SamplingParams()).tokens, i


@pytest.mark.parametrize("method", ["one-token", "lookahead", "sequoia"])
def test_a_prefix_a_slot_lost_is_reused_from_the_prompt_cache_by_any_slot(method, tiny_pair, monkeypatch):
    """Four long prompts through two slots, then the first two again: their slots hold the later two, so each repeat
    starts from the prefix the prompt cache saved (llama-server's --cache-ram) and prefills nothing; without the
    cache, everything again. Every request's greedy tokens equal its own one-request greedy tokens."""
    _, target, draft = tiny_pair
    make = drafters(target, draft)[method]
    firsts = [long_prompt(90 + 7 * i, seed=i) for i in range(4)]
    prefilled = counted_prefills(target, monkeypatch)
    for budget in (DEFAULT_PROMPT_CACHE_MIB, 0):
        scheduler = Scheduler(SpeculativeEngine(target, make()), drafters_per_slot(make), 2, prompt_cache_mib=budget)
        requests = [Request(prompt, 8) for prompt in firsts]
        results = {c.id: c.result.tokens for c in scheduler.run(requests)}
        prefilled.clear()
        repeats = [Request(prompt, 8) for prompt in firsts[:2]]
        again = list(scheduler.run(repeats))
        results.update({c.id: c.result.tokens for c in again})
        assert sum(prefilled) == (0 if budget else sum(len(p) - 1 for p in firsts[:2])), budget
        # what a server reports as each request's cache_n
        assert sorted(c.result.cached_prompt_tokens for c in again) == sorted(
            len(p) - 1 if budget else 0 for p in firsts[:2])
        for i, request in enumerate(requests + repeats):
            assert results[i] == SpeculativeEngine(target, make()).generate(
                request.prompt, request.max_new_tokens, SamplingParams()).tokens, (budget, i)
    monkeypatch.undo()


def test_saved_prefixes_share_their_heads_and_the_least_recently_used_tail_goes_first(tiny_pair):
    """Four slots that held questions over one document, saved one after another: the first keeps the document, each
    other only its own tail; a request starts from exactly the keys and values its prefix was saved with; beyond the
    budget the least recently used tail goes first and the document stays while a tail reads from it."""
    _, target, _ = tiny_pair
    document, tails = list(range(1000, 1100)), [[2000 + i] * 20 for i in range(4)]
    torch.manual_seed(0)
    head_k, head_v = torch.randn(2, target.shape.layers, target.shape.kv_heads, 100, target.shape.head_dim)

    def slot(tail: list[int]) -> KVCache:
        cache = target.new_cache(256)
        cache.k[:, :, 100:120], cache.v[:, :, 100:120] = torch.randn(2, *cache.k[:, :, 100:120].shape)
        cache.k[:, :, :100], cache.v[:, :, :100] = head_k, head_v
        cache.held, cache.length = document + tail, 120
        return cache

    slots = [slot(tail) for tail in tails]
    row_bytes = slots[0].k[:, :, :1].nbytes * 2
    saved = PromptCache(row_bytes * (120 + 2 * 20))
    for cache in slots[:3]:
        saved.reuse(cache, [5] * 50)  # a request sharing nothing with the slot: its prefix is saved
    assert saved.bytes == row_bytes * (120 + 2 * 20) and sorted(e.start for e in saved.entries) == [0, 100, 100]

    def start(tail: list[int]) -> KVCache:  # a request's cache as the engine starts it (SpeculativeEngine.start)
        cache, prompt = target.new_cache(256), document + tail + [7]
        saved.reuse(cache, prompt)
        cache.keep_prefix(prompt)
        return cache

    for cache, tail in zip(slots[:3], tails):
        loaded = start(tail)
        assert loaded.length == 120
        assert torch.equal(loaded.k[:, :, :120], cache.k[:, :, :120]) and torch.equal(loaded.v[:, :, :120],
                                                                                      cache.v[:, :, :120])
    # the second used last, then a fourth saved: out goes the third, the least recently used prefix that nothing reads
    # from (the first is the document's own, which the others read)
    start(tails[1])
    saved.reuse(slots[3], [5] * 50)
    assert saved.bytes == row_bytes * (120 + 2 * 20)
    assert start(tails[2]).length == 100 and all(start(tails[i]).length == 120 for i in (0, 1, 3))


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("method", ["one-token", "lookahead", "sequoia", "triforce"])
def test_requests_sharing_a_document_in_flight_compute_it_once(method, chunk, tiny_pair, monkeypatch):
    """Four questions over one 300-token document sent at once, then a fifth while they run (three slots): the
    document is computed once, the others copy it from the cache of the sequence that holds it (waiting for it where
    it is still being computed), with or without chunked prefill, and report it as cached; every request's greedy
    tokens equal its own one-request greedy tokens."""
    loaded, _, draft = tiny_pair
    target = LeanModel(loaded.model)  # slots holding nothing yet
    make = {**drafters(target, draft), "triforce": lambda: HierarchicalDrafter(
        target, StreamingDrafter(draft, gamma=2, sinks=4, window=64), 2, 4, RetrievalSettings(256, 8, 16))}[method]
    document = long_prompt(300, seed=11)
    questions = [long_prompt(n, seed=20 + n)[:n] for n in (9, 14, 5, 12, 7)]
    requests = [Request(document + question, 10 + 3 * i) for i, question in enumerate(questions)]
    prefilled = counted_prefills(target, monkeypatch)
    scheduler = Scheduler(SpeculativeEngine(target, make()), drafters_per_slot(make), 3, prefill_chunk=chunk,
                          prompt_cache_mib=0)
    for request in requests[:4]:
        scheduler.submit(request)
    completions = {c.id: c for c in scheduler.step()}
    scheduler.submit(requests[4])
    while not scheduler.idle:
        completions.update({c.id: c for c in scheduler.step()})
    monkeypatch.undo()
    assert sum(prefilled) == len(document) + sum(len(q) - 1 for q in questions), prefilled
    assert sorted(c.result.cached_prompt_tokens for c in completions.values()) == [0] + [len(document)] * 4
    for i, request in enumerate(requests):
        assert completions[i].result.tokens == SpeculativeEngine(target, make()).generate(
            request.prompt, request.max_new_tokens, SamplingParams()).tokens, i


def test_a_request_takes_the_free_slot_holding_its_prompt(tiny_pair):
    """Two slots left holding two prompts; the second prompt again, alone: it takes the second slot, not the lowest
    free one, and prefills nothing (no prompt cache: the slot's own prefix)."""
    _, target, _ = tiny_pair
    firsts = [long_prompt(70, seed=i) for i in range(2)]
    scheduler = Scheduler(SpeculativeEngine(target, NoDrafter()), lambda slot: NoDrafter(), 2, prompt_cache_mib=0)
    list(scheduler.run([Request(prompt, 4) for prompt in firsts]))
    (again,) = scheduler.run([Request(firsts[1], 4)])
    assert again.result.cached_prompt_tokens == len(firsts[1]) - 1
    assert again.result.tokens == SpeculativeEngine(target, NoDrafter()).generate(firsts[1], 4,
                                                                                 SamplingParams()).tokens


def test_triforce_requests_batched_keep_their_greedy_tokens(tiny_pair):
    """Four long-context requests through TriForce's hierarchy (each its own retrieval cache and StreamingLLM
    draft), two in flight: each equals transformers' greedy output."""
    loaded, target, draft = tiny_pair

    def make():
        return HierarchicalDrafter(target, StreamingDrafter(draft, gamma=2, sinks=4, window=64), 2, 4,
                                   RetrievalSettings(256, 8, 16))

    requests = [Request(long_prompt(300 + 40 * i, i), 24 + 6 * i) for i in range(4)]
    scheduler = Scheduler(SpeculativeEngine(target, make()), drafters_per_slot(make), 2)
    results = {c.id: c.result.tokens for c in scheduler.run(requests)}
    for i, request in enumerate(requests):
        assert results[i] == hf_greedy(loaded, request.prompt, request.max_new_tokens)


@pytest.mark.parametrize("method", ["one-token", "sequoia"])
def test_the_operators_forward_batches_too(method, tiny_pair):
    """Models the kernels do not run (PyTorch's operators, a GPU's forward), each forward over every sequence's
    rows at once (a Sequoia draft's levels too): the same identity."""
    loaded, _, _ = tiny_pair
    target = LeanModel(loaded.model, kernels=False)
    draft = LeanModel(load_model("tiny-random-llama-draft").model, kernels=False)
    batched = {target: [], draft: []}
    for model, sizes in batched.items():
        model._forward_operators = partial(lambda forward, sizes, items, *a: sizes.append(len(items)) or forward(
            items, *a), model._forward_operators, sizes)
    make = drafters(target, draft)[method]
    requests = [Request(p, n) for p, n in zip(prompts(5), NEW_TOKENS)]
    results = {c.id: c.result.tokens
               for c in Scheduler(SpeculativeEngine(target, make()), drafters_per_slot(make), 3).run(requests)}
    assert max(batched[target]) == 3 and max(batched[draft], default=0) == (3 if method == "sequoia" else 0)
    for i in (0, 2, 6):
        assert results[i] == hf_greedy(loaded, requests[i].prompt, requests[i].max_new_tokens)


def test_a_request_that_does_not_fit_fails_alone(tiny_pair):
    _, target, _ = tiny_pair
    requests = [Request(p, n) for p, n in zip(prompts()[:3], NEW_TOKENS)]
    requests.insert(1, Request([5] * 4090, 20))  # beyond the 4,096-token context
    scheduler = Scheduler(SpeculativeEngine(target, None), drafters_per_slot(NoDrafter), 2)
    completions = {c.id: c for c in scheduler.run(requests)}
    assert "exceeds the model's context of 4096" in completions[1].error and completions[1].result is None
    for i in (0, 2, 3):
        assert completions[i].error is None and len(completions[i].result.tokens) == requests[i].max_new_tokens


def test_a_cancelled_request_frees_its_slot(tiny_pair):
    _, target, _ = tiny_pair
    scheduler = Scheduler(SpeculativeEngine(target, None), drafters_per_slot(NoDrafter), 1)
    first = scheduler.submit(Request(prompts()[0], 500))
    second = scheduler.submit(Request(prompts()[1], 5))
    assert scheduler.step() == [] and [entry.id for entry in scheduler.running] == [first]
    scheduler.cancel(first)
    done = scheduler.step()
    assert [(c.id, c.cancelled) for c in done] == [(first, True)]
    assert [entry.id for entry in scheduler.running] == [second]
    finished = [c for c in scheduler.run([])]
    assert [(c.id, len(c.result.tokens)) for c in finished] == [(second, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [3, 16])
def test_sampled_requests_sharing_steps_are_distributed_as_the_target(concurrency):
    """Sampled Sequoia requests (each its own seed) share their steps with each other and with requests of another
    prompt and length: the first two tokens of the measured prompt follow transformers' distribution (chi-square),
    at batch 3 and 16, on the CPU kernels' batched forward."""
    target_hf, target = toy_model(20, family="llama-32")
    _, draft = toy_model(20, noise=0.6, family="llama-32")
    assert target.kernels is not None
    params = SamplingParams(temperature=0.8, top_p=0.95)
    measured, other = [1, 4, 2, 5, 3], [3, 3, 1, 0]

    def make():
        return SequoiaDrafter(draft, [-1, 0, 0, 1, 1, 2, 3])

    requests = []
    for seed in range(SAMPLES):
        requests.append(Request(measured, 2, params, seed))
        if seed % 8 == 0:
            requests.append(Request(other, 1 + seed % 3, params, SAMPLES + seed))
    counts = np.zeros((VOCAB, VOCAB))
    scheduler = Scheduler(SpeculativeEngine(target, make()), drafters_per_slot(make), concurrency)
    for completion in scheduler.run(requests):
        if requests[completion.id].prompt == measured:
            tokens = completion.result.tokens
            counts[tokens[0], tokens[1]] += 1
    assert_distributed_as_target(counts, first_tokens_distribution(target_hf, measured, params))


def write_requests(tmp_path, lines: list[str]):
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plan_generate_requests_prints_each_in_input_order_and_fails_the_bad_ones_alone(run_cli, tmp_path):
    """A malformed line and a request over the context fail alone, each named by its line number; the others are
    decoded together and printed in input order with their timings, then a summary; the command exits 2."""
    import json

    path = write_requests(tmp_path, [
        json.dumps({"prompt": "hello there", "max_new_tokens": 6, "tag": "first"}),
        '{"prompt": 3}',
        json.dumps({"prompt": "x" * 5000}),
        "",
        json.dumps({"prompt": "general kenobi", "max_new_tokens": 9, "seed": 4, "temperature": 0.9}),
        "[1, 2]",
    ])
    code, out, err = run_cli("generate", "--target", "tiny-random-llama", "--requests", path, "--concurrency", 2,
                             "--json")
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error: line")]
    assert errors[0] == 'error: line 2: no "prompt" string' and errors[2] == "error: line 6: not a JSON object"
    assert errors[1].startswith("error: line 3: the prompt (") and "exceeds the model's context of 4096" in errors[1]
    assert "3 of 5 requests failed" in err.splitlines()[-1]
    printed = [json.loads(line) for line in out.splitlines()]
    assert [p.get("line") for p in printed[:-1]] == [1, 5] and printed[0]["tag"] == "first"
    assert [len(p["tokens"]) for p in printed[:-1]] == [6, 9]
    assert all(p["time_to_first_token"] > 0 and p["decode_seconds"] > 0 for p in printed[:-1])
    summary = printed[-1]
    assert summary["summary"] and summary["output_tokens"] == 15 and summary["failed"] == 3
    assert summary["output_tokens_per_second"] == pytest.approx(15 / summary["wall_seconds"])


def test_greedy_requests_batched_equal_plan_generate(run_cli, tmp_path):
    import json

    prompts = ["the quick brown fox", "a", "lorem ipsum dolor sit amet, consectetur"]
    path = write_requests(tmp_path, [json.dumps({"prompt": p, "max_new_tokens": 12}) for p in prompts])
    code, out, err = run_cli("generate", "--target", "tiny-random-llama", "--requests", path, "--concurrency", 3,
                             "--json")
    assert code == 0, err
    batched = [json.loads(line)["tokens"] for line in out.splitlines()[:-1]]
    for prompt, tokens in zip(prompts, batched):
        code, out, _ = run_cli("generate", "--target", "tiny-random-llama", "--prompt", prompt, "--max-new-tokens",
                               12, "--json")
        assert json.loads(out)["tokens"] == tokens


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0"], "0 is not in the range x>=1"),
    (["--concurrency", "4", "--prompt", "hi"], "--concurrency and --prefill-chunk go with --requests"),
    (["--prefill-chunk", "64", "--prompt", "hi"], "--concurrency and --prefill-chunk go with --requests"),
])
def test_bad_concurrency_is_one_line(run_cli, tmp_path, args, message):
    path = write_requests(tmp_path, ['{"prompt": "hi"}'])
    if "--prompt" not in args:
        args = ["--requests", str(path), *args]
    code, _, err = run_cli("generate", "--target", "tiny-random-llama", *args)
    assert code == 2 and message in err


def test_a_concurrency_whose_caches_do_not_fit_is_refused_before_decoding(run_cli, tmp_path, monkeypatch):
    from specplan.decoder import api

    monkeypatch.setattr(api, "free_memory", lambda device: 3 << 20)  # 3 MiB: one 4K-token tiny cache fits, 4 do not
    path = write_requests(tmp_path, ['{"prompt": "hi", "max_new_tokens": 3000}'] * 4)
    code, out, err = run_cli("generate", "--target", "tiny-random-llama", "--requests", path, "--concurrency", 4)
    assert code == 2 and out == ""
    assert "4 sequences of up to" in err and "GiB of KV cache" in err and one_error(err)


def test_a_shared_trie_keeps_the_live_prompts_when_one_request_ends():
    """Two requests share a trie: the one that ends withdraws its prompt's windows; the other's stay, and so do the
    outputs both taught it."""
    trie = Trie(TrieSettings(decoding_length=6, branch_length=3, window=3))
    first, second = TrieDrafter(trie, shared=True), TrieDrafter(trie, shared=True)
    first.reset([1, 2, 3, 4], 32)
    second.reset([7, 8, 9, 7, 8], 32)
    tokens, _ = trie.retrieve(np.array([5, 7], dtype=np.int64), 2)
    assert 8 in tokens.tolist()  # the second prompt's 7 -> 8
    tokens, _ = trie.retrieve(np.array([5, 2], dtype=np.int64), 2)
    assert 3 in tokens.tolist()  # the first prompt's 2 -> 3
    first.finish()
    assert 3 not in trie.retrieve(np.array([5, 2], dtype=np.int64), 2)[0].tolist()  # withdrawn
    assert 8 in trie.retrieve(np.array([5, 7], dtype=np.int64), 2)[0].tolist()  # still live
    second.finish()
    assert trie.size == 1 and trie.prompt_floor == 0


@torch.inference_mode()
def test_a_draft_model_reads_a_prompt_at_its_first_drafted_step(tiny_pair):
    """The draft's prefill waits for the request's first drafted step: steps it sits out cost it nothing, and then
    it drafts what a draft that read those tokens with the prompt drafts."""
    _, _, draft = tiny_pair
    prompt, (t1, t2) = prompts()[2], (7, 11)
    late = SequoiaDrafter(draft, [-1, 0, 0, 1, 2, 3])
    late.role_suffix = ".late"
    late.reset(prompt, 128)
    late.idle(prompt[-1])
    late.idle(t1)
    assert late.cache.length == 0  # two steps sat out: the draft has read nothing yet
    tree = late.propose(t2, SamplingParams(), DETERMINISTIC, None)
    assert late.cache.length == len(prompt) + 1  # the prompt, t1, and the root t2 uncommitted
    read = SequoiaDrafter(draft, [-1, 0, 0, 1, 2, 3])
    read.role_suffix = ".read"
    read.reset(prompt + [t1, t2], 128)
    assert read.propose(t2, SamplingParams(), DETERMINISTIC, None).tokens == tree.tokens
