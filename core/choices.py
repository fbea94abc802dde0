"""The names the CLI offers as choices, importable without torch so that `plan --help` stays fast. Each is the
key set of a registry in a heavier module (models.TORCH_DTYPES, verify.RULES), which tests hold equal."""

DTYPES = ("fp32", "bf16")
VERIFICATION_RULES = ("greedy", "sequoia", "specinfer", "sample-match")
DEVICES = ("cpu", "cuda")
FORWARDS = ("lean", "transformers")  # the forwards that run a model (decoder/model.py, decoder/transformers_forward.py)
BACKENDS = ("auto",) + FORWARDS  # auto: lean where it runs the architecture (decoder/api.py: choose_backend)
