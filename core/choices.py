"""The names the CLI offers as choices, importable without torch so that `plan --help` stays fast. Each is the
key set of a registry in a heavier module (models.TORCH_DTYPES, verify.RULES), which tests hold equal."""

DTYPES = ("fp32", "bf16")
VERIFICATION_RULES = ("greedy", "sequoia", "specinfer", "sample-match")
DEVICES = ("cpu", "cuda")
