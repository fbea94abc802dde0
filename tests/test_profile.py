"""`plan profile`: measured profiles on tiny models, the roofline against a hand calculation, resume, bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import yaml

from specplan.core.errors import UserError
from specplan.core.profile_schema import load_profile
from specplan.decoder.model import ModelShape
from specplan.profiler import latency, roofline
from specplan.profiler.operators import OperatorCounts, gpu_operators

from toy import one_error

QUICK = ["--contexts", "16,64", "--sizes", "1,2,4,8", "--repeats", "2"]


def test_measured_profile_is_readable_by_the_planner(run_cli, tmp_path):
    out = tmp_path / "profiles" / "tiny.yaml"
    code, stdout, stderr = run_cli("profile", "--target", "tiny-random-llama", "--draft", "tiny-random-llama-draft",
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
    # the draft's prefill of a prompt as long as each context, spread per token in between
    draft_prefills = profile.prompt_prefills["draft"]
    assert set(draft_prefills) == {16, 64} and all(s > 0 for s in draft_prefills.values())
    assert profile.draft_prefill(32) == pytest.approx(32 * np.interp(32, [16, 64], [
        draft_prefills[16] / 16, draft_prefills[64] / 64]))
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
    """On a clock that only the model's forward (20 ms) and the verification walk (5 ms when slowed) advance, the
    overhead is exactly the walk's time: the forwards' time is taken out, the rest of the step is kept."""
    import time

    from specplan.decoder.verify import GreedyMatch

    from toy import toy_model

    clock = {"seconds": 0.0}

    def advance(seconds: float) -> None:
        clock["seconds"] += seconds

    monkeypatch.setattr(time, "perf_counter", lambda: clock["seconds"])
    _, model = toy_model(0)
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: (advance(0.02), forward(*a, **k))[1])
    assert latency.engine_overhead(model, 8, [1, 4], steps=4) == {1: 0.0, 4: 0.0}
    walk = GreedyMatch.walk
    monkeypatch.setattr(GreedyMatch, "walk", lambda *a: (advance(0.005), walk(*a))[1])
    slow = latency.engine_overhead(model, 8, [1, 4], steps=4)
    assert slow == {1: pytest.approx(0.005), 4: pytest.approx(0.005)}


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
    code, _, stderr = run_cli("profile", "--target", "tiny-random-qwen2", *QUICK, "--window-prefill", "2,8", "-o", out)
    assert code == 130 and not out.exists()

    passes["n"] = 0
    monkeypatch.setattr(latency, "_time_pass", lambda calls: passes.update(n=passes["n"] + 1) or real(calls))
    code, _, stderr = run_cli("profile", "--target", "tiny-random-qwen2", *QUICK, "--window-prefill", "2,8",
                              "--resume", "-o", out)
    assert code == 0, stderr
    assert passes["n"] == 3
    assert len(load_profile(out).target_t_seconds) == 4
    assert load_profile(out).window_prefill("target", 2, 8) > 0  # no draft: the target drafts for itself
    assert not list(tmp_path.glob(".*partial*"))


def test_draft_vocabulary_is_timed_and_recorded(run_cli, tmp_path):
    out = tmp_path / "tiny.yaml"
    code, stdout, stderr = run_cli("profile", "--target", "tiny-random-llama", "--draft", "tiny-random-llama-draft",
                                   "--draft-vocab", 64, "--contexts", "16", "--sizes", "1,2", "--repeats", 1, "-o", out)
    assert code == 0, stderr
    assert load_profile(out).draft_vocab == 64 and "draft scores ids < 64" in stdout
    code, _, stderr = run_cli("profile", "--target", "tiny-random-llama", "--draft", "tiny-random-llama-draft",
                              "--draft-vocab", 9999, "--contexts", "16", "--sizes", "1", "-o", tmp_path / "bad.yaml")
    assert code == 2 and "outside 1..260" in stderr and one_error(stderr)
    assert not (tmp_path / "bad.yaml").exists()


def test_roofline_reads_only_the_kept_output_rows():
    shape = ModelShape("qwen2", 24, 896, 14, 2, 64, 151936, 32768, 1e6, 1e-6)
    full = roofline.ModelCost.from_shape(shape, 4864, "bf16")
    limited = roofline.ModelCost.from_shape(shape, 4864, "bf16", output_rows=65537)
    assert full.matmul_params - limited.matmul_params == (151936 - 65537) * 896


LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
             "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "eos_token_id": 2}
GPT_FAST_LLAMA2_7B_A100_MS = 1e3 / 104.9  # pytorch-labs/gpt-fast README: Llama-2-7B, A100 80GB, 104.9 tokens/s


def test_gpu_model_against_a_hand_calculation():
    """One matmul, no attention width: the kernels' floors, the weight stream and the multi-row key term add up."""
    gpu = roofline.accelerator("a100-80g")
    p = roofline.DEFAULT_PARAMETERS
    cost = roofline.GpuModelCost(layers=2, gemms=((2, 4096, 4096),), kv_bytes_per_token=1024, attention_width=0,
                                 heads=8, head_dim=64, dtype="bf16",
                                 operators=OperatorCounts({"single": 40, "grouped": 50, "masked": 60}, {}, {}))
    bandwidth = 2039e9 * p.bandwidth_efficiency
    kernels = 40 + 2 * roofline.SDPA_KERNELS["tensor"]
    floor = p.op_seconds + p.op_row_seconds
    hand = (kernels - 2) * floor + 2 * (4096 * 4096 * 2 / bandwidth) + 1024 * 1025 / bandwidth
    assert roofline.gpu_forward_seconds(cost, gpu, p, 1, 1024) == pytest.approx(hand, rel=1e-12)
    # two rows over 8192 keys: grouped matmuls (no SDPA kernels), a GEMM's floor, the per-key mask cost and the
    # score matrix's 8 heads x 2 rows per key
    floor = p.op_seconds + 2 * p.op_row_seconds
    occupancy = min(1.0, 4096 / 128 * max(1.0, 4096 / p.gemm_split_depth_tensor) / 108)  # column tiles x splits
    gemm = max(4096 * 4096 * 2 / bandwidth,  # 2 rows run a 4-row tile
               2 * 4 * 4096 * 4096 / (312e12 * p.gemm_efficiency("tensor", 2) * occupancy))
    hand = ((50 - 2) * floor + 2 * (p.gemm_floor("tensor", 2) + gemm) + 1024 * 8194 / bandwidth
            + 2 * 8194 * (p.attention_key_seconds_grouped_tensor + 8 * 2 * p.attention_score_seconds_grouped_tensor))
    assert roofline.gpu_forward_seconds(cost, gpu, p, 2, 8192) == pytest.approx(hand, rel=1e-12)
    # two rows over 1024 keys in bf16: SDPA with a mask, whose per-key cost grows with the head size
    masked = roofline.gpu_forward_seconds(cost, gpu, p, 2, 1022)
    wider = roofline.gpu_forward_seconds(replace(cost, head_dim=128), gpu, p, 2, 1022)
    assert wider - masked == pytest.approx(2 * 1024 * 64 * p.attention_key_dim_seconds_masked_tensor, rel=1e-9)
    compiled = roofline.gpu_forward_seconds(cost, gpu, p, 1, 1024, "compiled")
    eager = roofline.gpu_forward_seconds(cost, gpu, p, 1, 1024, "eager")
    assert compiled < roofline.gpu_forward_seconds(cost, gpu, p, 1, 1024) <= eager
    graphs = roofline.gpu_forward_seconds(cost, gpu, p, 1, 1024)
    assert eager == pytest.approx(max(kernels * p.eager_op_seconds, graphs))


