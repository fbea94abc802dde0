"""A user's own model, not a preset: a local GGUF file of a base model without a chat template, through the whole
workflow (profile, accept lookahead, solve lookahead, generate with the plan from another directory), with the
commands' defaults; the output is transformers' greedy output of the same file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specplan.core.fileio import sha256_file
from specplan.core.plan_schema import load_plan
from specplan.core.profile_schema import load_profile

pytestmark = pytest.mark.slow

ROPE_THETA = 10000.0
PROMPTS = ["the theme of the thesis: the three thin threads", "then the other thing, then the thing after that",
           "these are the things that the theorem says", "three thousand and three, three hundred and thirty"]


def write_base_model_gguf(path: Path) -> None:
    """A random-weight Llama base model in llama.cpp's layout (convert_hf_to_gguf.py: q/k rows permuted for its
    rotary layout, norms in F32, matmul weights in Q8_0), with a byte-level BPE vocabulary and no chat template."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["t h", "th e", "Ġ th", "Ġth e", "i n", "Ġ a", "h e", "Ġ t"]
    tokens = list(bytes_to_unicode().values()) + [merge.replace(" ", "") for merge in merges] + ["<|endoftext|>"]
    tokens = list(dict.fromkeys(tokens))
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, rms_norm_eps=1e-5,
                         tie_word_embeddings=False)
    torch.manual_seed(7)
    model = LlamaForCausalLM(config)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("a user's base model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t == "<|endoftext|>" else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)

    def permuted(weight: np.ndarray, heads: int) -> np.ndarray:  # convert_hf_to_gguf.py: LlamaModel.permute
        return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
            weight.shape)

    def add(name: str, weight: torch.Tensor, heads: int | None = None) -> None:
        values = weight.detach().float().numpy()
        if heads is not None:
            values = permuted(values, heads)
        if values.ndim == 2:
            writer.add_tensor(name, quantize(values, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)

    add("token_embd.weight", model.model.embed_tokens.weight)
    add("output_norm.weight", model.model.norm.weight)
    add("output.weight", model.lm_head.weight)
    for i, layer in enumerate(model.model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.attn_q.weight", attention.q_proj.weight, config.num_attention_heads)
        add(f"blk.{i}.attn_k.weight", attention.k_proj.weight, config.num_key_value_heads)
        add(f"blk.{i}.attn_v.weight", attention.v_proj.weight)
        add(f"blk.{i}.attn_output.weight", attention.o_proj.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        add(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight)
        add(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight)
        add(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def transformers_greedy(gguf: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """transformers' own greedy output of the GGUF file, the prompt encoded as given."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_a_local_base_model_runs_the_workflow_from_any_directory(run_cli, tmp_path, monkeypatch):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "models").mkdir(parents=True)
    elsewhere.mkdir()
    gguf = work / "models" / "base.gguf"
    write_base_model_gguf(gguf)
    (work / "prompts.jsonl").write_text("\n".join(json.dumps({"question_id": i, "category": "text", "turns": [p]})
                                                  for i, p in enumerate(PROMPTS)))
    monkeypatch.chdir(work)
    code, _, stderr = run_cli("profile", "--target", "models/base.gguf", "--quick", "-o", "profile.yaml")
    assert code == 0, stderr
    # typed another way: the same model
    code, _, stderr = run_cli("accept", "lookahead", "--target", "./models/../models/base.gguf", "--dataset",
                              "prompts.jsonl", "--max-new-tokens", 32, "-o", "acceptance.yaml")
    assert code == 0, stderr
    assert stderr.count("no chat template") == 1  # said once, the prompts encoded as given
    code, _, stderr = run_cli("solve", "lookahead", "--acceptance", "acceptance.yaml", "--profile", "profile.yaml",
                              "-o", "plan.yaml")
    assert code == 0, stderr
    # every file names the model by its resolved path, with its fingerprint in the profile
    named = str(gguf.resolve())
    assert load_plan("plan.yaml").models.target == named == load_profile("profile.yaml").models["target"]
    assert load_profile("profile.yaml").raw["model_fingerprints"]["target"]["gguf_sha256"] == sha256_file(gguf)
    monkeypatch.chdir(elsewhere)
    code, stdout, stderr = run_cli("generate", "--plan", "../work/plan.yaml", "--prompt", PROMPTS[0],
                                   "--max-new-tokens", 32, "--json")
    assert code == 0, stderr
    output = json.loads(stdout)
    assert output["tokens"] == transformers_greedy(gguf, PROMPTS[0], 32)
    assert len(output["tokens"]) == 32
