"""Sequoia's positional acceptance: closed forms, coverage, exact vs simulated, and `plan accept` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specplan.core.acceptance_schema import load_sequoia_acceptance
from specplan.core.errors import UserError
from specplan.profiler.acceptance import positional_greedy, positional_sampled, truncate_support
from specplan.profiler.datasets import read_dataset, spread_sample
from specplan.profiler.haystack import essays

from toy import one_error


def random_pair(seed: int, vocab: int = 12, concentration: float = 0.5):
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(vocab, concentration)), rng.dirichlet(np.full(vocab, concentration))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_first_child_is_one_minus_total_variation(seed):
    P, Q = random_pair(seed)
    expected = 1 - 0.5 * np.abs(P - Q).sum()
    for exact_support in (100, 0):  # enumeration and simulation
        got = positional_sampled(P[None], Q[None], 4, paths=8, exact_support=exact_support)[0, 0]
        assert got == pytest.approx(expected, abs=1e-12)


def test_coverage_when_the_draft_support_covers_the_target():
    rng = np.random.default_rng(3)
    Q = np.zeros(10)
    Q[[1, 4, 7]] = rng.dirichlet(np.ones(3))
    P = np.zeros(10)
    P[[1, 7]] = rng.dirichlet(np.ones(2))  # supp(P) within supp(Q), |supp(Q)| = 3
    exact = positional_sampled(P[None], Q[None], 6, exact_support=100)[0]
    assert exact[:3].sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(exact[3:] == 0)


@pytest.mark.parametrize("seed", range(3))
def test_simulation_agrees_with_enumeration(seed):
    P, Q = random_pair(10 + seed, vocab=7)
    exact = positional_sampled(P[None], Q[None], 5, exact_support=100)[0]
    sims = positional_sampled(np.repeat(P[None], 400, 0), np.repeat(Q[None], 400, 0), 5, paths=16, exact_support=0)
    stderr = sims.std(0, ddof=1) / np.sqrt(len(sims))
    assert np.all(np.abs(sims.mean(0) - exact) <= 4 * stderr + 1e-12)
    assert exact.sum() <= 1 + 1e-12


@pytest.mark.slow
def test_acceptance_matches_monte_carlo_of_algorithm_1():
    """Run Sequoia's Algorithm 1 itself (sample children from Q without replacement, accept or reject)."""
    P, Q = random_pair(21, vocab=6)
    rng = np.random.default_rng(0)
    width, trials = 4, 60_000
    counts = np.zeros(width)
    for _ in range(trials):
        R, D, alive = P.copy(), Q.copy(), np.ones(6, bool)
        for k in range(width):
            x = rng.choice(6, p=D)
            if rng.random() < min(1.0, R[x] / D[x]):
                counts[k] += 1
                break
            R = np.maximum(R - D, 0)
            R /= R.sum()
            D[x] = 0
            alive[x] = False
            D = D / D.sum() if D.sum() > 0 else alive / alive.sum()
    exact = positional_sampled(P[None], Q[None], width, exact_support=100)[0]
    freq = counts / trials
    assert np.all(np.abs(freq - exact) <= 4 * np.sqrt(exact * (1 - exact) / trials) + 1e-3)


def test_truncation_merges_the_tail_into_one_bucket():
    P = np.array([0.5, 0.3, 0.2 - 2e-7, 1e-7, 1e-7])
    Q = np.array([0.6, 0.2, 0.2 - 2e-7, 1e-7, 1e-7])
    small_P, small_Q = truncate_support(P, Q, tail=1e-6)
    assert len(small_P) == 4 and small_P[-1] == pytest.approx(2e-7) and small_P.sum() == pytest.approx(1.0)


def test_greedy_indicators():
    target = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    draft = torch.tensor([[0.0, 2.0, 1.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    got = positional_greedy(target, draft, 3)
    assert got.tolist() == [[0, 1, 0], [0, 0, 0]]  # target argmax 1 is draft's 2nd; token 0 is draft's 4th


def test_specbench_reader_and_category_filter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short names resolve to the carried data/ from any directory
    prompts = read_dataset("specbench:coding")
    assert len(prompts) == 10 and {p.category for p in prompts} == {"coding"}
    mixed = spread_sample(read_dataset("specbench"), 13)
    assert len({p.category for p in mixed}) == 13 and len(read_dataset("specbench")) == 480
    assert len(read_dataset("specbench:summarization,rag,coding")) == 170
    assert len(essays("haystack")) == 49
    with pytest.raises(UserError, match="no category"):
        read_dataset("specbench:nonsense")
    with pytest.raises(UserError, match=r"unknown dataset 'spec-bench'.*\(specbench, haystack;"):
        read_dataset("spec-bench:coding")
    with pytest.raises(UserError, match="unknown dataset"):
        read_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="no category needle"):
        essays("haystack:needle")


def test_a_path_wins_over_a_short_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("specbench").mkdir()
    Path("specbench/question.jsonl").write_text(json.dumps({"category": "mine", "turns": ["own prompt"]}) + "\n")
    assert [(p.category, p.text) for p in read_dataset("specbench")] == [("mine", "own prompt")]
    assert [p.text for p in read_dataset("specbench:mine")] == ["own prompt"]


def test_accept_cli_on_tiny_models(run_cli, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [t]})
                                 for i, t in enumerate(["hello there", "the cat sat on", "one two three"])))
    for temperature in ("0", "0.8"):
        out = tmp_path / f"acc{temperature}.yaml"
        code, stdout, stderr = run_cli("accept", "sequoia", "--target", "tiny-random-llama", "--draft",
                                       "tiny-random-llama-draft", "--dataset", dataset, "--temperature", temperature,
                                       "--width", 4, "--max-new-tokens", 12, "--paths", 8, "-o", out)
        assert code == 0, stderr
        acceptance = load_sequoia_acceptance(out)
        assert len(acceptance.positional) == 4 and acceptance.samples == 36
        assert 0 < acceptance.positional.sum() <= 1
        assert acceptance.target == "tiny-random-llama" and acceptance.draft == "tiny-random-llama-draft"
        assert acceptance.stderr is not None
    out = tmp_path / "limited.yaml"
    code, _, stderr = run_cli("accept", "sequoia", "--target", "tiny-random-llama", "--draft",
                              "tiny-random-llama-draft", "--dataset", dataset, "--temperature", "0", "--width", 4,
                              "--max-new-tokens", 12, "--draft-vocab", 64, "-o", out)
    assert code == 0, stderr
    limited = load_sequoia_acceptance(out)
    assert limited.draft_vocab == 64 and 0 < limited.positional.sum() <= 1


@pytest.mark.parametrize("args, message", [
    (["--dataset", "/nonexistent/q.jsonl"], "unknown dataset"),
    (["--dataset", "sharegpt"], "not one of the carried sets (specbench, haystack;"),
    (["--dataset", "specbench", "--target", "no-such-model"], "unknown model"),
    (["--dataset", "specbench", "--max-new-tokens", "5000"], "exceeds the context"),
])
def test_accept_bad_input(args, message, run_cli, tmp_path):
    base = {"--target": "tiny-random-llama", "--draft": "tiny-random-llama-draft", "--temperature": "0",
            "--prompts": "2"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    out = tmp_path / "acc.yaml"
    code, _, stderr = run_cli("accept", "sequoia", *[x for kv in base.items() for x in kv], "-o", out)
    assert code == 2 and message in stderr and one_error(stderr)
    assert not out.exists()