def test_each_further_sequence_of_a_batched_gpu_step_adds_its_own_kernels():
    """A batched step runs each sequence's cache writes and attention apart (its projections and MLP together):
    counted from the decoder's forward, the kernels grow by the same number per further sequence, and the model
    pays them (with SDPA's own launches where attention runs through it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specplan.decoder.model import LeanModel
    from specplan.profiler.operators import PATH_PROBES, _shrunk, count_forward

    fields = dict(LLAMA2_7B)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("cpu"):
        model = LeanModel(AutoModelForCausalLM.from_config(_shrunk(config, 2)), "cpu", kernels=False)
    for n, context in PATH_PROBES.values():
        two, three, five = (count_forward(model, n, context, static=True, sequences=b) for b in (2, 3, 5))
        assert five - three == 2 * (three - two) > 0, (n, context)
    counts = gpu_operators(config, "bf16")
    assert all(counts.sequence[path] > 0 and counts.batching[path] >= 0 for path in PATH_PROBES)
    cost = roofline.gpu_model_cost(ModelShape.from_config(config), config.intermediate_size, "bf16", counts)
    sdpa = config.num_hidden_layers * roofline.SDPA_KERNELS["tensor"]
    assert cost.kernels(1, 512, "graphs") == counts.forward["single"] + sdpa
    assert cost.kernels(1, 512, "graphs", batch=8) == (counts.forward["single"] + counts.batching["single"]
                                                        + 7 * counts.sequence["single"] + 8 * sdpa)
    assert cost.kernels(2, 8192, "graphs", batch=8) == (counts.forward["grouped"] + counts.batching["grouped"]
                                                         + 7 * counts.sequence["grouped"])
    gpu, p = roofline.accelerator("h100"), roofline.DEFAULT_PARAMETERS
    one_row_each = [roofline.gpu_forward_seconds(cost, gpu, p, 1, 512, batch=b) for b in (1, 2)]
    assert one_row_each[1] - one_row_each[0] > (counts.sequence["single"] + sdpa) * p.op_seconds


def test_deep_tensor_core_gemms_split_over_the_gpu():
    """A skinny GEMM of few column tiles fills few multiprocessors unless its depth is split (split-K): a deeper
    matrix of the same output width costs no more FLOP time per FLOP on the tensor cores, but more in fp32."""
    gpu = roofline.accelerator("h100")
    no_attention = {name: 0.0 for name in roofline.PARAMETER_NAMES
                    if name.startswith(("attention_key", "attention_score"))}
    p = replace(roofline.DEFAULT_PARAMETERS, gemm_floor_seconds_tensor_rows32=0.0, gemm_floor_seconds_fp32_rows32=0.0,
                op_seconds=0.0, op_row_seconds=0.0, bandwidth_efficiency=1e3, **no_attention)  # compute alone

    def gemm_seconds(k: int, dtype: str) -> float:
        cost = roofline.GpuModelCost(layers=1, gemms=((1, k, 1024),), kv_bytes_per_token=0, attention_width=0,
                                     heads=1, head_dim=64, dtype=dtype,
                                     operators=OperatorCounts({"grouped": 1, "masked": 1, "single": 1}, {}, {}))
        return roofline.gpu_forward_seconds(cost, gpu, p, 32, 0)

    assert gemm_seconds(16 * 1024, "bf16") / gemm_seconds(4 * 1024, "bf16") < 4 * 0.5
    assert gemm_seconds(16 * 1024, "fp32") / gemm_seconds(4 * 1024, "fp32") == pytest.approx(4, rel=0.01)


def test_a_config_alone_models_llama2_7b_on_an_a100(run_cli, tmp_path, monkeypatch):
    """No weights: a config.json is enough; t(1) within 20% of gpt-fast's (a compiled forward; ours in graphs and
    compiled)."""
    config = tmp_path / "llama-2-7b" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(LLAMA2_7B))
    out = tmp_path / "a100.yaml"
    monkeypatch.setattr(latency, "load_model", lambda *a, **k: pytest.fail("a config alone loads no weights"))
    code, _, stderr = run_cli("profile", "--target", config, "--gpu", "a100-80g", "--dtype", "fp16",
                              "--contexts", "256,1024", "-o", out)
    assert code == 0, stderr
    profile = load_profile(out)
    assert profile.dtype == "fp16" and profile.source == "modeled"
    assert profile.models["target"] == str(config.parent.resolve())
    assert profile.target_by_context[256][1] == pytest.approx(GPT_FAST_LLAMA2_7B_A100_MS / 1e3, rel=0.20)
    assert profile.overhead_seconds  # modeled plans are charged the engine's work per step
    document = yaml.safe_load(out.read_text())
    assert document["settings"]["execution"] == "graphs"
    compiled = tmp_path / "compiled.yaml"
    code, _, stderr = run_cli("profile", "--target", config.parent, "--gpu", "a100-80g", "--dtype", "fp16",
                              "--backend", "compiled", "--contexts", "256", "-o", compiled)
    assert code == 0, stderr
    t1 = load_profile(compiled, ("compiled",)).target_by_context[256][1]
    assert t1 < profile.target_by_context[256][1]
    assert t1 == pytest.approx(GPT_FAST_LLAMA2_7B_A100_MS / 1e3, rel=0.20)
    assert document["model_fingerprints"]["target"]["parameters"] == 6_738_415_616  # Llama-2-7B's count


def test_gemm_costs_go_by_bucket_of_rows():
    """A GEMM's floor is its bucket's; on the tensor cores a bigger bucket is never less efficient than a smaller
    one, in fp32 it is the bucket's own (the library's kernel choice: t(32) < t(16) was measured)."""
    p = replace(roofline.DEFAULT_PARAMETERS, gemm_efficiency_tensor_rows32=0.5, gemm_efficiency_tensor_rows64=0.2,
                gemm_efficiency_fp32_rows16=0.5, gemm_efficiency_fp32_rows32=0.2, gemm_floor_seconds_fp32_rows4=7e-6,
                gemm_floor_seconds_fp32_rows8=1e-6)
    assert p.gemm_efficiency("tensor", 64) == 0.5 and p.gemm_efficiency("tensor", 20) == 0.5
    assert p.gemm_efficiency("fp32", 32) == 0.2
    assert p.gemm_floor("fp32", 3) == 7e-6 and p.gemm_floor("fp32", 5) == 1e-6


def test_larger_targets_choose_trees_no_larger_on_a_modeled_a100(tmp_path):
    """The Sequoia paper's observation: on one GPU, for one acceptance vector and one draft, a 13B or 33B target's
    optimal tree is not larger than a 7B's."""
    from specplan.planner.sequoia import SequoiaTables, rank_candidates

    shapes = {"7b": LLAMA2_7B,
              "13b": {**LLAMA2_7B, "hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40,
                      "num_key_value_heads": 40, "num_hidden_layers": 40},
              "33b": {**LLAMA2_7B, "hidden_size": 6656, "intermediate_size": 17920, "num_attention_heads": 52,
                      "num_key_value_heads": 52, "num_hidden_layers": 60}}
    draft = tmp_path / "draft.json"  # a JackFram/llama-68m-like draft
    draft.write_text(json.dumps({**LLAMA2_7B, "hidden_size": 768, "intermediate_size": 3072,
                                 "num_attention_heads": 12, "num_key_value_heads": 12, "num_hidden_layers": 2}))
    tables = SequoiaTables(np.array([0.63, 0.11, 0.06, 0.035, 0.02, 0.015, 0.01, 0.008, 0.006, 0.005]), 256, 16)
    sizes = []
    for name, config in shapes.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        request = latency.ProfileRequest(target=str(path), draft=str(draft), dtype="fp16", gpu="a100-80g",
                                         contexts=[512], sizes=[1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256])
        best = rank_candidates(tables, latency.run_profile(request, tmp_path / f"{name}.yaml", log=lambda m: None))[0]
        sizes.append(best.size)
    assert sizes[1] <= sizes[0] and sizes[2] <= sizes[0]


