"""The base layer: errors, file formats and their schemas, file I/O, provenance, the machine's fingerprint,
model loading and prompt encoding. It imports nothing of the project's above it (pyproject.toml's
import-linter contract)."""
