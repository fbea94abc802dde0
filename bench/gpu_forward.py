"""On a GPU: one forward of n new tokens over L cached ones, three ways side by side: the lean forward replayed as
a CUDA graph (the decoder today), the same forward through torch.compile captured in a graph (decoder/cuda_graphs.py:
compile_forward), and transformers' own forward (eager, its dynamic cache, as its `generate` runs it). Also the
kernels one forward launches (torch.profiler), the compile time, and how far the compiled logits are from the
graphed eager ones (largest difference, top-1 agreement).

Weights are random, drawn from the model's config: a forward's time does not depend on their values, and a lent
GPU can be sent 64 MiB per call, less than any preset's weights.

    python bench/gpu_forward.py --config DIR_WITH_CONFIG_JSON --dtypes fp32,bf16 --contexts 256,4096 --sizes 1,16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from specplan.decoder.cuda_graphs import compile_forward
from specplan.decoder.model import LeanModel, causal_mask
from specplan.profiler.latency import _cuda_graph_call, random_cache

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def kernels_per_forward(forward, *args) -> int:
    """CUDA kernels launched by one call of `forward` (run eagerly, outside any graph)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward(*args)
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def static_inputs(model: LeanModel, context: int, n: int):
    """tokens, positions, the static layout's mask over all context + n slots, and the slots written."""
    tokens = torch.randint(0, model.shape.vocab, (n,), device="cuda")
    positions = torch.arange(context, context + n, device="cuda")
    return tokens, positions, causal_mask(context, n, model.dtype, "cuda"), positions.clone()


def hf_step_ms(hf, context: int, n: int, repeats: int) -> float:
    """Median ms of transformers' forward of n tokens after a prefill of `context` random tokens."""
    cache = DynamicCache(config=hf.config)
    prompt = torch.randint(0, hf.config.vocab_size, (1, context), device="cuda")
    hf(input_ids=prompt, past_key_values=cache, use_cache=True)
    times = []
    for _ in range(repeats):
        step = torch.randint(0, hf.config.vocab_size, (1, n), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf(input_ids=step, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="a directory holding the model's config.json")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--contexts", default="256,4096")
    parser.add_argument("--sizes", default="1,16")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.config)
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = [int(n) for n in args.sizes.split(",")]
    print(f"{config.model_type} ({config.num_hidden_layers} layers, hidden {config.hidden_size}) on "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; random weights", flush=True)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        torch.manual_seed(0)
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        graphed, compiled = LeanModel(hf, "cuda"), LeanModel(hf, "cuda")
        compile_forward(compiled)
        for context in contexts:
            for n in sizes:
                caches = [random_cache(m, context, n) for m in (graphed, compiled)]
                caches[1].k.copy_(caches[0].k)
                caches[1].v.copy_(caches[0].v)
                inputs = static_inputs(graphed, context, n)
                full_mask = inputs[2]  # the caches hold exactly context + n slots
                eager_logits = graphed.forward(inputs[0], inputs[1], caches[0], full_mask, slots=inputs[3]).float()
                start = time.perf_counter()
                compiled_logits = compiled.forward(inputs[0], inputs[1], caches[1], full_mask, slots=inputs[3]).float()
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - start
                difference = (compiled_logits - eager_logits).abs().max().item()
                agree = (compiled_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item()
                kernels = [kernels_per_forward(m.forward, inputs[0], inputs[1], c, full_mask, None, inputs[3])
                           for m, c in zip((graphed, compiled), caches)]
                pool = torch.cuda.graph_pool_handle()
                calls = [_cuda_graph_call(m, c, inputs[0], inputs[1], pool)
                         for m, c in zip((graphed, compiled), caches)]
                times: list[list[float]] = [[], []]
                for _ in range(args.repeats):  # interleaved
                    for i, call in enumerate(calls):
                        times[i].append(call() * 1e3)
                graph_ms, compiled_ms = (statistics.median(t) for t in times)
                hf_ms = hf_step_ms(hf, context, n, min(args.repeats, 30))
                rows.append((dtype_name, context, n, graph_ms, compiled_ms, hf_ms, kernels[0], kernels[1], compile_s,
                             difference, agree))
                print(f"{dtype_name} L={context} n={n}: graphs {graph_ms:.3f} ms, compiled+graphs {compiled_ms:.3f} ms,"
                      f" transformers {hf_ms:.3f} ms; kernels {kernels[0]} vs {kernels[1]}; compile {compile_s:.1f} s;"
                      f" max |logit diff| {difference:.2e}, top-1 agree {agree:.2f}", flush=True)
                del calls, caches
        del hf, graphed, compiled
        torch.cuda.empty_cache()
    print("\n| dtype | L | n | graphs (ms) | compiled + graphs (ms) | transformers eager (ms) | graphs / compiled "
          "| transformers / compiled | kernels per forward: eager, compiled | max logit diff | top-1 agree |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype_name, context, n, graph_ms, compiled_ms, hf_ms, k_eager, k_compiled, _, difference, agree in rows:
        print(f"| {dtype_name} | {context} | {n} | {graph_ms:.3f} | {compiled_ms:.3f} | {hf_ms:.3f} | "
              f"{graph_ms / compiled_ms:.2f}x | {hf_ms / compiled_ms:.2f}x | {k_eager}, {k_compiled} | "
              f"{difference:.1e} | {agree:.2f} |")


if __name__ == "__main__":
    main()
