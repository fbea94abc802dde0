"""`plan profile`: t(n) of the target (and the draft) for n new tokens over a context of L cached tokens.

Measured on this machine with the decoder's own forward (static KV cache, tree-attention mask), or modeled
by a roofline (profiler/roofline.py) for a GPU that is not here, or for this CPU from microbenchmarks.
Each point: warm-up forwards, then timed repeats; the profile keeps the median and the 10th/90th
percentiles. On a GPU, each shape is captured as a CUDA graph and timed with CUDA events. A measured profile
also times TriForce's retrieval-cache build (score every chunk of the context, copy the best ones) for each
budget below each context, which `plan solve triforce` charges per rebuild, and the decoding engine's time
per step outside the target's forward (drafts in, tree mask, verification walk, cache commit, Python) for each
tree size, which the planners charge beside every forward: on a GPU it can match a forward's cost. With
`window_prefill` (sinks, window) it also times a StreamingLLM drafter's prefill of its window (the draft's, or
the target's where no draft is profiled), which `plan solve triforce` charges once per prompt to a streaming
or model bottom; with a draft, the draft's prefill of a prompt as long as each context, which a draft-model
drafter pays once per prompt (`plan solve sequoia` spreads it over the continuation); with batches, the target's,
which every request pays as it joins a running batch (planner/serving.py prices a closed-loop load with it).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from specplan.core import progress
from specplan.core.choices import MODELED_DTYPES
from specplan.core.errors import UserError
from specplan.core.fileio import atomic_output
from specplan.core.method_settings import RetrievalSettings
from specplan.core.models import LoadedModel, ModelSpec, load_model, load_model_spec, torch_dtype
from specplan.core.profile_schema import LatencyProfile, save_profile
from specplan.core.provenance import provenance
from specplan.core.validate import FORMAT_VERSION
from specplan.decoder.api import Forward, load_forward
from specplan.decoder.drafters import Drafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.model import ForwardItem, KVCache, LeanModel, ModelShape, causal_mask, draft_vocabulary_ids
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.transformers_forward import TransformersCache
from specplan.decoder.tree import DraftTree
from specplan.decoder.triforce import RetrievalCache, StreamingDrafter
from specplan.profiler import hardware, roofline
from specplan.profiler.calibration import CALIBRATION_PRIOR_WEIGHT, calibrate
from specplan.profiler.offload import DeviceSetup, ModelBytes, Placement, host_link
from specplan.profiler.operators import count_forward, gpu_operators

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
QUICK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_CONTEXTS = (128, 1024, 4096)
RETRIEVAL_BUDGETS = (256, 512, 1024, 2048, 4096)
RETRIEVAL_CHUNK = 16  # a build's cost barely depends on the chunk size: it reads every key either way
OVERHEAD_STEPS = 4  # decoding steps per timed run for the engine's overhead (3 runs per tree size)
# the batched engine's overhead: prompts this long (the host's work per step does not depend on the context; the
# forward's does, and is subtracted), and fewer steps, since every B x n runs its own batch of requests
BATCHED_OVERHEAD_PROMPT = 16
BATCHED_OVERHEAD_STEPS = 2
# A batched step's rows (B sequences of n new tokens each) timed on a CPU at most: beyond them a step is prefill-sized
# and no batch of trees is planned there.
MAX_BATCH_ROWS = 256


@dataclass
class ProfileRequest:
    target: str
    draft: str | None = None
    dtype: str = "fp32"
    draft_dtype: str | None = None  # default: dtype
    draft_vocab: int | None = None  # time the draft scoring only the ids below this (plus the stop tokens)
    contexts: list[int] = field(default_factory=lambda: list(DEFAULT_CONTEXTS))
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    budgets: list[int] = field(default_factory=lambda: list(RETRIEVAL_BUDGETS))  # timed where below the context
    window_prefill: tuple[int, int] | None = None  # (sinks, window) of a StreamingLLM drafter to time the prefill of
    threads: int = max(1, (os.cpu_count() or 1))
    warmup: int = 2
    repeats: int = 9
    gpu: str | None = None
    calibrate: list[str] = field(default_factory=list)  # measured profiles of `gpu` to fit its cost model to
    calibration_prior_weight: float = CALIBRATION_PRIOR_WEIGHT  # their fit's pull towards the catalogue
    backend: str = "auto"  # the forward to time (decoder/api.py: choose_backend)
    batches: list[int] = field(default_factory=lambda: [1])  # B: steps of B sequences at once, t(B, n)
    gpus: int = 1  # tensor parallelism over this many modeled GPUs
    offload: str | None = None  # weights | kv: what a modeled GPU keeps in host memory where it does not fit
    host_link: str | None = None  # the modeled GPUs' link to host memory (default: the catalogue GPU's own)
    resident: str = "fill"  # fill: keep on the device what fits; none: stream every layer or cached token
    row_totals: int = 0  # also time the target's forward of one sequence at every n up to this (priced ragged steps)
    engine: str = "specplan"  # whose execution a modeled GPU runs: ours, or vllm's (a batch's attention in one call)

    @property
    def target_sizes(self) -> list[int]:
        """The n at which the target's forward of one sequence is timed: `sizes` and every n up to `row_totals`."""
        return sorted(set(self.sizes) | set(range(1, self.row_totals + 1)))

    def roles(self) -> list[tuple[str, str, str]]:
        """(role, model, dtype) for each model to profile."""
        target = [("target", self.target, self.dtype)]
        return target + ([("draft", self.draft, self.draft_dtype or self.dtype)] if self.draft else [])