def test_any_rope_variant_is_modeled(run_cli, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA2_7B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 4096}}))
    code, _, stderr = run_cli("profile", "--target", config, "--gpu", "h100", "--dtype", "bf16", "--contexts", "256",
                              "--sizes", "1,4", "-o", tmp_path / "yarn.yaml")
    assert code == 0, stderr


def test_calibration_fits_the_gpu_to_measured_profiles(run_cli, tmp_path):
    out = tmp_path / "calibrated.yaml"
    code, _, stderr = run_cli("profile", "--target", "tiny-random-qwen2", "--gpu", "h100", "--dtype", "bf16",
                              "--calibrate", "profiles/smollm2-135m.h100.bf16.yaml", "--contexts", "256",
                              "--sizes", "1,2,4", "-o", out)
    assert code == 0, stderr
    calibration = yaml.safe_load(out.read_text())["settings"]["calibration"]
    assert calibration["files"] == ["profiles/smollm2-135m.h100.bf16.yaml"]
    assert 0 <= calibration["points_rms_log_error"] < 0.3
    assert set(calibration["parameters"]) == set(roofline.PARAMETER_NAMES)


@pytest.mark.slow
def test_one_profile_calibrates_what_it_can_tell_and_keeps_the_rest():
    """One small model's profile cannot tell the weight stream's bandwidth from the kernels' floors: unweighted, the
    fit trades one for the other (bandwidth 0.44 of the datasheet's for smollm2 bf16, its own points within 0.5%);
    the pull towards the catalogue keeps the bandwidth near the defaults' and the profile's points still fit."""
    from specplan.profiler.calibration import calibrate, fit, read_measured

    path = "profiles/smollm2-135m.h100.bf16.yaml"
    unweighted = fit([read_measured(path, "h100")])
    calibration = calibrate("h100", [path])
    default = roofline.DEFAULT_PARAMETERS.bandwidth_efficiency
    assert abs(unweighted.parameters.bandwidth_efficiency / default - 1) > 0.3
    assert abs(calibration.parameters.bandwidth_efficiency / default - 1) < 0.1
    assert calibration.rms_log_error < 0.05


