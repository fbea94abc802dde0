"""Offloading on a lent GPU (issue 52's device check): the host link's rate, and t(n) of a Llama-2-13B-shaped model
(random weights, fp16) with its layers streamed from pinned host memory, beside the modeled profile of the same
setup (profiler/offload.py with the measured link rate); with --sequoia, a Sequoia plan's step on it.

    .venv/bin/python bench/gpu_offload.py [--resident 0] [--sizes 1,16,128,512,1024] [--context 256]
    .venv/bin/python bench/gpu_offload.py --sizes 1 --sequoia plans/llama-2-13b.sequoia.h200-all.fp16.modeled.yaml

Prints the pinned host-to-device rate (1 GiB copies, median of 5), then for each n the measured forward (median of
3 after a warm-up) against the model's. `--sequoia PLAN`: the plan's draft (a Llama-2-7B shape, random weights) on
the device, graphed as the decoder runs it, grows the plan's tree level by level and the streamed target verifies
it (SpeculativeEngine.generate, every step drafted); one step's seconds, and the target's forward of the tree alone,
against the plan's modeled step (profile t(n) + depth x the draft's step) and the same priced on the measured link.
The weights are uniform random, drawn on the device (seconds for 13B parameters): a forward's time does not depend
on their values, and decoding needs finite logits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from specplan.core.models import config_from_json
from specplan.core.plan_schema import load_plan
from specplan.core.profile_schema import load_profile
from specplan.decoder.cuda_graphs import enable_cuda_graphs
from specplan.decoder.drafters import SequoiaDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.model import LeanModel, ModelShape, causal_mask
from specplan.decoder.sampling import SamplingParams
from specplan.profiler import roofline
from specplan.profiler.offload import LINK_EFFICIENCY, DeviceSetup, HostLink, ModelBytes, Placement, host_link
from specplan.profiler.operators import gpu_operators

CONFIGS = Path(__file__).resolve().parent / "configs"
CONFIG = CONFIGS / "llama-2-13b.json"
DRAFT_CONFIG = CONFIGS / "llama-2-7b.json"
COPY_BYTES = 1 << 30
# Generations of these many new tokens: their difference in decode seconds over their difference in steps is one
# step, the first step's draft prefill taken out.
SHORT_GENERATION, LONG_GENERATION = 2, 6
INIT_RANGE = 0.02  # random weights' uniform range: small enough that activations stay finite in fp16


def link_rate() -> float:
    """Pinned host-to-device bytes per second."""
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return COPY_BYTES / statistics.median(times[1:])


def random_model(config: Any, dtype: torch.dtype, host: bool) -> torch.nn.Module:
    """A transformers model of `config` with uniform random weights, in host memory (`host`) or on the device; drawn
    on the device where there is one (seconds for billions of parameters) and copied where they stay."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device="cpu" if host else device)
    with torch.no_grad():
        for weight in model.parameters():
            weight.copy_(torch.empty(weight.shape, dtype=dtype, device=device).uniform_(-INIT_RANGE, INIT_RANGE))
    return model


def timed_forward(model: LeanModel, n: int, context: int) -> float:
    """The median seconds of 3 forwards (after a warm-up) of n new tokens over `context` cached ones."""
    cache = model.new_cache(context + n)
    cache.length = context
    tokens, positions = torch.zeros(n, dtype=torch.long), torch.arange(context, context + n)
    mask = causal_mask(context, n, model.dtype, model.device) if n > 1 else None
    times = []
    for _ in range(4):
        synchronize()
        start = time.perf_counter()
        model.forward(tokens, positions, cache, mask)
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StreamedModel:
    """The modeled forward of a model whose layers past the first `resident` stream over a link of `link_rate`
    bytes per second (its raw rate set so that LINK_EFFICIENCY gives it)."""

    def __init__(self, gpu: roofline.Accelerator, config: Any, parameters: int, resident: int, link_rate: float):
        self.gpu, self.shape = gpu, ModelShape.from_config(config)
        self.setup = DeviceSetup(gpu, offload="weights",
                                 link=HostLink("measured", link_rate / 1e9 / LINK_EFFICIENCY, "here"))
        self.cost = roofline.gpu_model_cost(self.shape, config.intermediate_size, "fp16", gpu_operators(config, "fp16"))
        layer = ModelBytes.of(self.shape, config.intermediate_size, parameters, "fp16", 1).layer
        self.placed = Placement(True, (0.0,) * resident + (layer,) * (self.shape.layers - resident))

    def forward_seconds(self, n: int, context: int) -> float:
        chip = roofline.gpu_forward_seconds(self.cost, self.gpu, roofline.DEFAULT_PARAMETERS, n, context)
        return self.setup.forward_seconds(chip, self.shape.layers, 0.0, self.placed)


