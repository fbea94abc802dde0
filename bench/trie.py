"""Micro-benchmark: Lookahead trie retrieval and update per decoding step, on real token streams.

Replays the target's greedy outputs stored by `plan accept lookahead` (prompt branches inserted, drafts
retrieved, emitted tokens inserted, the request's branches eliminated at its end) and times each call.

    .venv/bin/python bench/trie.py acceptance/smollm2-135m.lookahead.specbench-sum-rag-code.fp32.yaml
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specplan.core.acceptance_schema import load_lookahead_acceptance
from specplan.core.machine import cpu_info
from specplan.core.method_settings import TrieSettings
from specplan.decoder.trie import Trie, accepted_run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("acceptance")
    parser.add_argument("--decoding-length", type=int, default=64)
    parser.add_argument("--branch-length", type=int, default=8)
    parser.add_argument("--capacity-factor", type=int, default=16)
    args = parser.parse_args()
    records = load_lookahead_acceptance(args.acceptance).records
    d = args.decoding_length
    settings = TrieSettings(decoding_length=d, branch_length=args.branch_length, window=args.branch_length + 4,
                            max_prefix=4, capacity=args.capacity_factor * d)
    for warm in (True, False):
        trie = Trie(settings)
        retrieve, update, sizes, nodes = [], [], [], []
        for index, record in enumerate(records):
            if index:
                trie.end_request()
            sequence = np.array(record.prompt + record.output, dtype=np.int64)
            position, end = len(record.prompt), len(sequence)
            trie.insert(sequence, 0, position, from_prompt=True)
            while position < end:
                start = time.perf_counter()
                tokens, parents = trie.retrieve(sequence, position)
                middle = time.perf_counter()
                emitted = min(accepted_run(tokens, parents, sequence[position:end]) + 1, end - position)
                before = time.perf_counter()
                trie.insert(sequence, position, position + emitted)
                finish = time.perf_counter()
                retrieve.append(middle - start)
                update.append(finish - before)
                sizes.append(len(tokens))
                nodes.append(trie.size - trie.prompt_floor)
                position += emitted
        if warm:
            continue  # the first pass compiles and warms up
    r, u = np.array(retrieve) * 1e3, np.array(update) * 1e3
    print(f"machine: {cpu_info()['cpu']}; {len(records)} requests, {len(r)} decoding steps; L_d = {d}, "
          f"L_b = {args.branch_length}, capacity = {settings.capacity} nodes beyond the prompt's")
    print(f"draft size: mean {np.mean(sizes):.1f} tokens; output nodes held: mean {np.mean(nodes):.0f}, "
          f"max {np.max(nodes)}")
    for name, values in (("retrieval", r), ("update", u)):
        print(f"{name + ' per step:':<20} mean {values.mean():.4f} ms, median {np.median(values):.4f} ms, "
              f"p99 {np.percentile(values, 99):.4f} ms")


if __name__ == "__main__":
    main()