def test_modeled_gpu_profile_is_labelled(run_cli, tmp_path):
    out = tmp_path / "a100.yaml"
    code, _, stderr = run_cli("profile", "--target", "tiny-random-llama", "--gpu", "a100-80g", "--contexts", "128,1024",
                              "-o", out)
    assert code == 0, stderr
    profile = load_profile(out)
    assert profile.source == "modeled"
    curve = profile.target_curve(1024)
    assert curve(512) > curve(1) > 0
    assert yaml.safe_load(out.read_text())["hardware"]["gpu"] == "a100-80g"
    by_device_name = tmp_path / "by-device-name.yaml"  # as nvidia-smi prints it
    code, _, stderr = run_cli("profile", "--target", "tiny-random-llama", "--gpu", "NVIDIA A100-SXM4-80GB",
                              "--contexts", "128,1024", "-o", by_device_name)
    assert code == 0, stderr
    assert load_profile(by_device_name).target_by_context == profile.target_by_context
    assert yaml.safe_load(by_device_name.read_text())["hardware"]["gpu"] == "a100-80g"


@pytest.mark.parametrize("device, name", [
    ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA A100-PCIE-40GB", "a100-40g"),
    ("NVIDIA A100 80GB PCIe", "a100-80g-pcie"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA H200", "h200"), ("NVIDIA L4", "l4"), ("NVIDIA L40", "l40"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA RTX A6000", "a6000"), ("NVIDIA GeForce RTX 3090", "rtx3090"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"), ("Tesla V100-SXM2-32GB", "v100"), ("Tesla T4", "t4"), ("NVIDIA A10", "a10"),
    ("NVIDIA A10G", "a10"), ("NVIDIA GH200 480GB", None), ("NVIDIA GeForce RTX 3090 Ti", None), ("NVIDIA A40", None),
])
def test_device_names_map_to_one_catalogue_gpu(device, name):
    """torch's device name decides whether `plan profile --gpu NAME` measures or models, and which GPU a measured
    profile calibrates: an A100 80GB once matched the 40GB entry (0.76x its bandwidth), an H100 PCIe the SXM5 one."""
    assert roofline.catalogue_name(device) == name


@pytest.mark.parametrize("name, variant", [("a100", "a100-80g"), ("A100", "a100-80g"), ("h100", "h100"),
                                           ("a100-40g", "a100-40g"), ("NVIDIA A100-SXM4-40GB", "a100-40g")])
def test_a_gpus_bare_name_is_its_sxm_variant(name, variant):
    """`plan profile --gpu a100` models an A100 as `--gpu h100` models an H100: the SXM variant with the most memory;
    a variant or device name keeps its own."""
    assert roofline.accelerator(name).name == variant


def test_every_catalogue_gpu_prices_a_7b_token_by_its_bandwidth():
    """One bf16/fp16 token of Llama-2-7B streams its 13.2 GB of matmul weights: no GPU does it faster than its
    datasheet bandwidth allows, and a GPU with more bandwidth does it sooner (the kernels' costs are shared)."""
    from transformers import AutoConfig

    fields = dict(LLAMA2_7B)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    weights = 2 * 6_607_077_376  # the matmuls' parameters (the output matrix too), at 2 bytes
    t1 = {}
    for gpu in roofline.CATALOGUE.values():
        dtype = "bf16" if "bf16" in gpu.tflops else "fp16"
        cost = roofline.gpu_model_cost(ModelShape.from_config(config), config.intermediate_size, dtype,
                                       gpu_operators(config, dtype))
        t1[gpu.name] = roofline.gpu_forward_seconds(cost, gpu, roofline.DEFAULT_PARAMETERS, 1, 256)
        assert t1[gpu.name] > weights / (gpu.bandwidth_gb_s * 1e9), gpu.name
    by_bandwidth = sorted(roofline.CATALOGUE.values(), key=lambda gpu: gpu.bandwidth_gb_s)
    for slower, faster in zip(by_bandwidth, by_bandwidth[1:]):
        assert t1[faster.name] <= t1[slower.name], (slower.name, faster.name)


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "tiny-random-llama", "--gpu", "b200"], "unknown GPU"),
    (["--model", "tiny-random-llama", "--engine", "vllm"], "vLLM's execution on a GPU not at hand"),
    (["--model", "tiny-random-llama", "--contexts", "8000"], "exceeds"),
    (["--model", "tiny-random-llama", "--gpu", "v100", "--dtype", "bf16"], "no bf16"),
    (["--model", "tiny-random-llama", "--sizes", "2,4"], "include 1"),
    (["--model", "tiny-random-llama", "--contexts", "1,x"], "integers"),
    (["--model", "tiny-random-llama", "--window-prefill", "1024"], "SINKS,WINDOW"),
    (["--model", "tiny-random-llama", "--window-prefill", "4,100000"], "does not fit"),
    (["--model", "tiny-random-llama", "--dtype", "fp16"], "fp16 is modeled only"),
    (["--model", "tiny-random-llama", "--gpu", "a100-80g", "--row-totals", "8"], "the machine at hand"),
    (["--model", "tiny-random-llama", "--gpu", "a100-80g", "--calibrate", "profiles/smollm2-135m.h100.bf16.yaml"],
     "not on a100-80g"),
    (["--model", "tiny-random-llama", "--gpu", "h100", "--calibrate", "profiles/smollm2-135m.cpu-2c.fp32.yaml"],
     "needs a profile measured on a GPU"),
    (["--model", "CONFIG_WITHOUT_LAYERS", "--gpu", "a100-80g"], "lacks num_hidden_layers"),
])
def test_profile_bad_input(args, message, run_cli, tmp_path):
    out = tmp_path / "p.yaml"
    if "CONFIG_WITHOUT_LAYERS" in args:
        config = tmp_path / "config.json"
        config.write_text(json.dumps({key: value for key, value in LLAMA2_7B.items() if key != "num_hidden_layers"}))
        args = [str(config) if arg == "CONFIG_WITHOUT_LAYERS" else arg for arg in args]
    defaults = {"--contexts": "64", "--sizes": "1,2"}
    extra = [x for key, value in defaults.items() if key not in args for x in (key, value)]
    code, _, stderr = run_cli("profile", *args, *extra, "-o", out)
    assert code == 2 and message in stderr and one_error(stderr)
    assert not out.exists()


