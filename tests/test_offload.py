"""Offloading on a modeled GPU (profiler/offload.py): the placement, the copy/compute pipeline, and the profiles and
plans `plan profile --gpu NAME --offload weights|kv [--gpus N]` gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specplan.core.errors import UserError
from specplan.core.profile_schema import load_profile
from specplan.profiler import roofline
from specplan.profiler.offload import (
    LINK_EFFICIENCY,
    STREAM_BUFFERS,
    DeviceSetup,
    ModelBytes,
    pipelined_seconds,
)

from toy import one_error

CONFIGS = Path(__file__).resolve().parents[1] / "bench" / "configs"
GB = 1e9


def test_the_pipeline_is_bound_by_the_slower_of_the_link_and_the_compute():
    assert pipelined_seconds(2.0, [0.0] * 5) == pytest.approx(10.0)  # nothing streamed: the layers one by one
    # link-bound: copies back to back, the last layer computes after the last copy
    assert pipelined_seconds(1.0, [3.0] * 4) == pytest.approx(4 * 3.0 + 1.0)
    # compute-bound: two buffers let copy 3 start only when layer 1 has computed (t = 1 + 5), copy 4 when layer 2 has
    copies = [1.0] * 4
    assert pipelined_seconds(5.0, copies) == pytest.approx(1.0 + 4 * 5.0)
    assert pipelined_seconds(5.0, copies, buffers=1) == pytest.approx(4 * (1.0 + 5.0))
    # resident layers first: their compute (0-4) hides the first STREAM_BUFFERS copies (0-2, 2-4); the third copy
    # waits for the first streamed layer to free its buffer (4-5), then copies 5-7 and 7-9 and the last layer 9-10
    assert STREAM_BUFFERS == 2 and pipelined_seconds(1.0, [0.0] * 4 + [2.0] * 4) == pytest.approx(10.0)


def _llama(name: str, dtype: str = "fp16", gpus: int = 1) -> ModelBytes:
    from specplan.core.models import load_model_spec
    from specplan.decoder.model import ModelShape

    spec = load_model_spec(str(CONFIGS / f"{name}.json"), dtype)
    return ModelBytes.of(ModelShape.from_config(spec.config), spec.config.intermediate_size,
                         spec.fingerprint["parameters"], dtype, gpus)


def test_weights_fill_the_device_first_and_the_rest_streams():
    l40 = roofline.accelerator("l40")
    target, draft = _llama("llama-2-70b"), _llama("llama-2-7b")
    filled = DeviceSetup(l40, offload="weights").place(target, 256, draft, 256)
    streamed = DeviceSetup(l40, offload="weights", resident="none").place(target, 256, draft, 256)
    assert filled.fits and streamed.fits and streamed.resident_layers == 0
    assert len(filled.streamed_per_layer) == target.layers and 0 < filled.resident_layers < target.layers
    # what stays: everything but the streamed layers, two buffers and the reserve fit the 48 GB
    kept = (target.weights - (target.layers - filled.resident_layers) * target.layer + STREAM_BUFFERS * target.layer
            + draft.weights + target.kv_per_token * 256 + draft.kv_per_token * 256)
    assert kept <= DeviceSetup(l40).usable_bytes < kept + target.layer
    assert streamed.streamed == pytest.approx(target.layers * target.layer)
    assert streamed.streamed > filled.streamed
    assert not DeviceSetup(l40).place(target, 256).fits  # 138 GB of weights on one 48 GB GPU
    assert not DeviceSetup(roofline.accelerator("t4"), offload="weights").place(target, 256, draft, 256).fits


def test_the_kv_cache_keeps_what_fits_and_streams_the_rest_of_every_layer():
    setup = DeviceSetup(roofline.accelerator("rtx4090"), gpus=2, offload="kv")
    target = _llama("llama-2-7b-128k", gpus=2)
    short, long = setup.place(target, 4096), setup.place(target, 130_048)
    assert short.fits and short.streamed == 0 and short.resident_tokens == 4096
    assert long.fits and 0 < long.resident_tokens < 130_048 and len(set(long.streamed_per_layer)) == 1
    per_layer = target.kv_per_token / target.layers
    held = (target.weights + long.resident_tokens * target.kv_per_token
            + STREAM_BUFFERS * (130_048 - long.resident_tokens) * per_layer)
    assert held <= setup.usable_bytes < held + target.kv_per_token
    assert long.streamed == pytest.approx((130_048 - long.resident_tokens) * target.kv_per_token)


def test_tensor_parallelism_splits_the_heads_and_refuses_what_does_not_split():
    from specplan.core.models import load_model_spec
    from specplan.decoder.model import ModelShape

    spec = load_model_spec(str(CONFIGS / "llama-2-70b.json"), "fp16")
    shape = ModelShape.from_config(spec.config)
    shard, width = DeviceSetup(roofline.accelerator("a100-80g"), gpus=4).shard(shape, 28672, "70b")
    assert (shard.heads, shard.kv_heads, width, shard.hidden) == (16, 2, 7168, 8192)
    with pytest.raises(UserError, match="64 attention heads do not split over 3 GPUs"):
        DeviceSetup(roofline.accelerator("a100-80g"), gpus=3).shard(shape, 28672, "70b")
    one = DeviceSetup(roofline.accelerator("a100-80g"))
    assert one.allreduce_seconds(8, 8192, "fp16") == 0.0
    two = DeviceSetup(roofline.accelerator("a100-80g"), gpus=2)
    link = 31.5e9 * LINK_EFFICIENCY
    assert two.allreduce_seconds(8, 8192, "fp16") == pytest.approx(2 * (20e-6 + 8 * 8192 * 2 / link))


@pytest.mark.parametrize("flags, message", [
    (("--offload", "weights"), "need --gpu NAME"),
    (("--gpu", "l40", "--resident", "none"), "it needs --offload"),
    (("--gpu", "t4"), "do not fit 1 x t4 (16 GB each); model it with --offload weights|kv or --gpus N"),
])
def test_bad_offload_requests_fail_in_one_line(run_cli, tmp_path, flags, message):
    out = tmp_path / "p.yaml"
    code, _, err = run_cli("profile", "--target", CONFIGS / "llama-2-13b.json", "--dtype", "fp16", "--contexts", "256",
                           "--sizes", "1,2", *flags, "-o", out)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_an_offloaded_profile_is_flat_in_n_and_its_tree_is_larger(run_cli, tmp_path):
    """Llama-2-13B in fp16 on a 16 GB T4: half its layers cross the PCIe 3 link every forward, so t(n) barely moves up
    to hundreds of tokens and Sequoia's tree grows far beyond the one it picks where the model fits (two A100s)."""
    sizes = "1,2,4,8,16,32,64,128,256,512"
    profiles, shown = {}, {}
    setups = {"t4": ("--gpu", "t4", "--offload", "weights"), "a100": ("--gpu", "a100-80g", "--gpus", "2")}
    for name, flags in setups.items():
        profiles[name] = tmp_path / f"{name}.yaml"
        code, shown[name], err = run_cli("profile", "--target", CONFIGS / "llama-2-13b.json", "--draft",
                                         CONFIGS / "llama-68m.json", "--dtype", "fp16", "--contexts", "256",
                                         "--sizes", sizes, *flags, "-o", profiles[name])
        assert code == 0, err
    assert "hardware: t4, weights offloaded over pcie3-x16" in shown["t4"] and "GB per GPU streamed" in shown["t4"]
    assert "hardware: 2 x a100-80g\n" in shown["a100"]
    offloaded = load_profile(profiles["t4"])
    hardware = offloaded.hardware
    assert hardware["offload"] == "weights" and hardware["host_link"]["name"] == "pcie3-x16"
    entry = yaml.safe_load(profiles["t4"].read_text())["target"]["contexts"][256]
    assert entry["streamed_gb"] > 10 and 0 < entry["resident_layers"] < 40
    t = offloaded.target_t_seconds
    link = 15.75e9 * LINK_EFFICIENCY
    assert t[1] == pytest.approx(entry["streamed_gb"] * 1e9 / link, rel=0.05)  # the link sets the pace
    assert t[256] < 1.1 * t[1]
    on_chip = load_profile(profiles["a100"])
    assert on_chip.machine["gpus"] == 2 and on_chip.target_t_seconds[256] > 1.5 * on_chip.target_t_seconds[1]
    acceptance = Path(__file__).resolve().parents[1] / "acceptance" / \
        "qwen2.5-coder-1.5b+0.5b.sequoia.specbench.t0.bf16.yaml"
    sizes_chosen = {}
    for name, profile in profiles.items():
        plan = tmp_path / f"plan.{name}.yaml"
        code, _, err = run_cli("solve", "sequoia", "--acceptance", acceptance, "--profile", profile, "--max-size", 512,
                               "--max-depth", 24, "--stand-in", "-o", plan)
        assert code == 0, err
        sizes_chosen[name] = yaml.safe_load(plan.read_text())["tree"]["size"]
    assert sizes_chosen["t4"] >= 5 * sizes_chosen["a100"]


