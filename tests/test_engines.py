"""Serving engines' rules (planner/engines.py), the solver within them, and the exports they take as they are."""

from __future__ import annotations

import dataclasses
import io
import json
import re

import numpy as np
import pytest
import torch
import yaml

from specplan.core.choices import ENGINES, EXPORT_FORMATS
from specplan.core.errors import UserError
from specplan.core.plan_schema import TokenTree, load_plan
from specplan.planner.engines import RULES, EngineRules, engine_rules
from specplan.planner.export import export_plan, import_tree
from specplan.planner.sequoia import (
    LevelLimitedTables,
    SequoiaTables,
    engine_tables,
    solve_sequoia,
    tree_value,
)

from toy import one_error

ACCEPTANCE = "acceptance/qwen2.5-coder-1.5b+0.5b-v64k.sequoia.specbench.t0.bf16.yaml"
PROFILE = "profiles/qwen2.5-coder-1.5b+0.5b-v64k.cpu-2c.bf16.yaml"
P = np.array([0.55, 0.2, 0.1, 0.06, 0.03])


def all_trees(max_size: int):
    """Every ordered tree of up to max_size nodes, as BFS parents (children contiguous, in rank order)."""
    def extend(parents: list[int], size: int):
        if len(parents) == size:
            yield tuple(parents)
            return
        for parent in range(parents[-1] if len(parents) > 1 else 0, len(parents)):
            yield from extend(parents + [parent], size)

    for size in range(1, max_size + 1):
        yield from extend([-1], size)


def brute_force_G(rules: EngineRules, positional: np.ndarray, max_size: int, max_depth: int) -> np.ndarray:
    """Best tree value per (n, depth at most d) over every tree the rules allow whose ranks the acceptance vector
    covers (the solvers' width)."""
    best = np.full((max_size + 1, max_depth + 1), -np.inf)
    for parents in all_trees(max_size):
        tree = TokenTree.from_parents(list(parents))
        if tree.depth > max_depth or max(tree.ranks) >= len(positional) or rules.broken_rule(tree) is not None:
            continue
        value = tree_value(np.array(parents), positional)
        for d in range(tree.depth, max_depth + 1):
            best[tree.size, d] = max(best[tree.size, d], value)
    return best


def test_every_engine_has_rules_with_sources():
    assert tuple(RULES) == ENGINES
    for name, rules in RULES.items():
        assert rules.name == name
        assert name == "specplan" or rules.sources, name
        assert all(re.fullmatch(r"[0-9a-f]{40}|b[0-9]+", source.commit) for source in rules.sources)


def test_the_rules_reject_the_counter_examples():
    eleven = TokenTree.from_parents([-1] + [0] * 11)
    assert "rank 11" in engine_rules("medusa", heads=4).broken_rule(eleven)
    assert engine_rules("medusa", heads=4).broken_rule(TokenTree.from_parents([-1] + [0] * 10)) is None
    assert "depth 2 or more" in engine_rules("eagle1", heads=4).broken_rule(TokenTree.from_parents([-1, 0, 0]))
    assert "at most 3 levels" in engine_rules("medusa", heads=3).broken_rule(TokenTree.from_parents([-1, 0, 1, 2, 3]))
    chain_breaker = TokenTree.from_parents([-1, 0, 0])
    for name in ("llama.cpp", "hf", "vllm", "trtllm-draft"):
        assert "chain" in engine_rules(name).broken_rule(chain_breaker)
    assert "tree attention was removed, PR #42121" in engine_rules("vllm").broken_rule(chain_breaker)
    trtllm = engine_rules("trtllm")
    assert "at most 4 levels" in trtllm.broken_rule(TokenTree.from_parents([-1, 0, 1, 2, 3, 4]))
    assert "at most 63 draft tokens" in trtllm.broken_rule(TokenTree.from_parents([-1] + [0] * 8 + [1] * 56))
    wide = TokenTree.from_parents([-1] + [0] * 11 + list(range(1, 12)))  # 11 expanded nodes on level 1
    assert "expands at most 10" in trtllm.broken_rule(wide)
    with pytest.raises(UserError, match="give --heads"):
        engine_rules("medusa")
    with pytest.raises(UserError, match="unknown engine"):
        engine_rules("tgi")


