"""SGLang's own NGRAM trie code (its wheel's kernels/jit/csrc/ngram_corpus: the trie, the suffix matching, the BFS
tree; plain C++, CPU), built with sglang_ngram_shim.cpp as a C entry point, and driven over recorded greedy outputs
as NGRAMWorker does: one request after another on one corpus, each step matching the last max_trie_depth tokens,
verifying the padded tree greedily (the first child, in index order, that equals the target's token:
verify_tree_greedy), then inserting the window the step matched from. `compare` checks every step's draft tree and
accepted count against our replay (planner/sglang_ngram.py); tests/test_sglang_ngram.py runs it (opt-in: it fetches
the sglang wheel from PyPI, no dependencies, and compiles its sources).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from specplan.core.acceptance_schema import LookaheadRecord
from specplan.core.method_settings import SGLANG_MATCH_TYPES, NgramTreeSettings
from specplan.core.models import cache_dir
from specplan.planner.prompt_lookup import ngram_tree_grid
from specplan.planner.sglang_ngram import CAPACITY, PADDING_TOKEN, SGLANG_VERSION, NgramTreeProposer, token_paths

CACHE = cache_dir() / f"sglang-{SGLANG_VERSION}"
SOURCES = "sglang/kernels/jit/csrc/ngram_corpus/"
COMPILED = ("trie.cpp", "result.cpp", "ngram.cpp", "suffix_automaton.cpp")
SHIM = Path(__file__).with_name("sglang_ngram_shim.cpp")
QUICK_GRID = (NgramTreeSettings(12, 18, 10), NgramTreeSettings(5, 4, 2), NgramTreeSettings(8, 6, 3, 2),
              NgramTreeSettings(12, 18, 10, match_type="PROB"))
FULL_GRID = QUICK_GRID + tuple(ngram_tree_grid((1, 3, 7, 15), (3, 8, 18), (1, 4, 10)))  # drafted, depths, breadths


def build_library() -> ctypes.CDLL:
    """SGLang's NGRAM corpus as a shared library, built once into CACHE."""
    library = CACHE / "libsglang_ngram.so"
    if not library.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        wheels = sorted(CACHE.glob("sglang-*.whl"))
        if not wheels:
            subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_VERSION.lstrip('v')}",
                            "--no-deps", "--quiet", "-d", str(CACHE)], check=True, timeout=600)
            wheels = sorted(CACHE.glob("sglang-*.whl"))
        source_dir = CACHE / "ngram_corpus"
        source_dir.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith(SOURCES) and not name.endswith("/"):
                    (source_dir / Path(name).name).write_bytes(wheel.read(name))
        partial = library.with_suffix(".partial")
        subprocess.run(["g++", "-O2", "-std=c++20", "-shared", "-fPIC", f"-I{source_dir}", str(SHIM),
                        *(str(source_dir / name) for name in COMPILED), "-lpthread", "-o", str(partial)],
                       check=True, timeout=600)
        partial.rename(library)
    lib = ctypes.CDLL(str(library))
    lib.ngram_new.restype = ctypes.c_void_p
    lib.ngram_new.argtypes = [ctypes.c_int64] * 6
    lib.ngram_free.argtypes = [ctypes.c_void_p]
    lib.ngram_insert.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.ngram_match.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                ctypes.c_void_p, ctypes.c_void_p]
    return lib


def mask_parents(mask: np.ndarray) -> list[int]:
    """Each node's parent in SGLang's tree mask: its nearest ancestor, the largest earlier index it attends to."""
    return [-1] + [max(j for j in range(i) if mask[i, j]) for i in range(1, len(mask))]


def sglang_paths(tokens: np.ndarray, mask: np.ndarray) -> set[tuple[int, ...]]:
    """Every drafted node's token path from the root (padding included), from SGLang's tokens and mask."""
    parents = mask_parents(mask)
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (int(tokens[i]),))
    return set(paths[1:])


def greedy_accepted(tokens: np.ndarray, mask: np.ndarray, truth: np.ndarray) -> int:
    """verify_tree_greedy: from the root, the first child in index order that equals the target's next token."""
    parents = mask_parents(mask)
    node, accepted = 0, 0
    for token in truth:
        child = next((i for i in range(node + 1, len(tokens)) if parents[i] == node and tokens[i] == token), None)
        if child is None:
            break
        node, accepted = child, accepted + 1
    return accepted


def compare(lib: ctypes.CDLL, records: list[LookaheadRecord], settings: NgramTreeSettings) -> tuple[int, str | None]:
    """(steps compared, the first difference or None)."""
    size, depth = settings.num_draft_tokens, settings.max_trie_depth
    corpus = lib.ngram_new(CAPACITY, depth, settings.min_bfs_breadth, settings.max_bfs_breadth, size,
                           SGLANG_MATCH_TYPES.index(settings.match_type))
    ours = NgramTreeProposer(settings)
    out_tokens = np.zeros(size, dtype=np.int32)
    out_mask = np.zeros(size * size, dtype=np.uint8)
    steps = 0
    try:
        for request, record in enumerate(records):
            sequence = np.array(record.prompt + record.output, dtype=np.int64)
            position, end = len(record.prompt) + 1, len(sequence)
            ours.new_request()
            while position < end:
                context = np.ascontiguousarray(sequence[max(0, position - depth):position], dtype=np.int32)
                lib.ngram_match(corpus, request, context.ctypes.data, len(context), position,
                                out_tokens.ctypes.data, out_mask.ctypes.data)
                mask = out_mask.reshape(size, size)
                truth = sequence[position:position + size - 1]
                theirs = sglang_paths(out_tokens, mask), greedy_accepted(out_tokens, mask, truth)
                tree = ours.draft(context.tolist())
                accepted = ours.accepted(tree, truth.tolist())
                padded = {(PADDING_TOKEN,)} if len(tree) < size else set()
                mine = token_paths(tree) | padded, accepted
                ours.insert(context.tolist())
                lib.ngram_insert(corpus, context.ctypes.data, len(context))
                if mine != theirs:
                    return steps, (f"record {request}, position {position}: accepted {accepted} vs SGLang's "
                                   f"{theirs[1]}; ours only {sorted(mine[0] - theirs[0])[:3]}, SGLang's only "
                                   f"{sorted(theirs[0] - mine[0])[:3]}")
                position += min(accepted + 1, end - position)
                steps += 1
    finally:
        lib.ngram_free(corpus)
    return steps, None