# --- the decoder with offloaded weights (decoder/offload.py), host and device both the CPU ---------------------------

def test_streamed_layers_compute_what_resident_ones_do_and_cross_once_per_forward(tiny_pair):
    import torch

    from specplan.core.models import load_model
    from specplan.decoder.model import LeanModel, causal_mask

    loaded = load_model("tiny-random-llama")
    resident = LeanModel(loaded.model, kernels=False)
    layers = resident.shape.layers
    tokens, positions = torch.tensor([5, 9, 2, 7]), torch.arange(4)
    expected = resident.forward(tokens, positions, resident.new_cache(16), causal_mask(0, 4, resident.dtype, "cpu"))
    for kept in range(layers + 1):
        streamed = LeanModel(loaded.model, kernels=False, resident_layers=kept)
        stream = streamed.layer_stream
        assert len(stream.buffers) == min(STREAM_BUFFERS, layers - kept) and len(streamed.layers) == layers
        for forward in (1, 2):  # a second forward refills the buffers from the start
            cache = streamed.new_cache(16)
            logits = streamed.forward(tokens, positions, cache, causal_mask(0, 4, streamed.dtype, "cpu"))
            assert torch.equal(logits, expected)
            assert stream.copied_layers == forward * (layers - kept)
        assert stream.streamed_bytes == sum(w.numel() * w.element_size() for layer in streamed.layers[kept:]
                                            for w in layer.values() if isinstance(w, torch.Tensor))
    with pytest.raises(UserError, match="between 0 and the model's"):
        LeanModel(loaded.model, kernels=False, resident_layers=layers + 1)