def test_capped_dp_equals_the_dp_on_the_cut_vector_with_the_depth_cap():
    positional = np.linspace(0.3, 0.01, 14)  # 14 ranks: Medusa's top-10 cuts it
    medusa = engine_rules("medusa", heads=3)
    capped = engine_tables(positional, 40, 8, medusa)
    np.testing.assert_array_equal(capped.G, SequoiaTables(positional[:10], 40, 3).G)
    small = EngineRules("top-2", "ranked", (), max_rank=2, max_depth=3)  # the cap against every tree it allows
    np.testing.assert_allclose(engine_tables(P, 9, 5, small).G[1:], brute_force_G(small, P, 9, 3)[1:])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_the_per_level_limit_is_solved_exactly(seed):
    """TensorRT-LLM's limit of expanded nodes per level: the table equals brute force over every tree under it
    (non-monotone acceptance vectors), its trees attain their value and pass the rule, and a limit that never
    binds gives the plain DP's table."""
    rng = np.random.default_rng(seed)
    positional = rng.random(4) ** 2
    positional *= rng.uniform(0.4, 0.95) / positional.sum()
    for limit in (1, 2):
        rules = EngineRules("limited", "ranked", (), max_depth=4, max_non_leaves_per_level=limit)
        tables = engine_tables(positional, 9, 6, rules)
        assert isinstance(tables, LevelLimitedTables)
        brute = brute_force_G(rules, positional, 9, 4)
        np.testing.assert_array_equal(np.isfinite(tables.G), np.isfinite(brute))
        np.testing.assert_allclose(tables.G[np.isfinite(brute)], brute[np.isfinite(brute)], rtol=0, atol=1e-12)
        for n, d in zip(*np.nonzero(np.isfinite(tables.G))):
            parents = tables.tree(int(n), int(d))
            tree = TokenTree.from_parents(list(parents))
            assert tree.size == n and tree.depth <= d and rules.broken_rule(tree) is None
            assert tree_value(parents, positional) == pytest.approx(tables.G[n, d], abs=1e-12)
    wide = np.linspace(0.5, 0.02, 12)
    np.testing.assert_allclose(LevelLimitedTables(wide, 40, 4, 40).G, SequoiaTables(wide, 40, 4).G)


def test_a_chain_engine_solves_the_chain():
    G = engine_tables(P, 8, 8, engine_rules("llama.cpp")).G
    for depth in range(8):
        assert G[depth + 1, depth] == pytest.approx(sum(P[0] ** k for k in range(depth + 1)))


# llama.cpp's knobs are replayed over every chain trace: seconds, so in the full tier only
@pytest.mark.parametrize("engine", [pytest.param(e, marks=pytest.mark.slow) if e == "llama.cpp" else e
                                    for e in ENGINES])
def test_a_plan_solved_for_an_engine_passes_its_rules(engine):
    heads = 3 if engine in ("medusa", "eagle1") else None
    plan, ranked = solve_sequoia(ACCEPTANCE, 48, 8, PROFILE, engine=engine, heads=heads)
    assert engine_rules(engine, heads).broken_rule(plan.tree) is None
    free, _ = solve_sequoia(ACCEPTANCE, 48, 8, PROFILE)
    # where both are priced alike (not llama.cpp's and transformers' knobs on the chain traces, nor SGLang's dynamic
    # tree on the positional model beside a replayed tree), the rules never help
    if "chain_knobs" not in plan.solver and plan.prediction.replay_exact == free.prediction.replay_exact:
        assert plan.prediction.speedup <= free.prediction.speedup + 1e-12
    if engine != "specplan":
        assert plan.engine == engine and plan.solver["engine"]["unconstrained"]["speedup"] == pytest.approx(
            free.prediction.speedup)


def test_vllm_exports_a_chain_for_a_draft_model_or_an_eagle_head():
    """vLLM drafts chains only (planner/engines.py: VLLM_SPECULATIVE_CONFIG): a standalone draft is method
    draft_model, an EAGLE head eagle or eagle3 when the user says so; num_speculative_tokens is the chain's length."""
    plan, _ = solve_sequoia(ACCEPTANCE, 40, 6, PROFILE, engine="vllm")
    assert all(len(kids) <= 1 for kids in plan.tree.children) and plan.tree.depth > 0
    config = json.loads(export_plan(plan, "vllm", draft_path="qwen-0.5b").content)
    assert config == {"method": "draft_model", "model": "qwen-0.5b", "num_speculative_tokens": plan.tree.depth}
    assert json.loads(export_plan(plan, "vllm", draft_path="head", method="eagle3").content)["method"] == "eagle3"
    with pytest.raises(UserError, match="vLLM drafts a chain with draft_model, eagle, eagle3"):
        export_plan(plan, "vllm", draft_path="head", method="medusa")
    branching = dataclasses.replace(plan, tree=TokenTree.from_parents([-1, 0, 0, 1]))
    with pytest.raises(UserError, match="tree attention was removed, PR #42121.*; solve with --engine vllm"):
        export_plan(branching, "vllm", draft_path="qwen-0.5b")


