"""The names the CLI offers as choices, importable without torch so that `plan --help` stays fast. Each is the
key set of a registry in a heavier module (models.TORCH_DTYPES, verify.RULES), which tests hold equal."""

PRESET_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")  # core/models.py: PRESETS
TINY_MODEL_PREFIX = "tiny-random-"  # the tiny random-weight test models' names (core/models.py: TINY_MODELS)
DTYPES = ("fp32", "bf16", "gguf")  # gguf: the GGUF file's own quantized blocks, fp32 activations
MODELED_DTYPES = ("fp32", "bf16", "fp16")  # what `plan profile --gpu NAME` models (fp16: V100, T4; not decoded here)
PROFILE_DTYPES = DTYPES + ("fp16",)  # what a profile or a plan may be for
VERIFICATION_RULES = ("greedy", "sequoia", "specinfer", "sample-match")
DEVICES = ("cpu", "cuda")
# the forwards that run a model (decoder/model.py, decoder/transformers_forward.py); compiled: the lean forward through
# torch.compile under CUDA graphs (GPU only, decoder/cuda_graphs.py: compile_forward)
FORWARDS = ("lean", "compiled", "transformers")
BACKENDS = ("auto",) + FORWARDS  # auto: lean where it runs the architecture (decoder/api.py: choose_backend)
# plan bench's baselines (specplan/bench.py): transformers', our one-token decoding, TriForce's own variants (TriForce
# plans only), llama.cpp on the same GGUF (the llamacpp extra; llama.cpp-draft: a llama.cpp plan's draft-model knobs)
# plan bench --concurrency: servers driven over HTTP (specplan/serving.py); ours: the plan given (ours-fixed: with
# --fixed-drafting; ours-unshared: with --no-sharing), ours-ar: our one-token
# decoding; llama-server: llama.cpp's server, plain or with its speculative modes (-draft: --draft's GGUF); hf-batch:
# transformers' generate on padded static batches, in process
REQUESTS_PER_CLIENT = 2  # the serving benchmark's requests per client at a level, by default: 2C in all
SERVING_BASELINES = ("ours", "ours-fixed", "ours-unshared", "ours-ar", "llama-server", "llama-server-ngram-simple",
                     "llama-server-ngram-map-k", "llama-server-draft", "llama-server-export", "hf-batch")
BASELINES = ("hf", "hf-assisted", "hf-prompt-lookup", "ours-ar", "two-level", "streaming", "llama.cpp",
             "llama.cpp-lookup", "llama.cpp-draft")
# the engines a Sequoia plan is solved for and exported to (planner/engines.py: each one's rules, with sources);
# specplan: our own decoder, any tree
ENGINES = ("specplan", "sequoia", "vllm", "medusa", "eagle1", "trtllm", "trtllm-draft", "sglang",
           "llama.cpp", "hf")
EXPORT_FORMATS = tuple(engine for engine in ENGINES if engine != "specplan")  # `plan export --format`
VLLM_METHODS = ("draft_model", "eagle", "eagle3")  # a chain for vLLM: a draft model, or an EAGLE head
# the engines whose n-gram drafting `plan solve lookahead --engine` replays (planner/prompt_lookup.py; SGLang's trie:
# planner/sglang_ngram.py); llama.cpp: llama-cpp-python's prompt lookup, llama-server: the server's ngram-simple
LOOKUP_ENGINES = ("hf", "llama.cpp", "vllm", "sglang", "llama-server")
# the forwards a profile may time: ours, llama.cpp's own (`plan profile --engine llama.cpp`, for its plans) and
# llama-server's steps of its slots (`plan profile --engine llama-server`)
TIMED_FORWARDS = FORWARDS + ("llama.cpp", "llama-server")
# a modeled GPU's offloading (profiler/offload.py): what stays in host memory, what stays on the device, over which link
OFFLOAD_KINDS = ("weights", "kv")
RESIDENT_POLICIES = ("fill", "none")
HOST_LINK_NAMES = ("pcie3-x16", "pcie4-x16", "pcie5-x16", "pcie4-x8", "nvlink-c2c")  # profiler/offload.py: HOST_LINKS
# the serving engines' own drafting rules our decoder runs (`plan serve --rule`, `plan bench --rules`;
# decoder/draft_rules.py)
DRAFT_RULES = ("trtllm-auto", "hf-heuristic", "hf-constant", "llama.cpp", "sglang-ema")
# A schedule drafts at a batch size only where predicted at least this much faster than one-token decoding: served
# runs of one setting spread by several percent around their price (docs/benchmark-log.md), and smollm2's fp32
# Lookahead, scheduled at B = 3-6 for a predicted 2% gain, lost 8% served at 4 requests on cpu-2c.
MIN_SPEEDUP = 1.05
# Below that margin a schedule's entry is off, but keeps its best drafting setting as a candidate where that is
# predicted at least this fast, and a request times it before sitting out (decoder/gate.py): the steps' measured prices
# then decide. A server's own work between steps, which no profile times, moves drafting's price by this much:
# `plan serve` streaming to clients on a 2-core host added ~3 ms to a ~18 ms one-token step of smollm2 Q4_1
# (cpu-2c-zen3), where drafting priced 0.98x served 1.11x.
CANDIDATE_SPEEDUP = 0.9
# MiB of host memory a server keeps its slots' lost prefixes in (decoder/prompt_cache.py; `plan serve --cache-ram`):
# llama-server's default is 8192, on hosts that serve larger models than ours
DEFAULT_PROMPT_CACHE_MIB = 2048
# the shortest prefix it saves (a chat template's system turn, which every slot holds, is not worth a copy)
MIN_SAVED_TOKENS = 64
