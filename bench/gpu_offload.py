"""Offloading on a lent GPU (issue 52's device check): the host link's rate, and t(n) of a Llama-2-13B-shaped model
(random weights, fp16) with its layers streamed from pinned host memory, beside the modeled profile of the same
setup (profiler/offload.py with the measured link rate).

    .venv/bin/python bench/gpu_offload.py [--resident 0] [--sizes 1,16,128,512,1024] [--context 256]

Prints the pinned host-to-device rate (1 GiB copies, median of 5), then for each n the measured forward (median of
3 after a warm-up) against the model's. The weights are left uninitialized (a forward's time does not depend on
their values), so building 13B parameters takes seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specplan.core.models import config_from_json
from specplan.decoder.model import LeanModel, ModelShape, causal_mask
from specplan.profiler import roofline
from specplan.profiler.offload import LINK_EFFICIENCY, DeviceSetup, HostLink, ModelBytes, Placement, host_link
from specplan.profiler.operators import gpu_operators

CONFIG = Path(__file__).resolve().parent / "configs" / "llama-2-13b.json"
COPY_BYTES = 1 << 30


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resident", type=int, default=0, help="layers kept on the device")
    parser.add_argument("--sizes", default="1,16,128,512,1024")
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    rate = link_rate()
    gpu = roofline.accelerator(torch.cuda.get_device_name(0))
    raw = host_link(gpu.host_link).gb_s
    print(f"{gpu.name}: pinned host-to-device {rate / 1e9:.1f} GB/s, {rate / 1e9 / raw:.2f} of {gpu.host_link}'s "
          f"raw rate (modeled: {LINK_EFFICIENCY})", flush=True)

    config = config_from_json(CONFIG)
    with torch.device("meta"):  # then uninitialized memory: a forward's time does not depend on the values
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    hf = hf.to_empty(device="cpu")
    parameters = sum(weight.numel() for weight in hf.parameters())
    model = LeanModel(hf, "cuda", release=True, resident_layers=args.resident)
    del hf
    cache = model.new_cache(args.context + max(sizes))
    cache.length = args.context
    measured = {}
    with torch.inference_mode():
        for n in sizes:
            tokens, positions = torch.zeros(n, dtype=torch.long), torch.arange(args.context, args.context + n)
            mask = causal_mask(args.context, n, model.dtype, "cuda") if n > 1 else None
            times = []
            for _ in range(4):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.forward(tokens, positions, cache, mask)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            measured[n] = statistics.median(times[1:])

    # the same layout, modeled on the measured link (its raw rate set so that LINK_EFFICIENCY gives the measured one)
    shape = ModelShape.from_config(config)
    setup = DeviceSetup(gpu, offload="weights", link=HostLink("measured", rate / 1e9 / LINK_EFFICIENCY, "here"))
    cost = roofline.gpu_model_cost(shape, config.intermediate_size, "fp16", gpu_operators(config, "fp16"))
    layer = ModelBytes.of(shape, config.intermediate_size, parameters, "fp16", 1).layer
    placed = Placement(True, (0.0,) * args.resident + (layer,) * (shape.layers - args.resident))
    print(f"{'n':>6} {'measured ms':>12} {'modeled ms':>11} {'ratio':>6}")
    for n, seconds in measured.items():
        chip = roofline.gpu_forward_seconds(cost, gpu, roofline.DEFAULT_PARAMETERS, n, args.context)
        modeled = setup.forward_seconds(chip, shape.layers, 0.0, placed)
        print(f"{n:>6} {seconds * 1e3:>12.1f} {modeled * 1e3:>11.1f} {seconds / modeled:>6.2f}")


if __name__ == "__main__":
    main()