def test_an_offloaded_target_decodes_its_own_greedy_tokens(run_cli, tmp_path):
    """The target's layers streamed, decoding alone and verifying a Sequoia tree: the same greedy tokens as the target
    resident; refused in one line where the weights cannot stream (GGUF blocks)."""
    from specplan.decoder.api import load_decoder
    from specplan.decoder.sampling import SamplingParams

    prompt = [3, 14, 15, 92, 65, 35]
    plain = load_decoder(target="tiny-random-llama", device="cpu").generate(prompt, 12, SamplingParams()).result
    for kept in (0, 1):
        decoder = load_decoder(target="tiny-random-llama", device="cpu", offload="weights", resident_layers=kept)
        result = decoder.generate(prompt, 12, SamplingParams()).result
        assert result.tokens == plain.tokens
        assert decoder.target_forward.layer_stream.copied_layers > 0
    from specplan.core.models import load_model
    from specplan.decoder.drafters import SequoiaDrafter
    from specplan.decoder.engine import SpeculativeEngine
    from specplan.decoder.model import LeanModel

    loaded = load_model("tiny-random-llama")
    target = LeanModel(loaded.model, kernels=False, resident_layers=1)
    draft = LeanModel(load_model("tiny-random-llama-draft").model)
    tree = SpeculativeEngine(target, SequoiaDrafter(draft, [-1, 0, 0, 1, 1, 2, 3])).generate(prompt, 12,
                                                                                            SamplingParams())
    assert tree.tokens == plain.tokens and tree.steps < 12
    code, _, err = run_cli("generate", "--target", "tiny-random-llama", "--prompt", "hi", "--max-new-tokens", 2,
                           "--offload", "weights", "--dtype", "gguf")
    assert code == 2 and "fp32 or bf16" in err and one_error(err)
    code, _, err = run_cli("serve", "--target", "tiny-random-llama", "--port", 0, "--offload", "kv", "--dtype", "gguf")
    assert code == 2 and "fp32 or bf16" in err and one_error(err)  # plan serve takes the same flags
    code, _, err = run_cli("serve", "--target", "tiny-random-llama", "--port", 0, "--resident-layers", 1)
    assert code == 2 and "it needs --offload weights" in err and one_error(err)


@pytest.mark.slow
def test_sampling_with_streamed_layers_is_distributed_as_the_target():
    """Sequoia's tree verified by the target whose layers all stream through the buffers: the first two sampled
    tokens follow the target's distribution."""
    from specplan.decoder.drafters import SequoiaDrafter
    from specplan.decoder.engine import SpeculativeEngine
    from specplan.decoder.model import LeanModel
    from specplan.decoder.sampling import SamplingParams

    from toy import (
        SAMPLES,
        assert_distributed_as_target,
        first_tokens_distribution,
        sample_first_tokens_batched,
        toy_model,
    )

    target_hf, _ = toy_model(10)
    target = LeanModel(target_hf, kernels=False, resident_layers=0)
    _, draft = toy_model(10, noise=0.6)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    prompt, parents = [1, 4, 2, 5, 3], [-1, 0, 0, 1, 1, 2, 3]
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, parents))
    counts, accepted = sample_first_tokens_batched(engine, lambda: SequoiaDrafter(draft, parents), prompt, params,
                                                SAMPLES)
    assert accepted > 0.2 and target.layer_stream.copied_layers > 0
    assert_distributed_as_target(counts, first_tokens_distribution(target_hf, prompt, params))


