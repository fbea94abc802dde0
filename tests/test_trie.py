"""Lookahead's trie: window counts against a reference, retrieval, merging, pruning, elimination, token 0."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from specplan.core.errors import UserError
from specplan.core.method_settings import TrieSettings
from specplan.decoder.trie import Trie


def reference_counts(sequence: list[int], window: int) -> collections.Counter:
    """Every window start contributes one count to each of its prefixes."""
    counts = collections.Counter()
    for start in range(len(sequence)):
        for end in range(start + 1, min(start + window, len(sequence)) + 1):
            counts[tuple(sequence[start:end])] += 1
    return counts


def trie_counts(trie: Trie, prompt: bool) -> dict:
    tokens, parents, output, prompt_counts, size = (trie.state.tokens, trie.state.parents, trie.state.output_count,
                                                    trie.state.prompt_count, trie.state.size)
    paths, out = {0: ()}, {}
    for node in range(1, int(size[0])):
        paths[node] = paths[int(parents[node])] + (int(tokens[node]),)
        value = prompt_counts[node] if prompt else output[node]
        if value:
            out[paths[node]] = value
    return out


def test_incremental_insertion_counts_every_window_once():
    rng = np.random.default_rng(0)
    sequence = rng.integers(0, 5, 60)
    trie = Trie(TrieSettings(window=6, capacity=10**6))
    array = np.array(sequence, dtype=np.int64)
    length = 0
    for step in [7, 1, 3, 10, 1, 1, 20, 17]:
        trie.insert(array, length, length + step)
        length += step
    assert trie_counts(trie, prompt=False) == reference_counts(list(sequence), 6)


def test_a_hierarchy_bottom_trie_holds_the_text_alone():
    """As a hierarchy's bottom, the trie drafter follows its middle level's tokens before the top verifies
    them: those the top rejects leave the trie, and the top's own tokens enter it, so that it ends as a trie
    fed the text alone (what `plan accept triforce` measures its runs with)."""
    from specplan.decoder.drafters import TrieDrafter
    from specplan.decoder.sampling import SamplingParams
    from specplan.decoder.tree import DETERMINISTIC

    prompt, settings = [1, 2, 3, 4, 1, 2, 3, 5], TrieSettings(decoding_length=4, branch_length=3, window=5)

    def middle_rounds(drafter: TrieDrafter, root: int, tokens: list[int]) -> None:
        for token in tokens:
            drafter.update(drafter.propose(root, SamplingParams(), DETERMINISTIC, None), [0], token)
            root = token

    bottom = TrieDrafter(Trie(settings))
    bottom.reset(prompt, 64)
    middle_rounds(bottom, 5, [4, 7, 8])  # the chain 5 4 7 8; the top keeps 4 and corrects 7 to 1
    bottom.rollback(1)
    middle_rounds(bottom, 1, [2, 9])  # the chain 1 2 9, all kept, and the top's bonus token 3
    bottom.extend([9])
    bottom.propose(3, SamplingParams(), DETERMINISTIC, None)
    text = TrieDrafter(Trie(settings))
    text.reset(prompt, 64)
    middle_rounds(text, 5, [4, 1, 2, 9, 3])
    counts = trie_counts(bottom.trie, prompt=False)
    assert counts == trie_counts(text.trie, prompt=False) and not any(7 in path for path in counts)


def test_retrieval_continues_the_matched_context():
    trie = Trie(TrieSettings(decoding_length=8, branch_length=4, window=8, max_prefix=3, capacity=10**6))
    prompt = np.array([5, 6, 7, 8, 9, 10, 5, 6, 7, 11, 12, 0, 0, 0], dtype=np.int64)
    trie.insert(prompt, 0, len(prompt), from_prompt=True)
    context = np.array([1, 2, 5, 6, 7], dtype=np.int64)
    tokens, parents = trie.retrieve(context, len(context))
    assert tokens[0] == 7 and parents[0] == -1
    assert len(tokens) <= 8
    children_of_root = {int(tokens[i]) for i in range(1, len(tokens)) if parents[i] == 0}
    assert {8, 11} <= children_of_root  # both continuations of "5 6 7", merged under one root
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        assert 0 <= parents[i] < i
        depth[i] = depth[parents[i]] + 1
    assert max(depth) <= 4
    # Token 0 is a real token: the branch "11 12 0 0" is proposed after "... 7".
    branch = [int(tokens[i]) for i in range(len(tokens))]
    assert 0 in branch
    assert len(trie.retrieve(context, len(context), 3)[0]) == 3  # a schedule's shorter setting
    with pytest.raises(ValueError, match="a draft of 9 nodes from a trie of decoding length 8"):
        trie.retrieve(context, len(context), 9)  # past the draft buffers: refused, never written


def test_branches_shared_across_stages_are_merged():
    trie = Trie(TrieSettings(decoding_length=32, branch_length=3, window=5, max_prefix=2, capacity=10**6))
    seq = np.array([1, 2, 3, 4, 9, 2, 3, 4, 5], dtype=np.int64)
    trie.insert(seq, 0, len(seq), from_prompt=True)
    tokens, parents = trie.retrieve(np.array([1, 2], dtype=np.int64), 2)
    paths = {(): 0}
    seen = set()
    for i in range(1, len(tokens)):
        path = next(p for p, node in paths.items() if node == parents[i]) + (int(tokens[i]),)
        assert path not in seen, "a token path appears twice in the draft"
        seen.add(path)
        paths[path] = i


def test_pruning_keeps_capacity_and_prompt_branches():
    rng = np.random.default_rng(1)
    trie = Trie(TrieSettings(window=4, capacity=200))
    prompt = np.array([100, 101, 102, 103, 104], dtype=np.int64)
    trie.insert(prompt, 0, 5, from_prompt=True)
    output = np.concatenate([prompt, rng.integers(0, 50, 500)]).astype(np.int64)
    length = 5
    while length < len(output):
        trie.insert(output, length, length + 3)
        length += 3
        assert trie.size <= trie.prompt_floor + 200 + 3 * 4 * 2
    assert trie_counts(trie, prompt=True) == reference_counts(list(prompt), 4)
    trie.end_request()
    assert trie_counts(trie, prompt=True) == {}
    assert all(v >= 1 for v in trie_counts(trie, prompt=False).values())


def test_bad_settings():
    for settings in (TrieSettings(decoding_length=0), TrieSettings(branch_length=0)):
        with pytest.raises(UserError):
            settings.check()


@pytest.mark.parametrize("dtype, decoded_with, exact", [
    ("bf16", {"decoding_length": 4, "branch_length": 3}, True),
    ("bf16", {"decoding_length": 2, "branch_length": 1}, False),
    ("fp32", {"decoding_length": 2, "branch_length": 1}, None),  # fp32 text is the target's own: always exact
])
def test_solver_says_whether_a_bf16_replay_is_exact(dtype, decoded_with, exact, write_yaml_file):
    from specplan.planner.lookahead import solve_lookahead

    repeated = [5, 6, 7, 8] * 6
    acceptance = write_yaml_file("acc.yaml", {
        "kind": "acceptance/lookahead", "models": {"target": "tiny-random-llama"},
        "tokenizer": {"vocab_size": 259, "sha256": "0" * 64}, "dtype": dtype, "decoded_with": decoded_with,
        "records": [{"prompt": repeated[:8], "output": repeated}]})
    plan, _ = solve_lookahead(acceptance, None, decoding_lengths=(2, 4), branch_lengths=(1, 3))
    assert (plan.settings.decoding_length, plan.settings.branch_length) == (4, 3)  # most tokens per step
    assert plan.prediction.replay_exact is exact