def run_profile(request: ProfileRequest, output: Path, resume: bool = False,
                log: Callable[[str], None] = progress.say) -> LatencyProfile:
    if request.gpu not in (None, "cpu"):
        request = replace(request, gpu=roofline.accelerator(request.gpu).name)
    modeled_gpu = request.gpu not in (None, "cpu", _local_gpu_name())
    if (request.gpus != 1 or request.offload or request.host_link or request.resident != "fill") and not modeled_gpu:
        raise UserError("--gpus, --offload, --host-link and --resident model GPUs not at hand: they need --gpu NAME")
    for dtype in (request.dtype, request.draft_dtype or request.dtype):
        if modeled_gpu and dtype not in MODELED_DTYPES:
            raise UserError(f"dtype {dtype} is not modeled on a GPU (choose from {', '.join(MODELED_DTYPES)})")
        if not modeled_gpu and dtype == "fp16":
            raise UserError("fp16 is modeled only: --gpu NAME of a GPU not at hand (this decoder runs fp32 and bf16)")
        if not modeled_gpu:
            torch_dtype(dtype)
    if request.row_totals and (modeled_gpu or request.gpu == "cpu"):
        raise UserError("--row-totals times forwards at every number of rows: it measures the machine at hand")
    if request.engine == "vllm" and not modeled_gpu:
        raise UserError("--engine vllm models vLLM's execution on a GPU not at hand: it needs --gpu NAME")
    if request.calibrate and not modeled_gpu:
        raise UserError("--calibrate fits the cost model of a GPU not at hand: it needs --gpu NAME")
    if not request.sizes or min(request.sizes) < 1 or 1 not in request.sizes:
        raise UserError("the sizes n must be positive and include 1")
    if not request.contexts or min(request.contexts) < 1:
        raise UserError("the context lengths must be positive")
    if not request.batches or min(request.batches) < 1:
        raise UserError("the batch sizes B must be positive")
    torch.set_num_threads(request.threads)
    local_gpu = _local_gpu_name()
    if request.gpu is None or (request.gpu != "cpu" and request.gpu == local_gpu):
        device = torch.device("cuda" if request.gpu else "cpu")
        document = _measure(request, device, output, resume, log)
    else:
        document = _model(request, log)
    return save_profile(document, output)


