"""The CPU kernels (decoder/kernels/cpu_kernels.cpp) against PyTorch and gguf-py, and dtype gguf end to end."""

from __future__ import annotations

import fcntl
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from specplan.core.errors import UserError
from specplan.core.gguf_weights import BLOCK_FORMATS, BlockWeight, read_block_weights
from specplan.core.models import load_model
from specplan.decoder.api import load_forward
from specplan.decoder.cpu_kernels import compiler, kernels
from specplan.decoder.drafters import SequoiaDrafter, TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.model import ForwardItem, LeanModel, causal_mask
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.tree import ancestor_matrix, tree_attention_mask
from specplan.decoder.trie import Trie, TrieSettings

from toy import VOCAB, assert_sequoia_samples_follow_the_target, hf_greedy, toy_model

K = kernels()
pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler for the CPU kernels")


def test_the_kernels_build_where_a_compiler_exists_and_run_the_formats_core_reads():
    assert K is not None, "a C++ compiler is installed but the CPU kernels did not build (see stderr)"
    assert sorted(K.formats()) == sorted(BLOCK_FORMATS)


def test_a_build_killed_midway_does_not_stop_the_next_one():
    """torch's builder leaves its lock file behind when killed during a build (Ctrl-C on a first `plan serve`), and
    waits for that file forever: the next process starts anyway and removes it."""
    assert K is not None
    build = Path(K.__file__).parent
    with open(build / "build.flock", "w") as handle:  # no process of ours is building while the lock is planted
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build / "lock").touch()
    loaded = subprocess.run([sys.executable, "-c", "from specplan.decoder.cpu_kernels import kernels; "
                             "assert kernels() is not None"], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert not (build / "lock").exists()
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf-py quantizes these
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py only decodes these: random blocks with finite scales
SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # the fp16 fields of each 256-value block


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    """A matrix in `kind` and its values as gguf-py decodes them."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[kind]
    if kind in QUANTIZABLE:
        blocks = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    else:
        block_size, type_size = 256, {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]
        blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
        for offset in SCALE_OFFSETS[kind]:
            scale = (rng.random((rows, cols // block_size)) * 0.01 + 0.001).astype(np.float16)
            blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, -1, 2)
        blocks = blocks.reshape(rows, -1)
    values = torch.from_numpy(dequantize(blocks, qtype).reshape(rows, cols).astype(np.float32))
    return BlockWeight(kind, rows, cols, torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8))), values


def assert_fp32_dot_products(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor) -> None:
    """Each value is the exact dot product up to fp32 summation in some order: within 1e-5 of the sum of its
    terms' magnitudes (512-term sums, 2^-24 per rounding)."""
    error = (got.double() - expected).abs()
    assert bool((error <= 1e-5 * magnitude + 1e-6).all()), float((error / (magnitude + 1e-6)).max())


def rounded_to_q8k(x: torch.Tensor) -> torch.Tensor:
    """x as Q4_K and Q6_K matmuls take it: rounded to int8 per 256 values, scaled by max|x| / 127 (llama.cpp's
    Q8_K), in fp32 arithmetic with ties to even, as the kernel rounds."""
    blocks = x.float().reshape(x.shape[0], -1, 256)
    top = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    return (torch.round(blocks * scale) * (top / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("kind", QUANTIZABLE + K_QUANTS)
def test_blocks_decode_exactly_as_gguf_py_and_multiply_as_the_decoded_matrix(kind):
    """Every block decodes to gguf-py's values exactly; a matmul is x times the decoded matrix, for Q4_K and Q6_K
    with x rounded to 8-bit blocks first, for any number of rows."""
    weight, values = random_blocks(kind, 40, 512, seed=len(kind))
    assert torch.equal(K.dequantize(weight.format, weight.data, weight.rows, weight.cols), values)
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(K.dequantize_rows(weight.format, weight.data, weight.cols, ids), values[ids])
    bias = torch.randn(40)
    for n in (1, 2, 3, 4, 5, 9, 17, 80):  # decode tiles, register tiles with edges, torch's GEMM over decoded panels
        x = torch.randn(n, 512, generator=torch.Generator().manual_seed(n))
        x[:, :7] *= 10  # an outlier channel
        taken = rounded_to_q8k(x) if kind in ("Q4_K", "Q6_K") else x
        expected = taken.double() @ values.double().T + bias.double()
        got = K.linear(x, weight.format, weight.data, bias, weight.rows)
        assert_fp32_dot_products(got, expected, taken.double().abs() @ values.double().abs().T)
        if kind in ("Q4_K", "Q6_K"):  # integer arithmetic per block: a row's result whatever the rows beside it
            row = K.linear(x[-1:].contiguous(), weight.format, weight.data, bias, weight.rows)
            assert torch.equal(got[-1:], row)


def interleaved_q4k_linear(kernels, weight: BlockWeight):
    """kernels.linear over `weight` in the layout that build interleaves Q4_K into, None where it keeps the file's."""
    repacked = kernels.repack(weight.format, weight.data, weight.rows, weight.cols)
    if repacked is None:
        return None
    name, data = repacked
    return lambda x, bias: kernels.linear(x, name, data, bias, weight.rows)


def test_interleaved_q4k_rows_multiply_as_the_files_rows():
    """On AVX2 Q4_K matrices run with 8 rows interleaved: the same products as the file's layout (the same integer
    sums, scaled and summed in another order), a row's result whatever the rows beside it; a row count that is
    not a multiple of 8 keeps the file's layout. 40 rows: on AVX-512 two pairs of groups in zmm registers and the
    fifth group alone."""
    weight, values = random_blocks("Q4_K", 40, 768, seed=7)
    linear = interleaved_q4k_linear(K, weight)
    if linear is None:
        pytest.skip("this host's kernels keep Q4_K in the file's layout (no AVX2)")
    assert K.repack("Q4_K", weight.data[:36].contiguous(), 36, 768) is None
    bias = torch.randn(40)
    for n in (1, 3, 4, 5, 9, 70):
        x = torch.randn(n, 768, generator=torch.Generator().manual_seed(n))
        x[:, :5] *= 10
        taken = rounded_to_q8k(x)
        got = linear(x, bias)
        assert_fp32_dot_products(got, taken.double() @ values.double().T + bias.double(),
                                 taken.double().abs() @ values.double().abs().T)
        for i in (0, n - 1):
            assert torch.equal(got[i:i + 1], linear(x[i:i + 1].contiguous(), bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_weights_multiply_as_torch(dtype):
    weight, bias = torch.randn(70, 96).to(dtype), torch.randn(70).to(dtype)
    kind = "F32" if dtype == torch.float32 else "BF16"
    for n in (1, 3, 4, 6, 19, 80):
        x = torch.randn(n, 96).to(dtype)
        expected = x.double() @ weight.double().T + bias.double()
        got = K.linear(x, kind, weight, bias, 70)
        assert got.dtype == dtype
        if dtype == torch.float32:  # summation order only
            assert_fp32_dot_products(got, expected, x.double().abs() @ weight.double().abs().T)
        else:  # the output rounded to bf16 (2^-8 relative)
            torch.testing.assert_close(got.double(), expected, rtol=8e-3, atol=2e-2)


@pytest.mark.parametrize("exact", [False, True], ids=["gemm-rows", "exact"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length, n", [(37, 1), (1500, 1), (900, 5), (1050, 64)])
def test_attention_is_softmax_over_the_cache_with_grouped_heads_and_a_mask(cache_dtype, length, n, exact):
    """Keys split in chunks across threads and merged: 1500 keys make several chunks per KV head; 64 new tokens
    cross a chunk's boundary."""
    heads, kv_heads, d, slots = 6, 2, 48, 1600
    gen = torch.Generator().manual_seed(length + n)
    q = torch.randn(heads, n, d, generator=gen)
    keys = torch.randn(kv_heads, slots, d, generator=gen).to(cache_dtype)
    values = torch.randn(kv_heads, slots, d, generator=gen).to(cache_dtype)
    mask = None
    if n > 1:
        mask = torch.zeros(n, length)
        mask[:, length - n:] = torch.full((n, n), float("-inf")).triu(1)
        mask[1, :300] = float("-inf")  # a sliding window's hidden keys
    group_keys = keys[:, :length].float().repeat_interleave(heads // kv_heads, 0)
    group_values = values[:, :length].float().repeat_interleave(heads // kv_heads, 0)
    products = q @ group_keys.transpose(1, 2) * 0.125
    for softcap in (0.0, 1.5):  # Gemma 2's soft cap bends the scores before the mask
        scores = softcap * torch.tanh(products / softcap) if softcap else products
        expected = ((scores + (0 if mask is None else mask)).softmax(-1) @ group_values).transpose(0, 1)
        got = attend(K, q, keys, values, length, mask, 0.125, softcap, exact)
        torch.testing.assert_close(got, expected.reshape(n, heads * d), rtol=1e-4, atol=1e-5)
    if mask is not None:  # one mask per KV head (a sliding window over a cache whose slots keep their positions)
        per_head = mask.expand(kv_heads, n, length).clone()
        per_head[1, :, :600] = float("-inf")
        got = attend(K, q, keys, values, length, per_head, 0.125, 0.0, exact)
        scores = products + per_head.repeat_interleave(heads // kv_heads, 0)
        expected = (scores.softmax(-1) @ group_values).transpose(0, 1).reshape(n, heads * d)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def attend(kernels, q, keys, values, length, mask, scale, softcap, exact=False):
    """The attention kernel over one sequence: q [heads, n, d]."""
    mask = torch.empty(0) if mask is None else mask
    return kernels.attention(q.reshape(-1, q.shape[-1]).contiguous(), [keys], [values], [q.shape[1]], [length],
                             [mask], scale, softcap, exact)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_ragged_attention_scores_each_sequence_over_its_own_keys(cache_dtype):
    """Several sequences in one call (a batched step): rows, lengths and masks of their own, each equal to the
    sequence attended alone (to the bit where each row attends alone); the RoPE store writes each sequence's keys
    into its own cache from its own start."""
    heads, kv_heads, d = 6, 2, 32
    gen = torch.Generator().manual_seed(3)
    counts, lengths = [1, 4, 1, 3], [40, 700, 1300, 5]
    caches = [(torch.randn(kv_heads, 1400, d, generator=gen).to(cache_dtype),
               torch.randn(kv_heads, 1400, d, generator=gen).to(cache_dtype)) for _ in counts]
    qs = [torch.randn(heads, n, d, generator=gen) for n in counts]
    masks = [None if n == 1 else torch.zeros(n, length) for n, length in zip(counts, lengths)]
    masks[1][2, :650] = float("-inf")
    masks[3][:, 3:] = torch.full((3, 2), float("-inf")).triu(-1)[:, :2]
    for exact in (True, False):
        together = K.attention(torch.cat([q.reshape(-1, d) for q in qs]), [k for k, _ in caches],
                               [v for _, v in caches], counts, lengths,
                               [torch.empty(0) if m is None else m for m in masks], 0.2, 0.0, exact)
        alone = torch.cat([attend(K, q, k, v, length, m, 0.2, 0.0, exact)
                           for q, (k, v), length, m in zip(qs, caches, lengths, masks)])
        if exact:
            assert torch.equal(together, alone)
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
    for b in (0, 1):
        k, v = caches[b]
        expected = ((qs[b] @ k[:, :lengths[b]].float().repeat_interleave(3, 0).transpose(1, 2) * 0.2
                     + (0 if masks[b] is None else masks[b])).softmax(-1)
                    @ v[:, :lengths[b]].float().repeat_interleave(3, 0)).transpose(0, 1).reshape(counts[b], -1)
        torch.testing.assert_close(together[sum(counts[:b]):sum(counts[:b + 1])], expected, rtol=1e-4, atol=1e-5)
    qkv = torch.randn(sum(counts), (heads + 2 * kv_heads) * d, generator=gen).to(cache_dtype)
    cos, sin = torch.ones(sum(counts), d, dtype=cache_dtype), torch.zeros(sum(counts), d, dtype=cache_dtype)
    starts = [3, 0, 10, 1390]
    q = K.rope_store(qkv, cos, sin, [k for k, _ in caches], [v for _, v in caches], starts, counts, heads, kv_heads,
                     None, None, 1e-6, False)
    first = 0
    for (k, v), start, n in zip(caches, starts, counts):
        rows = qkv[first:first + n].view(n, heads + 2 * kv_heads, d)
        assert torch.equal(q[heads * first:heads * (first + n)].view(heads, n, d), rows[:, :heads].transpose(0, 1))
        assert torch.equal(k[:, start:start + n], rows[:, heads:heads + kv_heads].transpose(0, 1))
        assert torch.equal(v[:, start:start + n], rows[:, heads + kv_heads:].transpose(0, 1))
        first += n


TREE = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 7, 8, 9, 10, 11, 13, 14, 15]  # 20 nodes, each path's nodes apart


def path_to(node: int, parents: list[int]) -> list[int]:
    """The tree's nodes from the root to `node`."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def assert_decoding_rows_attend_alone(kernels, cache_dtype: torch.dtype) -> None:
    """With `exact`, every node of a tree attended over its prefix and ancestors, with its siblings' and cousins'
    keys between them hidden by the mask and another sequence in the call, is bit for bit the same token attended
    alone after its ancestors' keys (one-token decoding), over prefixes that end inside, at and past a chunk of keys
    (a tree over 236 keys spans the boundary at 256)."""
    heads, kv_heads, d, n = 6, 2, 64, len(TREE)
    gen = torch.Generator().manual_seed(11)
    mask = None
    for prefix in (7, 236, 256, 700):
        keys = torch.randn(kv_heads, prefix + n, d, generator=gen).to(cache_dtype)
        values = torch.randn(kv_heads, prefix + n, d, generator=gen).to(cache_dtype)
        q = torch.randn(heads, n, d, generator=gen)
        mask = tree_attention_mask(ancestor_matrix(TREE), prefix, torch.float32)
        other = (torch.randn(heads, 1, d, generator=gen), torch.randn(kv_heads, 90, d, generator=gen).to(cache_dtype))
        together = kernels.attention(torch.cat([q.reshape(-1, d), other[0].reshape(-1, d)]), [keys, other[1]],
                                     [values, other[1]], [n, 1], [prefix + n, 90], [mask, torch.empty(0)], 0.125, 0.0,
                                     True)
        for node in range(n):
            slots = list(range(prefix)) + [prefix + u for u in path_to(node, TREE)]
            alone = attend(kernels, q[:, node:node + 1].contiguous(), keys[:, slots].contiguous(),
                           values[:, slots].contiguous(), len(slots), None, 0.125, 0.0, True)
            assert torch.equal(together[node], alone[0]), (prefix, node)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_decoding_rows_attention_is_its_own_whatever_shares_the_call(cache_dtype):
    assert_decoding_rows_attend_alone(K, cache_dtype)


def k_quant_model() -> LeanModel:
    """Two layers of 256-wide matrices in Q4_K and Q6_K, as Q4_K_M ships them (random blocks)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    blocks = {}
    for seed, (name, parameter) in enumerate(model.named_parameters()):
        if name.endswith("proj.weight") or name == "lm_head.weight":
            kind = "Q6_K" if any(part in name for part in ("v_proj", "down_proj", "lm_head")) else "Q4_K"
            blocks[name], values = random_blocks(kind, *parameter.shape, seed=seed)
            with torch.no_grad():
                parameter.copy_(values)
    return LeanModel(model, block_weights=blocks)


@torch.inference_mode()
def test_a_tree_verifies_with_one_token_decodings_logits_to_the_bit_on_k_quants():
    """Q4_K and Q6_K matmuls round their input to 8 bits: a last-bit difference in the attention before them moves a
    logit by hundredths and can turn a greedy choice. Each node of a 20-node tree, scored beside another sequence,
    gets the logits one-token decoding gives the same token after its ancestors, to the bit (the matmuls work in
    integers per row, the attention sums each row alone)."""
    lean = k_quant_model()
    gen = torch.Generator().manual_seed(5)
    prompt, tokens = torch.randint(0, 512, (300,), generator=gen), torch.randint(0, 512, (len(TREE),), generator=gen)
    depths = torch.tensor([len(path_to(v, TREE)) - 1 for v in range(len(TREE))])

    def prefilled():
        cache = lean.new_cache(400)
        lean.prefill(prompt, cache, logits=False)
        return cache

    cache, beside = prefilled(), lean.new_cache(64)
    lean.prefill(tokens[:9], beside, logits=False)
    mask = tree_attention_mask(ancestor_matrix(TREE), cache.length, torch.float32)
    tree_logits, _ = lean.forward_many([ForwardItem(tokens, cache.length + depths, cache, mask, None),
                                        ForwardItem(tokens[9:10], torch.tensor([9]), beside, None, None)])
    for node in range(len(TREE)):
        decoding = prefilled()
        for u in path_to(node, TREE):
            logits = lean.forward(tokens[u:u + 1], torch.tensor([decoding.length]), decoding, None)
            decoding.commit(None, 1)
        assert torch.equal(logits[0], tree_logits[node]), node


@torch.inference_mode()
def test_a_sequence_attends_the_same_way_alone_or_beside_others(monkeypatch):
    """From the host's sdpa_rows new tokens a sequence attends through SDPA in a batched step as it does alone (why:
    cpu_kernels.cpp, SDPA_ROWS), fewer rows in the kernels: its logits beside another sequence are its logits alone,
    up to the matmuls' summation order."""
    _, lean = toy_model(0)
    sdpa_calls = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr("specplan.decoder.model.F.scaled_dot_product_attention",
                        lambda *args, **kwargs: sdpa_calls.append(args[0].shape[2]) or real_sdpa(*args, **kwargs))
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (40,), generator=gen)

    def step(tokens: torch.Tensor, beside: bool) -> torch.Tensor:
        cache, other = lean.new_cache(64), lean.new_cache(64)
        lean.prefill(prompt, cache, logits=False)
        lean.prefill(prompt[:9], other, logits=False)
        rows = tokens.shape[0]
        items = [ForwardItem(tokens, cache.length + torch.arange(rows), cache,
                             causal_mask(cache.length, rows, torch.float32, "cpu"), None)]
        if beside:
            items.append(ForwardItem(prompt[9:10], torch.tensor([9]), other, None, None))
        return lean.forward_many(items)[0]

    for rows in (K.sdpa_rows - 1, K.sdpa_rows):
        tokens = torch.randint(0, VOCAB, (rows,), generator=gen)
        sdpa_calls.clear()
        alone, batched = step(tokens, False), step(tokens, True)
        decoding_calls = [n for n in sdpa_calls if n == rows]  # the prompts' own prefills attend through SDPA too
        assert len(decoding_calls) == (2 * lean.shape.layers if rows >= K.sdpa_rows else 0), rows
        torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_batched_forward_takes_each_sequences_root_queries_as_the_operators_do():
    """TriForce's retrieval scores with the rotated queries of a sequence's last root (KVCache.root_queries): the
    kernels' batched forward takes each sequence's own, its first row's at every layer and head, as PyTorch's
    operators do."""
    _, lean = toy_model(0)
    shape = lean.shape
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (40,), generator=gen)
    tokens = [torch.randint(0, VOCAB, (rows,), generator=gen) for rows in (3, 1, 2)]

    def root_queries(forward) -> list[torch.Tensor]:
        items = []
        for length, new in zip((40, 9, 17), tokens):
            cache = lean.new_cache(64)
            lean.prefill(prompt[:length], cache, logits=False)
            cache.root_queries = torch.zeros(shape.layers, shape.heads, shape.head_dim)
            rows = new.shape[0]
            mask = causal_mask(cache.length, rows, torch.float32, "cpu") if rows > 1 else None
            items.append(ForwardItem(new, cache.length + torch.arange(rows), cache, mask, None))
        forward(items)
        return [item.cache.root_queries for item in items]

    for by_kernels, by_operators in zip(root_queries(lean._forward_kernels), root_queries(lean._forward_operators)):
        assert by_kernels.abs().sum() > 0
        torch.testing.assert_close(by_kernels, by_operators, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_activation_and_rope_round_as_the_eager_forward(dtype):
    """rms_norm (with the residual add), gated_activation and rope_store against the same steps in PyTorch: equal
    in fp32 up to summation order, and in bf16 rounded at the same places."""
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(3, 64, generator=gen).to(dtype), torch.randn(3, 64, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    summed = x + residual
    h = summed.float()
    expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = K.rms_norm(x, residual, weight, 1e-5, False)
    assert torch.equal(x, summed)  # the residual added in place
    torch.testing.assert_close(got, expected, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
    gate_up = (3 * torch.randn(3, 96, generator=gen)).to(dtype)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(K.gated_activation(gate_up, False), F.silu(gate_up[:, :48]) * gate_up[:, 48:],
                               **tolerance)
    torch.testing.assert_close(K.gated_activation(gate_up, True),
                               F.gelu(gate_up[:, :48], approximate="tanh") * gate_up[:, 48:], **tolerance)
    heads, kv_heads, d, n = 4, 2, 16, 3
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    angles = torch.rand(n, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    keys, values = torch.zeros(kv_heads, 10, d, dtype=dtype), torch.zeros(kv_heads, 10, d, dtype=dtype)
    q = K.rope_store(qkv, cos, sin, [keys], [values], [5], [n], heads, kv_heads, None, None, 1e-6, False)
    q = q.view(heads, n, d)

    def rotate(t):  # [n, h, d]
        return t * cos[:, None] + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin[:, None]

    split = qkv.view(n, heads + 2 * kv_heads, d).float()
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q.float(), rotate(split[:, :heads].float()).transpose(0, 1), **tolerance)
    torch.testing.assert_close(keys[:, 5:8].float(), rotate(split[:, heads:heads + kv_heads]).transpose(0, 1),
                               **tolerance)
    assert torch.equal(values[:, 5:8], qkv.view(n, -1, d)[:, heads + kv_heads:].transpose(0, 1))
    assert not keys[:, :5].any() and not keys[:, 8:].any()


def dequantized_copy(loaded) -> LeanModel:
    """The fp32 lean model whose weights are the gguf model's blocks decoded."""
    blocks = loaded.block_weights()
    model = loaded.transformers_model()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name in blocks:
                block = blocks[name]
                parameter.copy_(K.dequantize(block.format, block.data, block.rows, block.cols))
    return LeanModel(model)


@torch.inference_mode()
@pytest.mark.parametrize("name", ["tiny-random-llama", "tiny-random-qwen2"])
def test_gguf_model_is_the_dequantized_model_and_speculates_losslessly(name):
    """A tiny model at dtype gguf (Q4_1 layers, a Q8_0 embedding) scores as the fp32 model of its decoded
    weights, and its greedy Sequoia and Lookahead output equal its own one-token output and transformers' greedy
    output of the decoded model."""
    loaded = load_model(name, "gguf")
    quantized = load_forward(load_model(name, "gguf"), "cpu")
    assert quantized.layers[0]["wqkv"].format == "Q4_1"
    assert isinstance(quantized.embed, BlockWeight) and quantized.embed.format == "Q8_0"
    reference = dequantized_copy(loaded)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))
    caches = [model.new_cache(48) for model in (quantized, reference)]
    for model, cache in zip((quantized, reference), caches):
        model.prefill(ids[:30], cache)
    for t in range(30, 40):
        rows = [model.forward(ids[t:t + 1], torch.tensor([cache.length]), cache, None)[0]
                for model, cache in zip((quantized, reference), caches)]
        for cache in caches:
            cache.commit(None, 1)
        torch.testing.assert_close(rows[0], rows[1], rtol=1e-5, atol=1e-5)
    prompt = ids[:24].tolist()
    params = SamplingParams()
    own = SpeculativeEngine(quantized).generate(prompt, 40, params).tokens
    assert own == hf_greedy(loaded, prompt, 40)  # transformers' model holds the decoded weights
    draft = load_forward(load_model(name + "-draft", "gguf"), "cpu")
    for drafter in (SequoiaDrafter(draft, [-1, 0, 0, 1, 1, 2]), TrieDrafter(Trie(TrieSettings()))):
        result = SpeculativeEngine(quantized, drafter).generate(prompt, 40, params)
        assert result.tokens == own
    assert quantized.kernels is not None


def quantized_toy(seed: int, noise: float = 0.0):
    """A toy model over a 6-token vocabulary with 32-wide weights, quantized to Q4_1 blocks; transformers' copy
    holds the decoded weights."""
    model, _ = toy_model(seed, noise, family="llama-32")
    blocks = {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and parameter.shape[1] % 32 == 0:
                data = quantize(parameter.numpy(), GGMLQuantizationType.Q4_1)
                blocks[name] = BlockWeight("Q4_1", parameter.shape[0], parameter.shape[1],
                                           torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)))
                parameter.copy_(torch.from_numpy(dequantize(data, GGMLQuantizationType.Q4_1)))
    return model, LeanModel(model, block_weights=blocks)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["sequoia", "specinfer"])
def test_sampled_output_of_a_quantized_model_is_distributed_as_that_model(rule):
    target_hf, target = quantized_toy(10)
    _, draft = quantized_toy(10, noise=0.1)
    assert target.layers[0]["w_gate_up"].format == "Q4_1"
    assert_sequoia_samples_follow_the_target(target_hf, target, draft, rule)


def test_a_quantization_type_the_kernels_do_not_run_is_refused_in_one_line(tmp_path):
    from transformers import LlamaConfig

    path = tmp_path / "q2k.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 84), dtype=np.uint8),  # 8 rows of one 256-value block
                      raw_dtype=GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match="Q2_K, a quantization type the CPU kernels do not run"):
        read_block_weights(path, LlamaConfig(num_hidden_layers=0))



def assert_q5_0_runs_as_q8_0(kernels) -> None:
    """A Q5_0 matrix repacked (the layout a model's matmuls take it in): Q8_0 blocks of the same values, whose
    products are bitwise the Q5_0 blocks' for every number of rows (direct passes, register tiles, GEMM panels)."""
    weight, values = random_blocks("Q5_0", 24, 512, seed=5)
    kind, data = kernels.repack(weight.format, weight.data, weight.rows, weight.cols)
    assert kind == "Q8_0" and data.shape == (24, 512 // 32 * 34)
    assert torch.equal(kernels.dequantize(kind, data, 24, 512), values)
    bias = torch.randn(24)
    for n in (1, 2, 5, 9, 17, 80):
        x = torch.randn(n, 512, generator=torch.Generator().manual_seed(n))
        assert torch.equal(kernels.linear(x, kind, data, bias, 24), kernels.linear(x, "Q5_0", weight.data, bias, 24))


def test_q5_0_matrices_run_as_the_q8_0_blocks_of_the_same_values():
    assert_q5_0_runs_as_q8_0(K)

@pytest.mark.check
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])
def test_the_avx2_and_the_portable_builds_compute_as_this_hosts(march):
    """The kernels built for AVX2 (x86-64-v3) and for no AVX at all (x86-64-v2: the portable paths) give this
    host's results, to fp32 rounding (AVX-512 sums K-quant blocks in vector lanes, AVX2 per block)."""
    other = kernels(march)
    assert other is not None
    gen = torch.Generator().manual_seed(0)
    for kind in QUANTIZABLE + K_QUANTS:
        weight, _ = random_blocks(kind, 24, 512, seed=1)
        for n in (1, 6):
            x = torch.randn(n, 512, generator=gen)
            torch.testing.assert_close(other.linear(x, weight.format, weight.data, None, weight.rows),
                                       K.linear(x, weight.format, weight.data, None, weight.rows),
                                       rtol=1e-5, atol=1e-4)
    weight, _ = random_blocks("Q4_K", 24, 512, seed=1)
    linear = interleaved_q4k_linear(other, weight)
    if linear is not None:  # the AVX2 build's interleaved Q4_K rows, one group at a time: as this host's, exactly
        x = torch.randn(5, 512, generator=gen)
        torch.testing.assert_close(linear(x, None), K.linear(x, "Q4_K", weight.data, None, 24), rtol=1e-5, atol=1e-4)
        host_linear = interleaved_q4k_linear(K, weight)
        if host_linear is not None:
            assert torch.equal(linear(x, None), host_linear(x, None))
    for dtype, kind in ((torch.float32, "F32"), (torch.bfloat16, "BF16")):
        w, x = torch.randn(24, 96).to(dtype), torch.randn(3, 96, generator=gen).to(dtype)
        torch.testing.assert_close(other.linear(x, kind, w, None, 24).float(),
                                   K.linear(x, kind, w, None, 24).float(), rtol=1e-2, atol=1e-2)
    q, keys, values = torch.randn(4, 3, 32), torch.randn(2, 300, 32).bfloat16(), torch.randn(2, 300, 32).bfloat16()
    mask = torch.zeros(3, 290)
    mask[:, 200:] = float("-inf")
    torch.testing.assert_close(attend(other, q, keys, values, 290, mask, 0.2, 0.0),
                               attend(K, q, keys, values, 290, mask, 0.2, 0.0), rtol=1e-4, atol=1e-5)
    assert_q5_0_runs_as_q8_0(other)
    for cache_dtype in (torch.float32, torch.bfloat16):
        assert_decoding_rows_attend_alone(other, cache_dtype)


@torch.inference_mode()
def test_projections_of_mixed_block_types_score_as_their_decoded_weights():
    """Q4_K_M stores v in another block type than q and k: the fused projection runs one matmul per run of a
    type (q and k together, v alone) and still scores as the model of the decoded weights."""
    loaded = load_model("tiny-random-qwen2", "gguf")
    blocks = loaded.block_weights()
    model = loaded.transformers_model()
    for i in range(loaded.config.num_hidden_layers):
        name = f"model.layers.{i}.self_attn.v_proj.weight"
        values = model.get_parameter(name).detach().numpy()
        data = quantize(values, GGMLQuantizationType.Q8_0)
        blocks[name] = BlockWeight("Q8_0", values.shape[0], values.shape[1],
                                   torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)))
        with torch.no_grad():
            model.get_parameter(name).copy_(torch.from_numpy(dequantize(data, GGMLQuantizationType.Q8_0)))
    mixed = LeanModel(model, block_weights=blocks)
    qkv = mixed.layers[0]["wqkv"]
    assert [part.format for part in qkv] == ["Q4_1", "Q8_0"]
    assert [part.rows for part in qkv] == [mixed.q_size + mixed.kv_size, mixed.kv_size]
    reference = LeanModel(model)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(4))
    caches = [m.new_cache(24) for m in (mixed, reference)]
    logits = [m.prefill(ids, cache) for m, cache in zip((mixed, reference), caches)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
