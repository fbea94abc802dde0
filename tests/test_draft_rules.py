"""The serving engines' drafting rules run in our decoder (decoder/draft_rules.py): each rule's decisions as its
engine's code makes them, chains stopped early by the draft's confidence, and every request's greedy tokens kept."""

from __future__ import annotations

import pytest
import torch

from specplan.core.errors import UserError
from specplan.core.method_settings import TrieSettings
from specplan.core.plan_schema import Plan, save_plan
from specplan.decoder.api import Decoder, load_decoder
from specplan.decoder.batching import Request
from specplan.decoder.draft_rules import HfAssisted, LlamaCppDraft, SglangEma, TrtllmAuto
from specplan.decoder.drafters import NoDrafter, SequoiaDrafter, TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.trie import Trie


def test_tensorrt_llms_auto_rule_drafts_5_then_3_then_nothing():
    assert [TrtllmAuto().tokens(b) for b in (1, 4, 5, 32, 33, 256)] == [5, 5, 3, 3, 0, 0]


def test_transformers_heuristic_grows_on_a_whole_draft_and_shrinks_otherwise():
    rule = HfAssisted()
    assert (rule.tokens(1), rule.stop.below, rule.stop.top_k) == (20, 0.4, None)
    rule.observe(20, 20, 1)
    assert rule.tokens(1) == 22
    rule.observe(22, 3, 1)
    assert rule.tokens(4) == 21
    small = HfAssisted(num_assistant_tokens=1)
    small.observe(1, 0, 1)
    assert small.tokens(1) == 1  # at least one
    constant = HfAssisted(heuristic=False)
    constant.observe(20, 20, 1)
    assert constant.tokens(1) == 20


def test_llama_cpps_defaults_draft_3_with_no_early_stop():
    rule = LlamaCppDraft()
    assert (rule.tokens(8), rule.stop.below, rule.stop.top_k, rule.stop.min_tokens) == (3, 0.0, 10, 0)


def test_sglangs_controller_routes_each_batch_to_its_tier_and_follows_the_ema():
    """The default tiers (1, 8, 32, 64) by the largest key at or below the batch size; in tier 1, steps start at 3
    (EMA 2.0), move up to 5 after 15 steps whose drafts were all accepted (EMA 3 - 0.8^15 = 2.96 > 2.5), then down
    to 1 once the EMA of whole misses falls to 0.25 (1 - 0.5 - 0.25)."""
    rule = SglangEma()
    assert [rule._tier(b).candidates for b in (1, 7, 8, 31, 32, 63, 64, 300)] == [
        (1, 3, 5, 7), (1, 3, 5, 7), (0, 1, 3), (0, 1, 3), (0, 1), (0, 1), (0,), (0,)]
    steps = []
    for _ in range(15):
        steps.append(rule.tokens(2))
        rule.observe(3, 3, 2)
        rule.observe(3, 3, 2)
    assert steps == [3] * 15 and rule.tokens(2) == 5
    after = []
    for _ in range(40):
        rule.observe(5, 0, 1)
        after.append(rule.tokens(1))
    assert after[-1] == 1 and 3 in after  # down through 3 as the EMA falls
    assert rule.tokens(8) == 3  # tier 8 untouched: its own start (3 is among its candidates)


def test_sglangs_zero_step_tier_probes_the_next_candidate():
    rule = SglangEma(initial_steps=0)
    tier = rule._tier(8)
    assert tier.steps == 0
    for _ in range(15):
        rule.observe(0, 0, 8)
        rule.tokens(8)
    assert tier.steps == 1 and tier.ema == 0.0  # probed; its EMA was never below zero


def chain_plan(size: int) -> Plan:
    return Plan.from_dict({"kind": "plan/sequoia", "models": {"target": "tiny-random-llama"},
                           "tree": {"parents": list(range(-1, size - 1)), "size": size, "depth": size - 1},
                           "prediction": {"tokens_per_step": 1.5}}, "chain.yaml")


def requests() -> list[Request]:
    gen = torch.Generator().manual_seed(3)
    return [Request(torch.randint(0, 250, (n,), generator=gen).tolist(), m)
            for n, m in zip((5, 17, 40, 9, 23), (20, 7, 30, 15, 12))]


@pytest.mark.parametrize("rule", ["hf-heuristic", "llama.cpp", "sglang-ema"])
def test_every_request_keeps_its_greedy_tokens_under_each_chain_rule(rule, tiny_pair):
    """Five requests, three in flight, a 0.5B-like chain drafted under each rule (its lengths differing between
    requests and steps, chains of several lengths drafted together): each request's tokens are its own greedy
    tokens."""
    loaded, target, draft = tiny_pair
    decoder = Decoder(loaded, lambda: SequoiaDrafter(draft, list(range(-1, 4))), chain_plan(5), None, target,
                      draft_forward=draft)
    decoder.use_rule(rule)
    lengths = []
    forward_many = draft.forward_many
    draft.forward_many = lambda items: lengths.append(len(items)) or forward_many(items)
    try:
        results = {c.id: c.result.tokens for c in decoder.generate_many(requests(), 3)}
    finally:
        del draft.forward_many
    assert max(lengths) == 3  # the draft model's sequences batched
    for i, request in enumerate(requests()):
        assert results[i] == SpeculativeEngine(target, None, loaded.stop_token_ids).generate(
            request.prompt, request.max_new_tokens, SamplingParams()).tokens, i