@pytest.mark.parametrize("fmt", [pytest.param(f, marks=pytest.mark.slow) if f == "llama.cpp" else f
                                 for f in EXPORT_FORMATS if f != "sglang"])  # SGLang's flags hold no tree
def test_every_export_round_trips(fmt):
    heads = 3 if fmt in ("medusa", "eagle1") else None
    plan, _ = solve_sequoia(ACCEPTANCE, 24, 6, PROFILE, engine=fmt, heads=heads)
    exported = export_plan(plan, fmt, draft_path="draft-model", heads=heads)
    assert import_tree(exported.content, fmt) == plan.tree
    assert exported.instructions


def test_sequoia_export_is_the_reference_growmap_with_tensors():
    plan, _ = solve_sequoia(ACCEPTANCE, 12, 4, PROFILE, engine="sequoia")
    growmap = torch.load(io.BytesIO(export_plan(plan, "sequoia").content), weights_only=True)
    tree = plan.tree
    assert growmap["size"] == tree.size and growmap["Successors"] == tree.children
    assert growmap["mask"].dtype == torch.int64 and growmap["depth"].tolist() == tree.depths
    for node in range(tree.size):  # a node's row of the mask: itself and its ancestors
        seen, v = {node}, node
        while tree.parents[v] >= 0:
            v = tree.parents[v]
            seen.add(v)
        assert set(torch.nonzero(growmap["mask"][node]).flatten().tolist()) == seen
    assert sum(len(level) for level in growmap["roots"]) == tree.size


def test_trtllm_export_carries_what_its_config_requires():
    plan, _ = solve_sequoia(ACCEPTANCE, 24, 6, PROFILE, engine="trtllm")
    config = yaml.safe_load(export_plan(plan, "trtllm", draft_path="eagle-dir").content)["speculative_config"]
    assert config["decoding_type"] == "Eagle" and config["max_draft_len"] == plan.tree.size - 1 > 0
    assert config["speculative_model"] == "eagle-dir" and len(config["eagle_choices"]) == plan.tree.size - 1


def test_exports_that_break_the_engine_or_lack_a_draft_are_refused_in_one_line(run_cli, tmp_path):
    plan_file = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", ACCEPTANCE, "--max-size", 24,
                              "--max-depth", 6, "-o", plan_file)  # the most tokens per step: a 24-node tree
    assert code == 0, stderr
    tree = load_plan(plan_file).tree
    assert any(len(kids) > 1 for kids in tree.children)
    out = tmp_path / "tree.json"
    code, _, stderr = run_cli("export", plan_file, "--format", "vllm", "--draft-path", "x", "-o", out)
    assert code == 2 and "no token trees" in stderr and "--engine vllm" in stderr
    assert one_error(stderr) and not out.exists()
    code, _, stderr = run_cli("export", plan_file, "--format", "llama.cpp", "-o", out)
    assert code == 2 and "chain" in stderr and not out.exists()
    vllm_plan = tmp_path / "vllm.yaml"
    assert run_cli("solve", "sequoia", "--acceptance", ACCEPTANCE, "--profile", PROFILE, "--max-size", 24,
                   "--max-depth", 6, "--engine", "vllm", "-o", vllm_plan)[0] == 0
    code, _, stderr = run_cli("export", vllm_plan, "--format", "vllm", "-o", out)
    assert code == 2 and "--draft-path" in stderr and not out.exists()
    code, stdout, stderr = run_cli("export", vllm_plan, "--format", "vllm", "--draft-path", "x")
    assert code == 0 and json.loads(stdout)["method"] == "draft_model" and "002e77c1f0ef" in stderr
    code, _, stderr = run_cli("export", vllm_plan, "--format", "sequoia")
    assert code == 2 and "-o FILE" in stderr
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", ACCEPTANCE, "--max-size", 8, "--max-depth", 3,
                              "--engine", "medusa", "-o", tmp_path / "m.yaml")
    assert code == 2 and "--heads" in stderr and not (tmp_path / "m.yaml").exists()


def test_the_solver_table_and_show_print_the_engine_beside_the_unconstrained_tree(run_cli, tmp_path):
    out = tmp_path / "plan.yaml"
    code, stdout, stderr = run_cli("solve", "sequoia", "--acceptance", ACCEPTANCE, "--profile", PROFILE,
                                   "--max-size", 32, "--max-depth", 6, "--engine", "hf", "-o", out)
    assert code == 0, stderr
    assert "engine hf (chain)" in stdout and "unconstrained tree" in stdout and "the engine's rules cost" in stdout
    code, stdout, _ = run_cli("show", out)
    assert code == 0 and "engine hf (chain)" in stdout
    assert load_plan(out).tree.depth == load_plan(out).tree.size - 1