def test_support_and_covering_are_the_points_an_interpolation_reads():
    from specplan.core.profile_schema import LatencyCurve, covering

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


def test_a_batched_profile_prices_steps_of_many_sequences(run_cli, tmp_path):
    """--batches: t(B, n) per context for B x n up to 256 rows, and the draft's batched step; B = 1 is the plain
    t(n); between profiled batch sizes linear in B; sequences at mixed contexts priced at their mean context."""
    out = tmp_path / "batched.yaml"
    code, stdout, stderr = run_cli("profile", "--target", "tiny-random-llama", "--draft", "tiny-random-llama-draft",
                                   *QUICK, "--batches", "1,2,4,64", "--budgets", "", "--row-totals", "12", "-o", out)
    assert code == 0, stderr
    profile = load_profile(out)
    # --row-totals: the target's one-sequence forward at every n up to 12 besides the sizes, the draft's at the sizes
    assert profile.every_size_up_to == 12 and "timed at every n up to 12" in stdout
    assert set(profile.raw["draft"]["contexts"][64]["t_seconds"]) == {1, 2, 4, 8}
    assert set(profile.target_batches) == {16, 64}
    assert set(profile.target_batches[64]) == {2, 4, 64}
    assert set(profile.target_batches[64][4]) == {1, 2, 4, 8} and set(profile.target_batches[64][64]) == {1, 2, 4}
    assert profile.batch_sizes == [1, 2, 4, 64]
    assert profile.batch_latency(1, 4, 64) == pytest.approx(profile.target_by_context[64][4])
    assert profile.batch_latency(4, 2, 64) == pytest.approx(profile.target_batches[64][4][2])
    assert profile.batch_latency(3, 2, 64) == pytest.approx(
        (profile.target_batches[64][2][2] + profile.target_batches[64][4][2]) / 2)
    assert profile.batch_latency(2, 1, [16, 64]) == pytest.approx(
        (profile.target_batches[16][2][1] + profile.target_batches[64][2][1]) / 2)
    assert 0 < profile.draft_batch_step(4, 64) == profile.draft_batches[64][4]
    assert "batched steps at L=64" in stdout
    # every request's prefill as it joins, the target's, at each context (the serving price's)
    assert set(profile.prompt_prefills) == {"target", "draft"} and set(profile.prompt_prefills["target"]) == {16, 64}
    assert 0 < profile.prompt_prefill("target", 40) < 1
    # the continuous-batching engine's work per step around the forward, per B and tree size (B x n <= 256 rows)
    overhead = profile.overhead_batches
    assert set(overhead) == {2, 4, 64} and set(overhead[4]) == set(profile.overhead_seconds)
    assert set(overhead[64]) == {n for n in profile.overhead_seconds if 64 * n <= 256}
    assert all(seconds >= 0 for by_n in overhead.values() for seconds in by_n.values())
    assert profile.engine_overhead(8, 4) == pytest.approx(overhead[4][8])
    assert profile.engine_overhead(8, 3) == pytest.approx((overhead[2][8] + overhead[4][8]) / 2)
    assert profile.engine_overhead(1, 128) == pytest.approx(2 * overhead[64][1])
    with pytest.raises(UserError, match="reach B = 64, not 128"):
        profile.batch_latency(128, 1, 64)
    with pytest.raises(UserError, match="for n = 8"):
        profile.batch_latency(64, 8, 64)  # 512 rows: not timed


