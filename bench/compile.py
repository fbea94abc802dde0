"""The CPU kernels against torch.compile done as gpt-fast does it, on this CPU: whether the kernels' half of the lean
forward (fp32 and bf16 weights) earns its keep (decision rule: keep a compiled path only if it is at least 10% faster).

The compiled side is gpt-fast's shape of the forward (pytorch-labs/gpt-fast, model.py): an nn.Module whose weights are
its parameters, frozen by inductor (`torch._inductor.config.freezing`: constant-folded and prepacked), a static KV
cache of `context + the largest tree` slots written with index_copy_ at the new tokens' positions, attention over every
slot through SDPA with a mask, and one compiled graph per number of new tokens (`dynamic=False`), our tree sizes as the
buckets. Both sides score n new tokens after the same `context` cached ones (the compiled cache is copied from the
kernels' prefill), timed interleaved, median of --repeats calls each; the largest logit difference is reported.

    .venv/bin/python bench/compile.py --model smollm2-135m --dtypes fp32,bf16 --sizes 1,4,16 --context 512
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F
from timing import interleaved_medians
from torch import nn

from specplan.core.machine import cpu_info
from specplan.core.models import load_model
from specplan.decoder.model import LeanModel, causal_mask


class StaticForward(nn.Module):
    """A Llama-family forward (smollm2's: no biases, no q/k norms) over a static cache, gpt-fast style."""

    def __init__(self, lean: LeanModel, max_len: int) -> None:
        super().__init__()
        frozen = lambda tensor: nn.Parameter(tensor.detach().clone(), requires_grad=False)  # noqa: E731
        shape = lean.shape
        self.shape, self.eps, self.scale = shape, shape.rms_eps, lean.architecture.attention_scale
        self.q_size, self.kv_size = lean.q_size, lean.kv_size
        self.embed = frozen(lean.embed)
        self.final_norm = frozen(lean.final_norm)
        self.output = frozen(lean.output_weight)
        self.layers = nn.ModuleList()
        for layer in lean.layers:
            block = nn.Module()
            for name in ("input_layernorm", "post_attention_layernorm", "wqkv", "wo", "w_gate_up", "w_down"):
                setattr(block, name, frozen(layer[name]))
            self.layers.append(block)
        table = lean.rotary[None]
        self.register_buffer("cos", table.cos.clone())
        self.register_buffer("sin", table.sin.clone())
        size = (shape.layers, shape.kv_heads, max_len, shape.head_dim)
        self.register_buffer("k_cache", torch.zeros(size, dtype=lean.dtype))
        self.register_buffer("v_cache", torch.zeros(size, dtype=lean.dtype))

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        shape, n = self.shape, tokens.shape[0]
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[positions], self.sin[positions]
        for i, layer in enumerate(self.layers):
            q, k, v = F.linear(self.norm(x, layer.input_layernorm), layer.wqkv).split(
                [self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.rope(q.view(n, shape.heads, shape.head_dim).transpose(0, 1), cos, sin)
            k = self.rope(k.view(n, shape.kv_heads, shape.head_dim).transpose(0, 1), cos, sin)
            v = v.view(n, shape.kv_heads, shape.head_dim).transpose(0, 1)
            self.k_cache[i].index_copy_(1, positions, k)
            self.v_cache[i].index_copy_(1, positions, v)
            out = F.scaled_dot_product_attention(q[None], self.k_cache[i][None], self.v_cache[i][None],
                                                 attn_mask=mask[None, None], scale=self.scale, enable_gqa=True)[0]
            x = x + F.linear(out.transpose(0, 1).reshape(n, self.q_size), layer.wo)
            gate, up = F.linear(self.norm(x, layer.post_attention_layernorm), layer.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.w_down)
        return F.linear(self.norm(x, self.final_norm), self.output)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--sizes", default="1,4,16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch._inductor.config.freezing = True
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"machine: {cpu_info()['cpu']} ({', '.join(cpu_info().get('cpu_flags', []))}), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; {args.model}, context {args.context}, "
          f"median of {args.repeats} interleaved calls")
    print("| dtype | n | kernels ms | compiled ms | compiled / kernels | compile s | max logit diff |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        lean = LeanModel(load_model(args.model, dtype).model)
        assert lean.kernels is not None, "the CPU kernels did not build"
        max_len = args.context + max(sizes)
        cache = lean.new_cache(max_len)
        prompt = torch.arange(100, 100 + args.context) % lean.shape.vocab
        lean.prefill(prompt, cache, logits=False)
        static = StaticForward(LeanModel(load_model(args.model, dtype).model, kernels=False), max_len)
        static.k_cache.copy_(cache.k)
        static.v_cache.copy_(cache.v)
        compiled = torch.compile(static, dynamic=False)
        for n in sizes:
            tokens = torch.arange(7, 7 + n)
            positions = torch.arange(args.context, args.context + n)
            causal = causal_mask(args.context, n, lean.dtype, "cpu") if n > 1 else None
            full = torch.full((n, max_len), float("-inf"), dtype=lean.dtype)
            full[:, :args.context + n] = 0 if causal is None else causal
            start = time.perf_counter()
            compiled_logits = compiled(tokens, positions, full)
            compile_seconds = time.perf_counter() - start
            kernel_logits = lean.forward(tokens, positions, cache, causal)
            diff = (kernel_logits.float() - compiled_logits.float()).abs().max().item()
            seconds = interleaved_medians({"kernels": partial(lean.forward, tokens, positions, cache, causal),
                                           "compiled": partial(compiled, tokens, positions, full)}, args.repeats)
            ms = {name: value * 1e3 for name, value in seconds.items()}
            print(f"| {dtype} | {n} | {ms['kernels']:.2f} | {ms['compiled']:.2f} | "
                  f"{ms['compiled'] / ms['kernels']:.2f} | {compile_seconds:.0f} | {diff:.2g} |", flush=True)


if __name__ == "__main__":
    main()