@pytest.mark.parametrize("target, flags, context, paper_ms", [
    # Sequoia (Table 5's setting): Llama2-70B in fp16 on an L40, every layer streamed, as its offloading system does
    ("llama-2-70b", ("--gpu", "l40", "--offload", "weights", "--resident", "none", "--draft",
                     CONFIGS / "llama-2-7b.json"), 256, 5600),
    # TriForce (Table 3): 127K-token prompts, the KV cache offloaded, two RTX 4090s
    ("llama-2-7b-128k", ("--gpu", "rtx4090", "--gpus", "2", "--offload", "kv"), 127 * 1024, 840),
    ("llama-2-13b-128k", ("--gpu", "rtx4090", "--gpus", "2", "--offload", "kv"), 127 * 1024, 1794),
])
def test_modeled_offloading_meets_the_papers_autoregressive_baselines(run_cli, tmp_path, target, flags, context,
                                                                       paper_ms):
    out = tmp_path / "p.yaml"
    code, _, err = run_cli("profile", "--target", CONFIGS / f"{target}.json", "--dtype", "fp16", "--contexts", context,
                           "--sizes", "1,2", *flags, "-o", out)
    assert code == 0, err
    assert load_profile(out).target_t_seconds[1] * 1e3 == pytest.approx(paper_ms, rel=0.2)


def test_a_cache_in_host_memory_streams_every_layer_and_computes_the_same():
    """The target's KV cache in host memory: each forward copies every layer's cached rows to the device once and
    writes its new rows back; prefill, a tree of rows and a commit give what the resident cache gives."""
    import torch

    from specplan.core.models import load_model
    from specplan.decoder.model import LeanModel, causal_mask

    loaded = load_model("tiny-random-llama")
    resident, streamed = LeanModel(loaded.model, kernels=False), LeanModel(loaded.model, kernels=False, offload_kv=True)
    caches = [model.cache_for(32, "target") for model in (resident, streamed)]
    assert caches[0].stream is None and caches[1].stream is not None and caches[1].k.device.type == "cpu"
    assert streamed.cache_for(8, "draft").stream is None  # only the target's own cache lives in host memory
    layers = streamed.shape.layers
    prompt = torch.tensor([5, 9, 2, 7, 11])
    no = float("-inf")
    steps = [(prompt, torch.arange(5), causal_mask(0, 5, resident.dtype, "cpu")),
             (torch.tensor([3, 4, 6]), torch.tensor([5, 6, 6]),  # a tree: two children of the first new row
              torch.tensor([[0.0, no, no], [0.0, 0.0, no], [0.0, no, 0.0]]))]
    copied = 0
    for tokens, positions, tree in steps:
        start = caches[1].length
        mask = torch.cat([torch.zeros(len(tokens), start), tree], 1) if start else tree
        outputs = [model.forward(tokens, positions, cache, mask) for model, cache in zip((resident, streamed), caches)]
        assert torch.equal(outputs[0], outputs[1])
        copied += layers * start
        assert caches[1].stream.copied_rows == copied
        for cache in caches:
            cache.commit(torch.tensor([0, 2]) if start else None, 2 if start else 5)
    assert torch.equal(caches[0].k[:, :, :7], caches[1].k[:, :, :7])


def test_triforce_with_its_full_cache_in_host_memory_is_lossless():
    """TriForce's offloading layout: the full cache in host memory, the retrieval cache on the device (here both the
    CPU): the hierarchy's greedy tokens are the target's own."""
    from specplan.core.method_settings import RetrievalSettings
    from specplan.core.models import load_model
    from specplan.decoder.drafters import NoDrafter
    from specplan.decoder.engine import SpeculativeEngine
    from specplan.decoder.model import LeanModel
    from specplan.decoder.sampling import SamplingParams
    from specplan.decoder.triforce import HierarchicalDrafter

    from toy import hf_greedy, long_prompt

    loaded = load_model("tiny-random-llama")
    target = LeanModel(loaded.model, kernels=False, offload_kv=True)
    prompt = long_prompt(300, 3)
    drafter = HierarchicalDrafter(target, NoDrafter(), 1, 3, RetrievalSettings(256, 16, 32))
    engine = SpeculativeEngine(target, drafter)
    result = engine.generate(prompt, 40, SamplingParams())
    assert result.tokens == hf_greedy(loaded, prompt, 40)
    assert engine.cache.stream is not None and drafter.retrieval.cache.stream is None and drafter.retrieval.builds