def _local_gpu_name() -> str | None:
    return roofline.catalogue_name(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def _load(name: str, dtype: str, log) -> LoadedModel:
    log(f"loading {name} ({dtype})")
    return load_model(name, dtype, log=log)


def _check_contexts(name: str, shape: ModelShape, request: ProfileRequest) -> None:
    longest = max(request.contexts) + max(request.target_sizes)
    if longest > shape.max_context:
        raise UserError(f"context {max(request.contexts)} + {max(request.target_sizes)} new tokens exceeds {name}'s "
                        f"maximum context of {shape.max_context}")


# --- measured ---------------------------------------------------------------------------------------------

class _Checkpoint:
    """Samples of the timed passes completed so far, kept next to the output so that --resume goes on from them."""

    def __init__(self, output: Path, key: dict, resume: bool) -> None:
        self.path = output.parent / f".{output.name}.partial.json"
        self.key = json.loads(json.dumps(key))  # as saved: tuples become lists
        self.samples: dict[str, list[float]] = {}
        if resume and self.path.is_file():
            try:
                saved = json.loads(self.path.read_text())
            except json.JSONDecodeError:
                saved = {}
            if saved.get("key") == self.key:
                self.samples = saved.get("samples", {})

    def save(self) -> None:
        with atomic_output(self.path) as handle:
            json.dump({"key": self.key, "samples": self.samples}, handle)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


BUILD = "retrieval_build"  # the pseudo-role of retrieval-cache build timings (keyed by budget, not n)
WINDOW_PREFILL = "window_prefill"  # the call timing a StreamingLLM drafter's prefill of its window
PROMPT_PREFILL = "prompt_prefill"  # the calls ("prompt_prefill|role|L") timing a model's prefill of an L-token prompt


def _measure(request: ProfileRequest, device: torch.device, output: Path, resume: bool, log) -> dict:
    """Every point (model, context, n, and the target's builds per budget) is timed once per pass, round-robin,
    so that a slow spell of the machine spreads over all of them: a plan rests on ratios between points, the
    middle level of TriForce at one context against the target at another, or the draft against the target.
    Timed one context after another instead, a profile on a noisy VM gave t(1) at 7680 tokens below t(1) at
    4096: the machine had slowed down while the shorter contexts were timed."""
    started = time.perf_counter()
    machine = hardware.fingerprint(device, request.dtype, request.threads)
    models = {role: _load(name, dtype, log) for role, name, dtype in request.roles()}
    key = {"request": asdict(request), "machine": {k: machine[k] for k in ("cpu", "device", "torch", "threads")},
           "models": {role: m.fingerprint for role, m in models.items()}}
    checkpoint = _Checkpoint(output, key, resume)
    forwards = {role: load_forward(m, device.type, request.draft_vocab if role == "draft" else None, request.backend)
                for role, m in models.items()}
    backend = forwards["target"].backend
    log(f"backend: {backend}")
    for role, model in forwards.items():
        _check_contexts(models[role].name, model.shape, request)
    # TriForce's retrieval cache and StreamingLLM window run on the lean forward only
    retrieval = isinstance(forwards["target"], LeanModel)
    if request.window_prefill and not retrieval:
        raise UserError("a StreamingLLM window prefill needs the lean decoder; this target runs on the "
                        f"{backend} backend")
    calls: dict[str, Callable[[], float]] = {}
    for L in request.contexts:
        calls.update(_calls_at(forwards, L, request.sizes, _budgets_below(request.budgets, L) if retrieval else [],
                               request.target_sizes))
    batches = [B for B in request.batches if B > 1]
    if batches and not all(hasattr(model, "forward_many") for model in forwards.values()):
        raise UserError(f"batched steps run on the lean backend; this target runs on the {backend} backend")
    for L in request.contexts:
        calls.update(_batch_calls_at(forwards, L, request.sizes, batches))
    streaming_role = "draft" if "draft" in forwards else "target"
    if request.window_prefill:
        calls[WINDOW_PREFILL] = _window_prefill_call(forwards[streaming_role], *request.window_prefill)
    # a draft model pays its prefill once per prompt; serving (batches), the target's too as each request joins
    prefilled = [role for role in forwards if role == "draft" or (role == "target" and batches)]
    calls.update({f"{PROMPT_PREFILL}|{role}|{L}": _prompt_prefill_call(forwards[role], L)
                  for role in prefilled for L in request.contexts})
    resumed = {name: checkpoint.samples.get(name, []) for name in calls}
    done = min(len(timed) for timed in resumed.values())
    samples = {name: timed[:done] for name, timed in resumed.items()}
    if done:
        log(f"resuming: {done} of {request.repeats} timed passes already measured")
    left = max(request.repeats - done, 0)
    passes = request.warmup + left if left else 0  # a resumed profile with every pass measured warms nothing up
    bar = progress.Steps(passes, "profile", "timing passes")
    for rep in range(passes):
        timed = _time_pass(calls)
        if rep >= request.warmup:
            for name, seconds in timed.items():
                samples[name].append(seconds)
            checkpoint.samples = samples
            checkpoint.save()
        bar.update(1)
    bar.close()
    window_prefill = samples.pop(WINDOW_PREFILL, None)
    prompt_prefills: dict[str, dict[int, float]] = {}
    for name in [name for name in samples if name.startswith(PROMPT_PREFILL)]:
        _, role, L = name.split("|")
        prompt_prefills.setdefault(role, {})[int(L)] = float(np.median(samples.pop(name)))
    batch_samples = {name: samples.pop(name) for name in list(samples) if name.startswith(BATCH)}
    curves, builds = _summaries(samples)
    document = profile_document(request, "measured", machine, models, curves)
    document["backend"] = backend
    for name, timed in sorted(batch_samples.items()):  # "batch|role|L|B|n"
        _, role, L, B, n = name.split("|")
        entry = document[role]["contexts"][int(L)].setdefault("batches", {}).setdefault(int(B), {})
        if role == "draft":
            entry["step_seconds"] = float(np.median(timed))
        else:
            entry.setdefault("t_seconds", {})[int(n)] = float(np.median(timed))
    for role, prefills in prompt_prefills.items():
        document[role]["prefill_seconds"] = prefills
    if window_prefill:
        sinks, window = request.window_prefill
        spread = _spread(window_prefill)
        document[streaming_role]["window_prefill"] = {"sinks": sinks, "window": window, "seconds": spread["median"],
                                                      "spread_seconds": [spread["p10"], spread["p90"]]}
    for L, by_budget in builds.items():
        document["target"]["contexts"][L]["retrieval_build_seconds"] = by_budget
    room = forwards["target"].shape.max_context - OVERHEAD_STEPS - max(request.sizes)  # prompt + new tokens + tree
    overhead_context = max(1, min(min(request.contexts), room))
    log(f"timing the decoding engine's overhead per step at context {overhead_context}")
    document["target"]["engine_overhead_seconds"] = engine_overhead(forwards["target"], overhead_context, request.sizes)
    document["target"]["engine_overhead_context"] = overhead_context
    if batches:
        log(f"timing the continuous-batching engine's overhead per step for B = {batches} (prompts of "
            f"{BATCHED_OVERHEAD_PROMPT} tokens)")
        document["target"]["engine_overhead_batches"] = engine_overhead_batched(forwards["target"], request.sizes,
                                                                                batches)
    document["settings"] = {"engine": f"specplan, {backend} forward", "threads": request.threads,
                            "warmup": request.warmup, "timed_after_same_size": device.type == "cpu",
                            "round_robin": "all points per pass",
                            "repeats": request.repeats, "row_totals": request.row_totals,
                            "cuda_graphs": device.type == "cuda" and backend != "transformers",
                            "cpu_kernels": getattr(forwards["target"], "kernels", None) is not None,
                            "timer": "cuda events" if device.type == "cuda" else "time.perf_counter",
                            "retrieval_chunk": RETRIEVAL_CHUNK}
    document["measurement_seconds"] = round(time.perf_counter() - started, 1)
    checkpoint.remove()
    return document


def _summaries(samples: dict[str, list[float]]) -> tuple[dict[str, dict[int, dict[int, dict]]],
                                                        dict[int, dict[int, float]]]:
    """Timed samples by call name to curves {role: {L: {n: {median, p10, p90}}}} and builds {L: {B: median}}."""
    curves: dict[str, dict[int, dict[int, dict]]] = {}
    builds: dict[int, dict[int, float]] = {}
    for name, timed in samples.items():
        role, L, n = name.split("|")
        if role == BUILD:
            builds.setdefault(int(L), {})[int(n)] = float(np.median(timed))
        else:
            curves.setdefault(role, {}).setdefault(int(L), {})[int(n)] = _spread(timed)
    return curves, builds


def _spread(timed: list[float]) -> dict[str, float]:
    """The median and the 10th and 90th percentiles of a point's timed samples."""
    points = np.array(timed)
    return {"median": float(np.median(points)), "p10": float(np.percentile(points, 10)),
            "p90": float(np.percentile(points, 90))}


class PointTimer:
    """Chosen points of a profile, timed with the profiler's own calls, every point once per pass: what
    `plan bench --reprice` runs between the prompts to re-time the forwards a plan's prediction priced."""

    def __init__(self, target: Forward, draft: Forward | None, sizes: dict[int, list[int]],
                 builds: dict[int, list[int]], draft_contexts: list[int],
                 window_prefill: tuple[str, int, int] | None = None) -> None:
        """`window_prefill`: (role, sinks, window) of a StreamingLLM drafter whose window prefill to time too."""
        self.calls: dict[str, Callable[[], float]] = {}
        for L in sorted(set(sizes) | set(builds)):
            calls = _calls_at({"target": target}, L, sizes.get(L, [1]), builds.get(L, []))
            self.calls.update({name: call for name, call in calls.items()
                               if name.startswith(BUILD) or L in sizes})
        for L in draft_contexts:
            if draft is None:
                raise ValueError("draft contexts to time but no draft model")
            self.calls.update(_calls_at({"draft": draft}, L, [1], []))
        self.window_prefill_role = window_prefill[0] if window_prefill else None
        if window_prefill:
            role, sinks, window = window_prefill
            model = draft if role == "draft" else target
            if model is None:
                raise ValueError("a draft window prefill to time but no draft model")
            self.calls[WINDOW_PREFILL] = _window_prefill_call(model, sinks, window)
        self.samples: dict[str, list[float]] = {name: [] for name in self.calls}

    def run(self, passes: int, warmup: int = 0) -> None:
        for rep in range(warmup + passes):
            timed = _time_pass(self.calls)
            if rep >= warmup:
                for name, seconds in timed.items():
                    self.samples[name].append(seconds)

    def medians(self) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, float]], dict[int, float],
                               dict[str, float]]:
        """(target {L: {n: s}}, builds {L: {B: s}}, draft {L: one-token step s}, window prefill {role: s}):
        medians of the passes run, in the order LatencyProfile.with_points takes them."""
        samples = dict(self.samples)
        window_prefill = samples.pop(WINDOW_PREFILL, None)
        curves, builds = _summaries(samples)
        medians = {role: {L: {n: p["median"] for n, p in points.items()} for L, points in by_context.items()}
                   for role, by_context in curves.items()}
        prefill = {self.window_prefill_role: float(np.median(window_prefill))} if window_prefill else {}
        return (medians.get("target", {}), builds,
                {L: points[1] for L, points in medians.get("draft", {}).items()}, prefill)


