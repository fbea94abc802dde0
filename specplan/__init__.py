"""specplan: profile, plan and run lossless speculative decoding on the hardware at hand."""

__version__ = "0.1.0"
