"""`plan profile`: measured profiles on tiny models, the roofline against a hand calculation, resume, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from core.errors import UserError
from core.profile_schema import load_profile
from decoder.model import ModelShape
from profiler import latency, roofline

QUICK = ["--contexts", "16,64", "--sizes", "1,2,4,8", "--repeats", "2"]


def test_measured_profile_is_readable_by_the_planner(run_cli, tmp_path):
    out = tmp_path / "profiles" / "tiny.yaml"
    code, stdout, stderr = run_cli("profile", "--model", "tiny-random-llama", "--draft", "tiny-random-llama-draft",
                                   *QUICK, "--budgets", "32", "--window-prefill", "4,20", "-o", out)
    assert code == 0, stderr
    profile = load_profile(out)
    # the drafter's window prefill: the draft's, where a draft is profiled, for exactly these sizes
    assert 0 < profile.window_prefill("draft", 4, 20) < 1 and set(profile.window_prefills) == {"draft"}
    assert profile.window_prefill("draft", 4, 24) is None
    assert set(profile.builds_by_context) == {64}  # a budget of 32 fits below 64 tokens only
    assert 0 < profile.retrieval_build(64, 32) == profile.builds_by_context[64][32]
    assert profile.source == "measured"
    assert set(profile.target_by_context) == {16, 64}
    assert set(profile.target_t_seconds) == {1, 2, 4, 8}
    assert all(t > 0 for t in profile.target_t_seconds.values())
    assert profile.draft_step_seconds > 0 and profile.draft_step(64) > 0
    raw = yaml.safe_load(out.read_text())
    assert raw["hardware"]["threads"] >= 1 and raw["hardware"]["torch"]
    assert raw["model_fingerprints"]["target"]["layers"] == 2
    assert raw["target"]["contexts"][64]["spread_seconds"][1][0] <= raw["target"]["contexts"][64]["t_seconds"][1]
    assert not list(out.parent.glob(".*partial*"))
    assert set(profile.overhead_seconds) == {1, 2, 4, 8} and raw["target"]["engine_overhead_context"] == 16
    assert all(0 < seconds < 0.1 for seconds in profile.overhead_seconds.values())
    code, stdout, _ = run_cli("show", out, "--plot", tmp_path / "p.png")
    assert code == 0 and "L=64" in stdout and "window prefill (4 sinks + 20 recent tokens)" in stdout


def test_engine_overhead_is_the_time_outside_the_forwards(monkeypatch):
    """A forward made 20 ms slower leaves the overhead alone; a verification walk made 5 ms slower adds 5 ms."""
    import time

    from decoder.verify import GreedyMatch

    from toy import toy_model

    _, model = toy_model(0)
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: (time.sleep(0.02), forward(*a, **k))[1])
    base = latency.engine_overhead(model, 8, [1, 4], steps=4)
    assert all(seconds < 0.01 for seconds in base.values()), base
    walk = GreedyMatch.walk
    monkeypatch.setattr(GreedyMatch, "walk", lambda *a: (time.sleep(0.005), walk(*a))[1])
    slow = latency.engine_overhead(model, 8, [1, 4], steps=4)
    assert all(0.005 <= slow[n] < base[n] + 0.01 for n in (1, 4)), (base, slow)


def test_interrupted_profile_leaves_no_output_and_resumes(run_cli, tmp_path, monkeypatch):
    """Two warm-up passes and two timed ones (QUICK); interrupted in the second timed pass, the resumed run
    times only that one again, after its warm-up."""
    out = tmp_path / "tiny.yaml"
    real = latency._time_pass
    passes = {"n": 0}

    def interrupt_in_the_second_timed_pass(calls):
        passes["n"] += 1
        if passes["n"] == 4:
            raise KeyboardInterrupt
        return real(calls)

    monkeypatch.setattr(latency, "_time_pass", interrupt_in_the_second_timed_pass)
    # the window prefill's sizes are part of what a resume must match
    code, _, stderr = run_cli("profile", "--model", "tiny-random-qwen2", *QUICK, "--window-prefill", "2,8", "-o", out)
    assert code == 130 and not out.exists()

    passes["n"] = 0
    monkeypatch.setattr(latency, "_time_pass", lambda calls: passes.update(n=passes["n"] + 1) or real(calls))
    code, _, stderr = run_cli("profile", "--model", "tiny-random-qwen2", *QUICK, "--window-prefill", "2,8",
                              "--resume", "-o", out)
    assert code == 0, stderr
    assert passes["n"] == 3
    assert len(load_profile(out).target_t_seconds) == 4
    assert load_profile(out).window_prefill("target", 2, 8) > 0  # no draft: the target drafts for itself
    assert not list(tmp_path.glob(".*partial*"))


def test_draft_vocabulary_is_timed_and_recorded(run_cli, tmp_path):
    out = tmp_path / "tiny.yaml"
    code, stdout, stderr = run_cli("profile", "--model", "tiny-random-llama", "--draft", "tiny-random-llama-draft",
                                   "--draft-vocab", 64, "--contexts", "16", "--sizes", "1,2", "--repeats", 1, "-o", out)
    assert code == 0, stderr
    assert load_profile(out).draft_vocab == 64 and "draft scores ids < 64" in stdout
    code, _, stderr = run_cli("profile", "--model", "tiny-random-llama", "--draft", "tiny-random-llama-draft",
                              "--draft-vocab", 9999, "--contexts", "16", "--sizes", "1", "-o", tmp_path / "bad.yaml")
    assert code == 2 and "outside 1..260" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad.yaml").exists()


def test_roofline_reads_only_the_kept_output_rows():
    shape = ModelShape("qwen2", 24, 896, 14, 2, 64, 151936, 32768, 1e6, 1e-6)
    full = roofline.ModelCost.from_shape(shape, 4864, "bf16")
    limited = roofline.ModelCost.from_shape(shape, 4864, "bf16", output_rows=65537)
    assert full.matmul_params - limited.matmul_params == (151936 - 65537) * 896


def test_roofline_against_a_hand_calculation():
    # A Llama-7B-like shape: 32 layers, hidden 4096, 32 heads (no GQA), intermediate 11008, vocab 32000.
    shape = ModelShape("llama", 32, 4096, 32, 32, 128, 32000, 4096, 10000.0, 1e-6)
    cost = roofline.ModelCost.from_shape(shape, 11008, "bf16")
    per_layer = 4096 * (3 * 4096) + 4096 * 4096 + 3 * 4096 * 11008  # 202,375,168
    assert cost.matmul_params == 32 * per_layer + 32000 * 4096  # 6,607,077,376
    assert cost.kv_bytes_per_token == 2 * 32 * 4096 * 2  # 524,288 bytes = 0.5 MiB per token
    gpu = roofline.accelerator("a100-80g")
    bandwidth, flops = roofline.gpu_rates(gpu, "bf16")
    assert bandwidth == pytest.approx(2039e9 * 0.8) and flops == pytest.approx(312e12 * 0.6)
    # n = 1 at L = 1024: memory bound. bytes = 2 * 6,607,077,376 + 524,288 * 1025 = 13,751,549,952.
    t = roofline.roofline_seconds(cost, 1, 1024, bandwidth, flops, gpu.overhead_s)
    assert t == pytest.approx(100e-6 + 13_751_549_952 / 1_631.2e9, rel=1e-9)  # 8.53 ms
    # n = 512 at L = 1024: compute bound. flops = 2 * 6,607,077,376 * 512 + 4 * 4096 * 32 * 512 * 1536.
    t = roofline.roofline_seconds(cost, 512, 1024, bandwidth, flops, gpu.overhead_s)
    hand = 100e-6 + (6_765_647_233_024 + 412_316_860_416) / 187.2e12
    assert t == pytest.approx(hand, rel=1e-9)  # 38.4 ms


def test_modeled_gpu_profile_is_labelled(run_cli, tmp_path):
    out = tmp_path / "a100.yaml"
    code, _, stderr = run_cli("profile", "--model", "tiny-random-llama", "--gpu", "a100-80g", "--contexts", "128,1024",
                              "-o", out)
    assert code == 0, stderr
    profile = load_profile(out)
    assert profile.source == "modeled"
    curve = profile.target_curve(1024)
    assert curve(512) > curve(1) > 0
    assert yaml.safe_load(out.read_text())["hardware"]["gpu"] == "a100-80g"


def test_model_too_big_for_the_gpu():
    gpu = roofline.accelerator("rtx4090")
    shape = ModelShape("llama", 80, 8192, 64, 8, 128, 32000, 4096, 10000.0, 1e-5)
    cost = roofline.ModelCost.from_shape(shape, 28672, "bf16")
    with pytest.raises(UserError, match="needs .* GB"):
        roofline.check_fits(gpu, "llama-70b", cost, 70_000_000_000, 4096)


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "tiny-random-llama", "--gpu", "b200"], "unknown GPU"),
    (["--model", "tiny-random-llama", "--contexts", "8000"], "exceeds"),
    (["--model", "tiny-random-llama", "--gpu", "v100", "--dtype", "bf16"], "no bf16"),
    (["--model", "tiny-random-llama", "--sizes", "2,4"], "include 1"),
    (["--model", "tiny-random-llama", "--contexts", "1,x"], "integers"),
    (["--model", "tiny-random-llama", "--window-prefill", "1024"], "SINKS,WINDOW"),
    (["--model", "tiny-random-llama", "--window-prefill", "4,100000"], "does not fit"),
])
def test_profile_bad_input(args, message, run_cli, tmp_path):
    out = tmp_path / "p.yaml"
    defaults = {"--contexts": "64", "--sizes": "1,2"}
    extra = [x for key, value in defaults.items() if key not in args for x in (key, value)]
    code, _, stderr = run_cli("profile", *args, *extra, "-o", out)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_support_and_covering_are_the_points_an_interpolation_reads():
    from core.profile_schema import LatencyCurve, covering

    points = {1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0, 16: 3.5, 32: 7.0, 64: 15.0}
    support = LatencyCurve(points).support(5)
    assert support == [1, 2, 4, 8, 16]
    sizes = np.arange(1, 6)
    before = LatencyCurve(points)(sizes)
    assert np.array_equal(LatencyCurve({**points, 32: 9.0, 64: 30.0})(sizes), before)
    assert not np.allclose(LatencyCurve({**points, 16: 5.0})(sizes), before)  # the slope at 8 reads 16
    assert LatencyCurve(points).support(64) == list(points)
    contexts = [256, 1024, 4096]
    assert covering(contexts, 2000, 2000) == [1024, 4096]
    assert covering(contexts, 1024, 1024) == [1024]
    assert covering(contexts, 4096, 4351) == [4096]  # clamped above the last context
    assert covering(contexts, 100, 300) == [256, 1024]