class _ForwardTimer:
    """The time spent in a model's forward while installed: wall clock on the CPU (where a forward returns when
    it is done), CUDA events on a GPU (read at the end)."""

    def __init__(self, model: Forward) -> None:
        self.model = model
        self.cpu_seconds = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    METHODS = ("forward", "forward_many")  # a batched step calls forward_many, which may call forward per item

    def __enter__(self) -> _ForwardTimer:
        # an instance's own methods, put back on exit
        self.replaced = {name: self.model.__dict__.get(name) for name in self.METHODS if hasattr(self.model, name)}
        cuda = self.model.device.type == "cuda"
        depth = 0  # forward_many's own forwards are inside its time already

        def timing(method: Callable) -> Callable:
            def timed(*args, **kwargs):
                nonlocal depth
                if depth:
                    return method(*args, **kwargs)
                depth += 1
                try:
                    if cuda:
                        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        begin.record()
                        out = method(*args, **kwargs)
                        end.record()
                        self.events.append((begin, end))
                        return out
                    start = time.perf_counter()
                    out = method(*args, **kwargs)
                    self.cpu_seconds += time.perf_counter() - start
                    return out
                finally:
                    depth -= 1
            return timed

        for name in self.replaced:
            setattr(self.model, name, timing(getattr(self.model, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name, own in self.replaced.items():
            if own is None:
                delattr(self.model, name)
            else:
                setattr(self.model, name, own)

    def seconds(self) -> float:
        _synchronize(self.model.device)
        return self.cpu_seconds + sum(begin.elapsed_time(end) for begin, end in self.events) / 1e3


class _ChainDrafter(Drafter):
    """Proposes the root and fixed random tokens after it, a chain the target rejects as a rule."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.max_tree_size = len(tokens) + 1

    def propose(self, root, params, draw, generator):
        return DraftTree([root] + self.tokens, list(range(-1, len(self.tokens))))


class _RunMarks:
    """The engine's `on_tokens`: (wall clock, forward seconds so far) at the end of every `steps` decoding steps."""

    def __init__(self, steps: int, timer: _ForwardTimer) -> None:
        self.steps, self.timer = steps, timer
        self.done = 0
        self.marks: list[tuple[float, float]] = []

    def __call__(self, tokens: list[int]) -> None:
        self.done += 1
        if self.done % self.steps == 0:
            self.marks.append((time.perf_counter(), self.timer.seconds()))


@torch.inference_mode()
def engine_overhead(model: Forward, context: int, sizes: list[int], steps: int = OVERHEAD_STEPS,
                    rounds: int = 3, seed: int = 0) -> dict[int, float]:
    """{n: seconds}: a greedy decoding step's time outside the target's forward, for a draft of n tokens (root
    included) after a prompt of `context` random tokens, by the decoder's own engine: the steps' wall time
    minus their forwards'. The median over `rounds` runs of `steps` steps, all in one generation (one prefill)
    after a first run of `steps` steps that warms the engine up (masks, CUDA graphs)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.shape.vocab
    prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
    overhead = {}
    for n in sizes:
        timer = _ForwardTimer(model)
        chain = torch.randint(0, vocab, (n - 1,), generator=generator).tolist()
        engine = SpeculativeEngine(model, _ChainDrafter(chain))
        runs = _RunMarks(steps, timer)
        with timer:
            engine.generate(prompt, (rounds + 1) * steps, SamplingParams(), on_tokens=runs)
        per_step = [((wall - last_wall) - (forward - last_forward)) / steps
                    for (last_wall, last_forward), (wall, forward) in zip(runs.marks, runs.marks[1:])]
        overhead[n] = max(0.0, float(np.median(per_step)))
    return overhead


@torch.inference_mode()
def engine_overhead_batched(model: LeanModel, sizes: list[int], batches: list[int],
                            context: int = BATCHED_OVERHEAD_PROMPT, steps: int = BATCHED_OVERHEAD_STEPS,
                            rounds: int = 3, seed: int = 0) -> dict[int, dict[int, float]]:
    """{B: {n: seconds}}: a continuous-batching step's time outside the target's forward (every sequence's drafting,
    verification, commit and stop check; the scheduler's bookkeeping) with B sequences of a draft of n tokens each
    (root included) after prompts of `context` random tokens, by the decoder's own Scheduler: the steps' wall time
    minus their forwards'. As `engine_overhead`, the median over `rounds` runs of `steps` steps after a warm-up run
    (the first step also admits and prefills every sequence); B x n above MAX_BATCH_ROWS is not timed."""
    from specplan.decoder.batching import Request, Scheduler

    generator = torch.Generator().manual_seed(seed)
    vocab = model.shape.vocab
    overhead: dict[int, dict[int, float]] = {}
    for B in batches:
        prompts = [torch.randint(0, vocab, (context,), generator=generator).tolist() for _ in range(B)]
        for n in (n for n in sizes if B * n <= MAX_BATCH_ROWS):
            chain = torch.randint(0, vocab, (n - 1,), generator=generator).tolist()
            scheduler = Scheduler(SpeculativeEngine(model, _ChainDrafter(chain)),
                                  lambda _, chain=chain: _ChainDrafter(chain), B)
            for prompt in prompts:  # each step emits at least one token a sequence: none finishes before the end
                scheduler.submit(Request(prompt, (rounds + 1) * steps + 1))
            timer = _ForwardTimer(model)
            marks = []
            with timer:
                for step in range((rounds + 1) * steps):
                    scheduler.step()
                    if (step + 1) % steps == 0:
                        marks.append((time.perf_counter(), timer.seconds()))
            while not scheduler.idle:  # the last tokens, untimed
                scheduler.step()
            per_step = [((wall - last_wall) - (forward - last_forward)) / steps
                        for (last_wall, last_forward), (wall, forward) in zip(marks, marks[1:])]
            overhead.setdefault(B, {})[n] = max(0.0, float(np.median(per_step)))
    return overhead


def _budgets_below(budgets: list[int], context: int) -> list[int]:
    """The retrieval budgets a decoder could use over `context` tokens with chunks of RETRIEVAL_CHUNK."""
    def allowed(budget: int) -> bool:
        try:
            RetrievalSettings(budget, RETRIEVAL_CHUNK).check(context)
        except UserError:
            return False
        return True

    return [budget for budget in budgets if allowed(budget)]


@torch.inference_mode()
def _time_pass(calls: dict[str, Callable[[], float]]) -> dict[str, float]:
    """One timed call of every point."""
    return {name: call() for name, call in calls.items()}


@torch.inference_mode()
def _calls_at(models: dict[str, Forward], context: int, sizes: list[int], budgets: list[int],
              target_sizes: list[int] | None = None) -> dict[str, Callable[[], float]]:
    """A timed call ("role|context|n") per forward of n new tokens over `context` cached tokens, for every model
    and n in `sizes` (the target's in `target_sizes`, where given), and ("retrieval_build|context|budget") per
    retrieval-cache build of the target for every budget in `budgets`.

    On the CPU each timed forward comes right after an untimed one of the same size, as in decoding, where one
    step's size is close to the last one's: timed right after a 512-token forward, a one-token forward of
    smollm2-135m in bf16 costs about 6% more. Cache contents are random: the cost does not depend on them."""
    calls = {}
    pool = torch.cuda.graph_pool_handle() if any(m.device.type == "cuda" for m in models.values()) else None
    for role, model in models.items():
        role_sizes = (target_sizes or sizes) if role == "target" else sizes
        cache = random_cache(model, context, max(role_sizes))
        for n in role_sizes:
            tokens = torch.randint(0, model.shape.vocab, (n,), device=model.device)
            positions = torch.arange(context, context + n, device=model.device)
            mask = causal_mask(context, n, model.dtype, model.device) if n > 1 else None
            if model.device.type == "cpu":
                calls[f"{role}|{context}|{n}"] = _timed_call(model, cache, tokens, positions, mask)
            elif isinstance(model, LeanModel):
                calls[f"{role}|{context}|{n}"] = _cuda_graph_call(model, cache, tokens, positions, pool)
            else:  # the transformers backend runs eagerly on the GPU as well
                calls[f"{role}|{context}|{n}"] = _wall_clock(model.device, functools.partial(
                    model.forward, tokens, positions, cache, mask))
        if role == "target":
            for budget in budgets:
                calls[f"{BUILD}|{context}|{budget}"] = _build_call(model, cache, budget)
    return calls


BATCH = "batch"  # the calls ("batch|role|L|B|n") timing a step of B sequences of n new tokens each at context L


@torch.inference_mode()
def _batch_calls_at(models: dict[str, Forward], context: int, sizes: list[int], batches: list[int]
                    ) -> dict[str, Callable[[], float]]:
    """A timed call per batched step of B sequences, each over its own cache of `context` tokens, of n new tokens
    each (the target for every n in `sizes` with B x n <= MAX_BATCH_ROWS; a draft's one-token step)."""
    calls = {}
    for role, model in models.items():
        if not batches:
            break
        caches = [random_cache(model, context, max(sizes)) for _ in range(max(batches))]
        for B in batches:
            for n in sizes if role == "target" else [1]:
                if B * n > MAX_BATCH_ROWS:
                    continue
                mask = causal_mask(context, n, model.dtype, model.device) if n > 1 else None
                items = [ForwardItem(torch.randint(0, model.shape.vocab, (n,), device=model.device),
                                     torch.arange(context, context + n, device=model.device), cache, mask)
                         for cache in caches[:B]]
                calls[f"{BATCH}|{role}|{context}|{B}|{n}"] = _timed_batch_call(model, items)
    return calls


def _timed_batch_call(model: LeanModel, items: list[ForwardItem]) -> Callable[[], float]:
    def call() -> float:
        model.forward_many(items)
        _synchronize(model.device)
        start = time.perf_counter()
        model.forward_many(items)
        _synchronize(model.device)
        return time.perf_counter() - start

    return call


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_cache(model: Forward, length: int, room: int) -> KVCache | TransformersCache:
    """A cache of `length` entries with `room` free slots after them: what a timed forward reads. The lean
    cache is filled with random values; transformers' cache, whose layout is the model's own, by a prefill of
    random tokens."""
    cache = model.new_cache(length + room)
    if isinstance(cache, KVCache):
        cache.k.normal_(0, 0.1)
        cache.v.normal_(0, 0.1)
        cache.length = length
    else:
        model.prefill(torch.randint(0, model.shape.vocab, (length,), generator=torch.Generator().manual_seed(0)),
                      cache, logits=False)
    return cache


def _build_call(model: LeanModel, cache: KVCache, budget: int) -> Callable[[], float]:
    retrieval = RetrievalCache(model, RetrievalSettings(budget, RETRIEVAL_CHUNK), scratch=0)
    queries = torch.randn(model.shape.layers, model.shape.heads, model.shape.head_dim, device=model.device
                          ).to(model.dtype)

    return _wall_clock(model.device, lambda: retrieval.build(cache, queries))


def _window_prefill_call(model: LeanModel, sinks: int, window: int) -> Callable[[], float]:
    """A StreamingLLM drafter's reset on a prompt longer than its window: the forwards of its sinks and of the
    most recent `window` tokens, as a streaming or model bottom pays once per prompt."""
    drafter = StreamingDrafter(model, gamma=1, sinks=sinks, window=window)
    room = model.shape.max_context - drafter.max_tree_size
    if sinks + window + 1 > room:
        raise UserError(f"a StreamingLLM window of {sinks} + {window} tokens does not fit the model's context of "
                        f"{model.shape.max_context}")
    prompt = torch.randint(0, model.shape.vocab, (sinks + window + 1,)).tolist()
    return _wall_clock(model.device, lambda: drafter.reset(prompt, room))


def _prompt_prefill_call(model: Forward, length: int) -> Callable[[], float]:
    """A model's prefill of a `length`-token prompt into a fresh cache: a draft-model drafter's once per prompt before
    its first draft (decoder/drafters.py: SequoiaDrafter.reset), the target's as a request joins."""
    prompt = torch.randint(0, model.shape.vocab, (length,))
    return _wall_clock(model.device, lambda: model.prefill(prompt, model.new_cache(length + 1), logits=False))


def _wall_clock(device: torch.device, work: Callable[[], object]) -> Callable[[], float]:
    """A call that runs `work` and returns its seconds, the device synchronized on both sides."""
    def call() -> float:
        _synchronize(device)
        start = time.perf_counter()
        work()
        _synchronize(device)
        return time.perf_counter() - start

    return call


def _timed_call(model: Forward, cache: KVCache | TransformersCache, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None) -> Callable[[], float]:
    def call() -> float:
        model.forward(tokens, positions, cache, mask)
        start = time.perf_counter()
        model.forward(tokens, positions, cache, mask)
        return time.perf_counter() - start

    return call


def _cuda_graph_call(model: LeanModel, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                     pool: tuple) -> Callable[[], float]:
    """Capture one forward of this shape as a CUDA graph (static layout) in the memory `pool` it shares with
    the other graphs of its context (replayed one at a time, their outputs never read); each call replays it,
    timed with CUDA events."""
    n = tokens.shape[0]
    mask = torch.full((n, cache.max_len), float("-inf"), dtype=model.dtype, device=model.device)
    mask[:, :cache.length + n] = causal_mask(cache.length, n, model.dtype, model.device)
    slots = positions.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model.forward(tokens, positions, cache, mask, slots=slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        model.forward(tokens, positions, cache, mask, slots=slots)

    def call() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    # The graph reads and writes this memory by address: freed, the allocator would hand it to other tensors.
    call.graph_memory = (cache, tokens, positions, mask, slots)  # type: ignore[attr-defined]
    return call


# --- modeled ----------------------------------------------------------------------------------------------

def _model(request: ProfileRequest, log) -> dict:
    return _model_cpu(request, log) if request.gpu == "cpu" else _model_gpu(request, log)


def _model_gpu(request: ProfileRequest, log) -> dict:
    """A GPU not at hand: the cost model of profiler/roofline.py, from the models' configs alone, on the placement
    of profiler/offload.py (N GPUs, offloading)."""
    gpu = roofline.accelerator(request.gpu)
    setup = DeviceSetup(gpu, request.gpus, request.offload, host_link(request.host_link) if request.host_link else None,
                        request.resident)
    mode = {"auto": "graphs", "lean": "graphs", "compiled": "compiled"}.get(request.backend)
    if mode is None:
        raise UserError("a modeled GPU profile models the lean forward (--backend lean or compiled), not "
                        f"{request.backend}'s")
    calibration = (calibrate(request.gpu, request.calibrate, request.calibration_prior_weight) if request.calibrate
                   else None)
    parameters = calibration.parameters if calibration else roofline.DEFAULT_PARAMETERS
    specs = {role: load_model_spec(name, dtype, log) for role, name, dtype in request.roles()}
    models = {role: _ModeledModel.of(spec, role, request, setup) for role, spec in specs.items()}
    draft = models.get("draft")
    widest = max(request.sizes)

    def placement(role: str, context: int, batch: int, n: int) -> Placement:
        if role == "draft":  # the draft stays on the device
            return Placement(True)
        draft_tokens = batch * (min(context, draft.shape.max_context - n) + n) if draft else 0
        return setup.place(models["target"].bytes, batch * (context + n), draft.bytes if draft else None,
                           draft_tokens)

    def seconds(role: str, n: int, context: int, batch: int = 1) -> float:
        model = models[role]
        chip = roofline.gpu_forward_seconds(model.cost, gpu, parameters, n, context, mode, batch=batch)
        allreduce = setup.allreduce_seconds(batch * n, model.shape.hidden, model.spec.dtype)
        return setup.forward_seconds(chip, model.shape.layers, allreduce, placement(role, context, batch, n))

    longest = max(request.contexts)
    if not placement("target", longest, 1, widest).fits:
        what = {"weights": "its embeddings, head and KV cache with two streamed layers",
                "kv": "its weights with two streamed layers of its KV cache"}.get(request.offload, "its weights and KV "
                                                                                     "cache")
        draft_part = " beside the draft" if draft else ""
        raise UserError(f"{specs['target'].name}: {what} for {longest + widest} tokens do not fit "
                        f"{request.gpus} x {gpu.name} ({gpu.memory_gb:g} GB each){draft_part}"
                        + ("" if request.offload else "; model it with --offload weights|kv or --gpus N"))
    curves = {role: {L: {n: {"median": seconds(role, n, L)} for n in request.sizes} for L in model.contexts}
              for role, model in models.items()}
    machine = {"gpu": gpu.name, "memory_gb": gpu.memory_gb, "bandwidth_gb_s": gpu.bandwidth_gb_s,
               "tflops": gpu.tflops[request.dtype], "sms": gpu.sms, "source": gpu.source, "dtype": request.dtype,
               **setup.record()}
    document = profile_document(request, "modeled", machine, specs, curves)
    for L in request.contexts:
        entry = document["target"]["contexts"][L]
        if request.offload:
            placed = placement("target", L, 1, 1)
            entry["streamed_gb"] = placed.streamed / 1e9
            entry.update({"resident_layers": placed.resident_layers} if request.offload == "weights"
                         else {"resident_tokens": placed.resident_tokens})
        if request.offload == "kv" and _budgets_below(request.budgets, L):
            entry["retrieval_build_seconds"] = {
                budget: _offloaded_build_seconds(setup, parameters, models["target"].bytes,
                                                 placement("target", L, 1, 1), L, budget)
                for budget in _budgets_below(request.budgets, L)}
    for role, model in models.items():  # t(B, n): B x n GEMM rows, each sequence's own KV cache
        for L in model.contexts:
            for B in (B for B in request.batches if B > 1):
                entry = {"fits_memory": placement("target", L, B, widest).fits}
                times = {n: seconds(role, n, L, B) for n in (request.sizes if role == "target" else [1])}
                if role == "draft":
                    entry["step_seconds"] = times[1]
                else:
                    entry["t_seconds"] = times
                document[role]["contexts"][L].setdefault("batches", {})[B] = entry
    document["target"]["engine_overhead_seconds"] = (calibration.engine_overhead if calibration and
                                                     calibration.engine_overhead else roofline.DEFAULT_ENGINE_OVERHEAD)
    document["target"]["engine_overhead_context"] = min(request.contexts)
    document["settings"] = {"model": "GPU cost model (profiler/roofline.py, profiler/offload.py)", "execution": mode,
                            "engine": ("vllm: a batch's attention in one call per layer" if request.engine == "vllm"
                                       else "specplan: each sequence's cache writes and attention apart"),
                            "parameters": parameters.as_dict(),
                            "calibration": calibration.record() if calibration else "catalogue defaults"}
    document["backend"] = "compiled" if mode == "compiled" else "lean"
    return document


@dataclass(frozen=True)
class _ModeledModel:
    """A model as the GPU cost model sees it: one GPU's share of its forward and of its memory."""

    spec: ModelSpec
    shape: ModelShape  # the whole model's
    cost: roofline.GpuModelCost  # one GPU's share
    bytes: ModelBytes  # one GPU's share
    contexts: list[int]  # the contexts it is modeled at

    @classmethod
    def of(cls, spec: ModelSpec, role: str, request: ProfileRequest, setup: DeviceSetup) -> _ModeledModel:
        if spec.dtype not in setup.gpu.tflops:
            raise UserError(f"{setup.gpu.name} has no {spec.dtype} support")
        shape = ModelShape.from_config(spec.config)
        contexts = request.contexts
        if role == "draft":  # a draft runs over its own context at most (a StreamingLLM window beyond it)
            contexts = [L for L in request.contexts if L + max(request.sizes) <= shape.max_context]
        if role == "target" or not contexts:
            _check_contexts(spec.name, shape, request)
        output_rows = len(draft_vocabulary_ids(request.draft_vocab, spec.stop_token_ids, shape.vocab)) \
            if role == "draft" and request.draft_vocab is not None else shape.vocab
        shard, intermediate = setup.shard(shape, spec.config.intermediate_size, spec.name)
        cost = roofline.gpu_model_cost(shard, intermediate, spec.dtype, gpu_operators(spec.config, spec.dtype),
                                       math.ceil(output_rows / setup.gpus))
        cost = replace(cost, sequence_kernels=request.engine != "vllm")
        return cls(spec, shape, cost, ModelBytes.of(shape, spec.config.intermediate_size,
                                                    spec.fingerprint["parameters"], spec.dtype, setup.gpus), contexts)


def _offloaded_build_seconds(setup: DeviceSetup, parameters: roofline.GpuParameters, target: ModelBytes,
                             placed: Placement, context: int, budget: int) -> float:
    """A TriForce retrieval-cache build with the KV cache offloaded: the chosen chunks' keys and values, `budget`
    tokens in every layer, gathered from host memory (their offloaded share) and from the device's memory."""
    offloaded_share = 1.0 - (placed.resident_tokens if placed.resident_tokens is not None else context) / context
    moved = budget * target.kv_per_token
    return (moved * offloaded_share / setup.link_bytes_per_second
            + moved / (setup.gpu.bandwidth_gb_s * 1e9 * parameters.bandwidth_efficiency))


def _model_cpu(request: ProfileRequest, log) -> dict:
    """This CPU, from microbenchmarks: overhead + max(bytes / bandwidth, flops / matmul rate)."""
    models = {role: _load(name, dtype, log) for role, name, dtype in request.roles()}
    costs = {}
    for role, m in models.items():
        shape = ModelShape.from_config(m.config)
        _check_contexts(m.name, shape, request)
        output_rows = len(draft_vocabulary_ids(request.draft_vocab, m.stop_token_ids, shape.vocab)) \
            if role == "draft" and request.draft_vocab is not None else shape.vocab
        costs[role] = roofline.ModelCost.from_shape(shape, m.config.intermediate_size, m.dtype, output_rows)
    log("microbenchmarking this CPU (bandwidth, matmul throughput, per-op cost)")
    bench = hardware.measure_cpu(torch_dtype(request.dtype))
    bandwidth, flops = bench["bandwidth_bytes_per_s"], bench["matmul_flops_per_s"]
    machine = {**hardware.fingerprint(torch.device("cpu"), request.dtype, request.threads), "microbenchmark": bench}
    overhead_of = {role: bench["op_seconds"] * count_forward(LeanModel(m.model), 1, 0, static=False)
                   for role, m in models.items()}
    curves = {role: {L: {n: {"median": roofline.roofline_seconds(cost, n, L, bandwidth, flops, overhead_of[role])}
                         for n in request.sizes} for L in request.contexts}
              for role, cost in costs.items()}
    document = profile_document(request, "modeled", machine, models, curves)
    document["settings"] = {"model": "roofline", "bandwidth_bytes_per_s": bandwidth, "flops_per_s": flops}
    return document


# --- the document -----------------------------------------------------------------------------------------

def profile_document(request: ProfileRequest, source: str, machine: dict, models: dict[str, LoadedModel | ModelSpec],
              curves: dict[str, dict[int, dict[int, dict]]]) -> dict:
    first = request.contexts[0]

    def section(role: str) -> dict:
        by_context = curves[role]
        base = first if first in by_context else min(by_context)  # a draft modeled at its own contexts only
        out = {"context": base, "t_seconds": {n: p["median"] for n, p in by_context[base].items()}}
        if role == "draft":
            out = {"step_seconds": by_context[base][1]["median"], **out}
        out["contexts"] = {}
        for L, points in by_context.items():
            entry = {"t_seconds": {n: p["median"] for n, p in points.items()}}
            if role == "draft":
                entry["step_seconds"] = points[1]["median"]
            if "p10" in next(iter(points.values())):
                entry["spread_seconds"] = {n: [p["p10"], p["p90"]] for n, p in points.items()}
            out["contexts"][L] = entry
        return out

    document = {
        "kind": "profile/latency",
        "version": FORMAT_VERSION,
        "source": source,
        "models": {role: m.name for role, m in models.items()},
        "dtype": request.dtype,
        **({"draft_dtype": models["draft"].dtype} if "draft" in models else {}),
        **({"draft_vocab": request.draft_vocab} if "draft" in models and request.draft_vocab is not None else {}),
        "hardware": machine,
        "model_fingerprints": {role: m.fingerprint for role, m in models.items()},
        "target": section("target"),
    }
    if "draft" in curves:
        document["draft"] = section("draft")
    document["provenance"] = provenance()
    return document