def sequoia_step(plan_path: str, target: LeanModel, draft_config: Path, context: int, streamed: StreamedModel) -> None:
    """Time a Sequoia plan's step, `target` (streamed) verifying the tree that a draft of `draft_config` (random
    weights, on the device) grows; print it against the plan's modeled step, and the same with the verify priced by
    `streamed` (the measured link)."""
    plan = load_plan(plan_path)
    profile = load_profile(plan.inputs["profile"]["file"])
    if profile.hardware.get("gpu") != streamed.gpu.name:
        raise SystemExit(f"{plan_path} is priced for {profile.hardware.get('gpu')}, not this {streamed.gpu.name}: "
                         "solve one on a profile of this GPU (BENCHMARKS.md, 'On the GPU')")
    config = config_from_json(draft_config)
    draft = LeanModel(random_model(config, target.dtype, host=False), target.device, release=True)
    if draft.device.type == "cuda":
        enable_cuda_graphs(draft)
    engine = SpeculativeEngine(target, SequoiaDrafter(draft, list(plan.tree.parents)))
    prompt = torch.randint(0, config.vocab_size, (context,)).tolist()
    size, depth = plan.tree.size, plan.tree.depth
    with torch.inference_mode():
        engine.generate(prompt, SHORT_GENERATION, SamplingParams())  # graphs captured, buffers allocated
        short = engine.generate(prompt, SHORT_GENERATION, SamplingParams())
        long = engine.generate(prompt, LONG_GENERATION, SamplingParams())
        if long.steps <= short.steps:
            raise SystemExit(f"the random draft's trees were accepted whole ({long.steps} steps for {LONG_GENERATION} "
                             "tokens): no step to time apart from the first")
        step = (long.decode_seconds - short.decode_seconds) / (long.steps - short.steps)
        verify = timed_forward(target, size, context)
    modeled = plan.prediction.step_seconds  # the solver's price: the profile's t(n) and the draft's levels
    modeled_verify = float(profile.step_seconds(size, context))
    on_link = modeled - modeled_verify + streamed.forward_seconds(size, context)
    print(f"Sequoia step, tree n = {size}, d = {depth} ({plan_path}):\n"
          f"  measured {step * 1e3:.1f} ms: the verify alone {verify * 1e3:.1f}, the draft's levels and the rest "
          f"{(step - verify) * 1e3:.1f}\n"
          f"  modeled {modeled * 1e3:.1f} ms: the verify {modeled_verify * 1e3:.1f}, the draft's {depth} levels "
          f"{(modeled - modeled_verify) * 1e3:.1f}; measured / modeled {step / modeled:.2f}\n"
          f"  modeled on the measured link {on_link * 1e3:.1f} ms; measured / modeled {step / on_link:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resident", type=int, default=0, help="layers kept on the device")
    parser.add_argument("--sizes", default="1,16,128,512,1024")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sequoia", help="a Sequoia plan solved on this GPU's offloaded profile: time its step")
    args = parser.parse_args()
    rate = link_rate()
    gpu = roofline.accelerator(torch.cuda.get_device_name(0))
    raw = host_link(gpu.host_link).gb_s
    print(f"{gpu.name}: pinned host-to-device {rate / 1e9:.1f} GB/s, {rate / 1e9 / raw:.2f} of {gpu.host_link}'s "
          f"raw rate (modeled: {LINK_EFFICIENCY})", flush=True)

    config = config_from_json(CONFIG)
    hf = random_model(config, torch.float16, host=True)
    parameters = sum(weight.numel() for weight in hf.parameters())
    model = LeanModel(hf, "cuda", release=True, resident_layers=args.resident)
    del hf
    streamed = StreamedModel(gpu, config, parameters, args.resident, rate)
    print(f"{'n':>6} {'measured ms':>12} {'modeled ms':>11} {'ratio':>6}")
    with torch.inference_mode():
        for n in (int(n) for n in args.sizes.split(",")):
            seconds, modeled = timed_forward(model, n, args.context), streamed.forward_seconds(n, args.context)
            print(f"{n:>6} {seconds * 1e3:>12.1f} {modeled * 1e3:>11.1f} {seconds / modeled:>6.2f}", flush=True)
    if args.sequoia:
        sequoia_step(args.sequoia, model, DRAFT_CONFIG, args.context, streamed)


if __name__ == "__main__":
    main()
