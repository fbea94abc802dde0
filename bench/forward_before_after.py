"""The lean forward of an earlier commit against the working tree's, on smollm2-135m: 1 and 16 new tokens after a
500-token prompt, 4 rounds in alternating order, medians of the middle two.

    .venv/bin/python bench/forward_before_after.py a1b5e49 fp32
"""
import importlib.util
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, ".")
import decoder.model as new_module
from core.models import load_model

before, dtype = sys.argv[1], sys.argv[2]
old_source = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
old_source.write(subprocess.run(["git", "show", f"{before}:decoder/model.py"], capture_output=True, text=True,
                                check=True).stdout)
old_source.close()
spec = importlib.util.spec_from_file_location("old_model", old_source.name)
old_module = importlib.util.module_from_spec(spec)
sys.modules["old_model"] = old_module  # its dataclasses look their module up
spec.loader.exec_module(old_module)
torch.set_num_threads(2)
loaded = load_model("smollm2-135m", dtype)
models = {"old": old_module.LeanModel(loaded.model), "new": new_module.LeanModel(loaded.model)}
prompt = torch.randint(0, 1000, (500,), generator=torch.Generator().manual_seed(0))

@torch.inference_mode()
def steps(model, module, n, count=40):
    cache = model.new_cache(1024)
    model.prefill(prompt, cache, logits=False)
    mask = module.causal_mask(cache.length, n, model.dtype, "cpu") if n > 1 else None
    tokens = prompt[:n]
    for _ in range(5):
        model.forward(tokens, torch.arange(cache.length, cache.length + n), cache, mask)
    start = time.perf_counter()
    for _ in range(count):
        model.forward(tokens, torch.arange(cache.length, cache.length + n), cache, mask)
    return (time.perf_counter() - start) / count * 1e3

results = {(k, n): [] for k in models for n in (1, 16)}
for round_ in range(4):
    for k in (("old", "new") if round_ % 2 == 0 else ("new", "old")):
        module = old_module if k == "old" else new_module
        for n in (1, 16):
            results[(k, n)].append(steps(models[k], module, n))
for n in (1, 16):
    old, new = sorted(results[("old", n)]), sorted(results[("new", n)])
    print(f"{dtype} n={n}: old median {old[1]:.2f}-{old[2]:.2f} ms, new {new[1]:.2f}-{new[2]:.2f} ms, "
          f"new/old {(new[1]+new[2])/(old[1]+old[2]):.3f}")