def test_a_modeled_gpu_prices_batched_steps_and_marks_the_batch_that_does_not_fit(run_cli, tmp_path):
    """t(B, n) on a GPU not at hand: the weights read once per step, so a batch of 8 one-token steps costs far less
    than 8 steps (each sequence's own cache writes and attention kernels add to it); at a long context the KV
    caches of a large batch exceed the GPU's memory and are marked."""
    out = tmp_path / "modeled.yaml"
    code, _, stderr = run_cli("profile", "--target", "qwen2.5-coder-1.5b", "--gpu", "a100-80g", "--dtype", "bf16",
                              "--contexts", "512,32000", "--sizes", "1,4,16", "--batches", "1,8,128", "-o", out)
    assert code == 0, stderr
    profile = load_profile(out)
    one = profile.batch_latency(1, 1, 512)
    assert one < profile.batch_latency(8, 1, 512) < 4 * one
    assert profile.batch_latency(128, 16, 512) > profile.batch_latency(8, 16, 512)
    raw = yaml.safe_load(out.read_text())["target"]["contexts"]
    assert raw[512]["batches"][128]["fits_memory"] and not raw[32000]["batches"][128]["fits_memory"]
    # vLLM's attention takes the batch in one call: the same step without each further sequence's kernels
    code, _, stderr = run_cli("profile", "--target", "qwen2.5-coder-1.5b", "--gpu", "a100-80g", "--dtype", "bf16",
                              "--contexts", "512", "--sizes", "1,4", "--batches", "1,8", "--engine", "vllm",
                              "-o", tmp_path / "vllm.yaml")
    assert code == 0, stderr
    vllm = load_profile(tmp_path / "vllm.yaml")
    assert vllm.batch_latency(1, 4, 512) == profile.batch_latency(1, 4, 512)
    assert one < vllm.batch_latency(8, 1, 512) < profile.batch_latency(8, 1, 512)
