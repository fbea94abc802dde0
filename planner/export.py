"""Token-tree exports to other engines' formats, and the inverse import of their choice lists."""

from __future__ import annotations

import ast
import json
from typing import Any

from core.errors import UserError
from core.plan_schema import TokenTree

EXPORT_FORMATS = ("sequoia", "medusa", "vllm", "trtllm")
GROWMAP_MAX_NODES = 4096  # the growmap holds a dense n x n mask: 16 M entries here, ~40 MB of JSON


def sequoia_growmap(tree: TokenTree) -> dict[str, Any]:
    """The reference implementation's growmap layout (there a pickled .pt; here plain JSON)."""
    if tree.size > GROWMAP_MAX_NODES:
        raise UserError(f"a {tree.size}-node tree is too large for the sequoia growmap (a dense n x n mask); it "
                        f"takes at most {GROWMAP_MAX_NODES} nodes")
    depths = tree.depths
    children = tree.children
    levels = [[v for v in range(tree.size) if depths[v] == k] for k in range(tree.depth + 1)]
    mask = [[0] * tree.size for _ in range(tree.size)]
    for v in range(tree.size):
        if v:
            mask[v] = list(mask[tree.parents[v]])
        mask[v][v] = 1
    return {
        "roots": levels,
        "branches": [[len(children[v]) for v in level] for level in levels],
        "Successors": children,
        "mask": mask,
        "depth": depths,
        "size": tree.size,
    }


def export_tree(tree: TokenTree, fmt: str) -> str:
    paths = [list(p) for p in tree.paths()]
    if fmt == "sequoia":
        return json.dumps(sequoia_growmap(tree))
    if fmt == "medusa":
        return json.dumps(paths)
    if fmt == "vllm":
        # vLLM's speculative_config takes the tree as the string form of a list of tuples, level by level.
        return json.dumps({"num_speculative_tokens": tree.size - 1,
                           "speculative_token_tree": str([tuple(p) for p in paths])})
    if fmt == "trtllm":
        return json.dumps({"eagle_choices": paths})
    raise UserError(f"unknown export format {fmt!r} (choose from {', '.join(EXPORT_FORMATS)})")


def import_tree(text: str, fmt: str) -> TokenTree:
    """Inverse of export_tree."""
    try:
        data = json.loads(text)
        if fmt == "sequoia":
            successors = data["Successors"]
            parents = [-1] * data["size"]
            for v, kids in enumerate(successors):
                for child in kids:
                    parents[child] = v
            return TokenTree.from_parents(parents, "growmap")
        if fmt == "medusa":
            choices = data
        elif fmt == "vllm":
            choices = ast.literal_eval(data["speculative_token_tree"])
        elif fmt == "trtllm":
            choices = data["eagle_choices"]
        else:
            raise UserError(f"unknown format {fmt!r} (choose from {', '.join(EXPORT_FORMATS)})")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, SyntaxError) as exc:
        raise UserError(f"cannot read a {fmt} tree: {exc.__class__.__name__}") from None
    if not isinstance(choices, (list, tuple)):
        raise UserError(f"a {fmt} tree must be a list of paths")
    return TokenTree.from_paths(list(choices), fmt)
