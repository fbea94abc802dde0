"""specplan: profile, plan and run lossless speculative decoding on the hardware at hand.

The public Python API (names load lazily, so that `import specplan` stays light):

    from specplan import load_decoder
    decoder = load_decoder("plans/smollm2-135m.lookahead.cpu-2c.fp32.yaml")
    output = decoder.generate("Write a quicksort in Python.", max_new_tokens=128)
    print(output.text, output.result.tokens_per_second)

The repository's top-level folders are its subpackages: core (files, models), decoder, planner, profiler; this
folder holds the top layer (the `plan` CLI, `plan show`, the demo and the bench harness). docs/architecture.md
draws the layers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "load_decoder": "specplan.decoder.api",
    "Decoder": "specplan.decoder.api",
    "GenerationOutput": "specplan.decoder.api",
    "SamplingParams": "specplan.decoder.sampling",
    "Request": "specplan.decoder.batching",
    "Completion": "specplan.decoder.batching",
    "load_plan": "specplan.core.plan_schema",
    "UserError": "specplan.core.errors",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'specplan' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
