"""The decoding engine's time outside the target's forward, o(n), is priced by every planner as forward time."""

from __future__ import annotations

import copy
import dataclasses
import types

import numpy as np
import pytest

from specplan.core.profile_schema import LatencyProfile

OVERHEAD = 0.003
BASE = {
    "kind": "profile/latency",
    "target": {"context": 256, "t_seconds": {1: 0.010, 2: 0.011, 4: 0.013, 8: 0.017, 16: 0.025, 32: 0.041},
               "contexts": {256: {"t_seconds": {1: 0.010, 2: 0.011, 4: 0.013, 8: 0.017, 16: 0.025, 32: 0.041}},
                            4096: {"t_seconds": {1: 0.044, 2: 0.048, 4: 0.056, 8: 0.072, 16: 0.104, 32: 0.168},
                                   "retrieval_build_seconds": {128: 0.003, 384: 0.007}}}},
    "draft": {"step_seconds": 0.004},
}


def profiles() -> tuple[LatencyProfile, LatencyProfile]:
    """(every forward OVERHEAD slower, no engine overhead) and (the base forwards, an overhead of OVERHEAD)."""
    shifted = copy.deepcopy(BASE)
    for section in [shifted["target"], *shifted["target"]["contexts"].values()]:
        section["t_seconds"] = {n: t + OVERHEAD for n, t in section["t_seconds"].items()}
    with_overhead = copy.deepcopy(BASE)
    with_overhead["target"]["engine_overhead_seconds"] = {1: OVERHEAD, 32: OVERHEAD}
    return LatencyProfile.from_dict(shifted, "shifted"), LatencyProfile.from_dict(with_overhead, "overhead")


def test_a_profile_without_overhead_prices_none():
    profile = LatencyProfile.from_dict(BASE, "base")
    assert profile.engine_overhead(np.array([1, 7, 64])).tolist() == [0.0, 0.0, 0.0]
    measured = LatencyProfile.from_dict({**BASE, "target": {**BASE["target"],
                                                            "engine_overhead_seconds": {1: 0.001, 9: 0.003}}}, "m")
    assert measured.engine_overhead(np.array([1, 5, 64])).tolist() == pytest.approx([0.001, 0.002, 0.003])


def test_sequoia_prices_overhead_as_forward_time():
    from specplan.planner.sequoia import SequoiaTables, rank_candidates

    shifted, with_overhead = profiles()
    tables = SequoiaTables(np.array([0.6, 0.2, 0.1]), 16, 6)
    plain = rank_candidates(tables, LatencyProfile.from_dict(BASE, "base"))
    a, b = rank_candidates(tables, shifted), rank_candidates(tables, with_overhead)
    assert [(c.size, c.depth, c.speedup) for c in a] == [(c.size, c.depth, pytest.approx(c.speedup)) for c in b]
    assert b[0].speedup != pytest.approx(plain[0].speedup)  # the overhead was charged


def test_lookahead_prices_overhead_and_trie_time_per_step():
    from specplan.core.method_settings import TrieSettings
    from specplan.planner.lookahead import predicted_speedup, replay

    shifted, with_overhead = profiles()
    text = [5, 6, 7, 8, 9] * 8
    result = replay([types.SimpleNamespace(prompt=text[:10], output=text)], TrieSettings.sized(8, 4))
    assert result.trie_seconds > 0
    result = dataclasses.replace(result, trie_seconds=0.0)
    assert predicted_speedup(result, shifted)[0] == pytest.approx(predicted_speedup(result, with_overhead)[0])
    speedup, step = predicted_speedup(result, with_overhead)
    slower, slower_step = predicted_speedup(dataclasses.replace(result, trie_seconds=0.5 * result.steps),
                                            with_overhead)
    assert slower_step == pytest.approx(step + 0.5) and slower == pytest.approx(speedup * step / (step + 0.5))


def test_triforce_prices_overhead_as_forward_time():
    from specplan.core.acceptance_schema import TriForceEntry, TriForceTrace
    from specplan.planner.triforce_cost import evaluate, evaluate_traces

    shifted, with_overhead = profiles()
    entry = TriForceEntry(context=4096, budget=256, chunk=8, stride=64, middle=0.7, bottom=0.5,
                          traces=[TriForceTrace(np.array([1.0, 1.0, 0.0, 1.0, 1.0, 1.0]), np.ones(6))])
    for gamma1, bottom in ((2, 0.001), (1, None)):
        a = evaluate(shifted, 4096, entry, gamma1, 4, bottom)
        b = evaluate(with_overhead, 4096, entry, gamma1, 4, bottom)
        assert a.speedup == pytest.approx(b.speedup) and a.step_seconds == pytest.approx(b.step_seconds)
        a = evaluate_traces(shifted, 4096, entry, gamma1, 3, bottom, {})
        b = evaluate_traces(with_overhead, 4096, entry, gamma1, 3, bottom, {})
        assert a.speedup == pytest.approx(b.speedup) and a.step_seconds == pytest.approx(b.step_seconds)