def test_a_chain_stops_at_a_token_drafted_with_too_little_confidence(tiny_pair):
    """A threshold above every confidence: transformers' chain ends after its first token, llama-server's before it
    (nothing drafted: the target scores the root alone), as it does where two drafted tokens are required as well
    (its n_min)."""
    _, target, draft = tiny_pair
    prompt = torch.randint(0, 250, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    for rule, size in ((HfAssisted(threshold=1.01), 2), (LlamaCppDraft(p_min=1.01), 1),
                       (LlamaCppDraft(n_min=2, p_min=1.01), 1), (LlamaCppDraft(p_min=0.0), 6)):
        drafter = SequoiaDrafter(draft, list(range(-1, 5)))
        drafter.rule = rule
        engine = SpeculativeEngine(target, drafter)
        run = engine.start(prompt, 8, SamplingParams(), None)
        item = run.propose()
        assert item.tokens.shape[0] == size
        run.advance(target.forward(*item))
        assert run.propose().tokens.shape[0] == size  # the draft cache kept up


def test_a_rule_runs_only_on_the_drafter_its_engine_made_it_for(tiny_pair):
    loaded, target, draft = tiny_pair
    lookahead = Plan.from_dict({"kind": "plan/lookahead", "models": {"target": "tiny-random-llama"},
                                "lookahead": TrieSettings.sized(4, 3).to_dict(),
                                "tokenizer": {"vocab_size": 8, "sha256": "x"}, "prediction": {"tokens_per_step": 1.5}},
                               "p.yaml")
    on_trie = Decoder(loaded, lambda: TrieDrafter(Trie(lookahead.settings)), lookahead, None, target)
    with pytest.raises(UserError, match="give a Sequoia chain plan"):
        on_trie.use_rule("llama.cpp")
    on_trie.use_rule("trtllm-auto")
    assert on_trie.engine.drafter.max_tree_size == 6 and on_trie.engine.schedule is None  # 5 tokens and the root
    on_chain = Decoder(loaded, lambda: SequoiaDrafter(draft, [-1, 0, 1]), chain_plan(3), None, target,
                       draft_forward=draft)
    with pytest.raises(UserError, match="give a Lookahead plan"):
        on_chain.use_rule("trtllm-auto")
    with pytest.raises(UserError, match="unknown drafting rule"):
        on_chain.use_rule("vllm-magic")


def test_every_rule_names_where_it_was_read():
    from specplan.core.choices import DRAFT_RULES
    from specplan.planner.engines import DRAFT_RULE_SOURCES

    assert set(DRAFT_RULE_SOURCES) == set(DRAFT_RULES)
    assert all(source.commit for sources in DRAFT_RULE_SOURCES.values() for source in sources)


def test_a_plan_that_never_drafts_loads_no_drafter_and_a_rule_still_drafts_with_its_draft(tmp_path, tiny_pair):
    """A chain plan off at every batch size (its tree the root alone) prefills no draft per request; a rule run on
    it drafts with the plan's draft model and keeps every request's greedy tokens."""
    loaded, target, _ = tiny_pair
    path = tmp_path / "off.yaml"
    save_plan(Plan.from_dict({"kind": "plan/sequoia", "models": {"target": "tiny-random-llama",
                                                                 "draft": "tiny-random-llama-draft"},
                              "tree": {"parents": [-1], "size": 1, "depth": 0},
                              "prediction": {"tokens_per_step": 1.0},
                              "schedule": {"entries": [{"batches": [1, 16], "speculate": False, "tokens_per_step": 1.0,
                                                        "tokens_per_second": 10.0, "speedup": 1.0}]}},
                             "off.yaml"), path)
    decoder = load_decoder(path, device="cpu")
    assert isinstance(decoder.engine.drafter, NoDrafter) and decoder.draft_forward is not None
    off = {c.id: c.result.tokens for c in decoder.generate_many(requests()[:3], 2)}  # its schedule: off throughout
    with pytest.raises(UserError, match="drafts at no batch size"):
        decoder.fix_setting(2)
    decoder.use_rule("llama.cpp")
    assert isinstance(decoder.engine.drafter, SequoiaDrafter)
    results = {c.id: c.result.tokens for c in decoder.generate_many(requests()[:3], 2)}
    for i, request in enumerate(requests()[:3]):
        assert results[i] == off[i] == SpeculativeEngine(target, None, loaded.stop_token_ids).generate(
            request.prompt, request.max_new_tokens, SamplingParams()).tokens, i
