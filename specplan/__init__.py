"""specplan: profile, plan and run lossless speculative decoding on the hardware at hand. This package is the
top layer (the `plan` CLI, `plan show`, the demo and the bench harness); ARCHITECTURE.md draws the rest."""

from core import __version__

__all__ = ["__version__"]