def simulate_sglang(positional: np.ndarray, steps: int, topk: int, draft_tokens: int):
    """SGLang's own tensor steps (select_top_k_tokens, organize_draft_results; planner/engines.py cites them) for one
    request whose draft gives every node the top-k probabilities `positional[:topk]`."""
    topk_p = torch.tensor(positional[:topk], dtype=torch.float64)[None]  # (1, topk)
    scores, score_list = topk_p, [topk_p.unsqueeze(1)]
    paths = [(r,) for r in range(topk)]
    frontier = list(paths)
    for _ in range(1, steps):
        expand = scores.unsqueeze(2) * topk_p.repeat(topk, 1).reshape(-1, topk, topk)  # (1, topk, topk)
        values, index = torch.topk(expand.flatten(1), topk, dim=-1)
        score_list.append(expand)
        drafted = [node + (r,) for node in frontier for r in range(topk)]
        paths += drafted
        frontier, scores = [drafted[j] for j in index[0].tolist()], values
    flat = torch.cat(score_list, dim=1).flatten(1)
    kept = torch.sort(torch.topk(flat, draft_tokens - 1, dim=-1).indices).values[0]
    return 1.0 + float(flat[0, kept].sum()), [paths[j] for j in kept.tolist()]


def path_scores(positional: np.ndarray, paths) -> list[float]:
    return sorted(float(np.prod(positional[list(path)])) for path in paths)


def test_the_sglang_model_is_its_selection_on_random_acceptance_vectors():
    from specplan.planner.sequoia import sglang_selection

    rng = np.random.default_rng(3)
    for _ in range(200):
        positional = np.sort(rng.dirichlet(np.ones(8)) * rng.uniform(0.5, 1.0))[::-1].copy()
        steps, topk = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        pool = topk + (steps - 1) * topk * topk
        draft_tokens = int(rng.integers(2, pool + 2))
        value, kept = sglang_selection(positional, steps, topk, draft_tokens)
        simulated_value, simulated_kept = simulate_sglang(positional, steps, topk, draft_tokens)
        assert value == pytest.approx(simulated_value, rel=1e-12)
        # the same scores kept; which of two equal products (p_a p_b = p_b p_a) is kept is torch.topk's choice
        np.testing.assert_allclose(path_scores(positional, kept), path_scores(positional, simulated_kept),
                                   rtol=1e-12)
        tree = TokenTree.from_paths([list(path) for path in kept])  # ancestor-closed, children of top ranks
        assert tree_value(np.array(tree.parents), positional) == pytest.approx(value, rel=1e-12)


def test_sglang_trees_are_trees_for_a_measured_vector_that_does_not_fall_everywhere():
    """A measured acceptance vector may rise with the rank (few samples at rank 8 and 9); SGLang ranks by draft
    probability, which falls: the model keeps lower ranks first and values the tree by p itself."""
    from specplan.planner.sequoia import SGLangTables, sglang_selection

    positional = np.array([0.8, 0.1, 0.03, 0.016, 0.009, 0.004, 0.003, 0.001, 0.0017, 0.0039, 0.0006])
    for steps, topk, draft_tokens in ((1, 10, 11), (3, 10, 64), (4, 4, 30)):
        value, kept = sglang_selection(positional, steps, topk, draft_tokens)
        tree = TokenTree.from_paths([list(path) for path in kept])
        assert tree.size == draft_tokens and tree_value(np.array(tree.parents), positional) == pytest.approx(value)
    tables = SGLangTables(positional, 64, 6, 10)
    for n in (2, 11, 40, 64):
        assert TokenTree.from_parents(tables.tree(n, 6)).size == n


def test_an_sglang_plan_exports_its_triple():
    plan, _ = solve_sequoia(ACCEPTANCE, 32, 6, PROFILE, engine="sglang")
    triple = plan.solver["sglang"]
    flags = export_plan(plan, "sglang", draft_path="draft").content.split()
    assert flags[flags.index("--speculative-num-steps") + 1] == str(triple["num_steps"])
    assert flags[flags.index("--speculative-eagle-topk") + 1] == str(triple["topk"])
    assert flags[flags.index("--speculative-num-draft-tokens") + 1] == str(plan.tree.size)
    assert plan.tree.depth == triple["num_steps"]
    free, _ = solve_sequoia(ACCEPTANCE, 32, 6, PROFILE)
    with pytest.raises(UserError, match="--engine sglang"):
        export_plan(free, "sglang", draft_path="draft")
