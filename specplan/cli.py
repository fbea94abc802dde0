"""The `plan` command: parse, call a library function, print. Bad input ends with one stderr line and exit 2."""

from __future__ import annotations

import math
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from specplan.core.choices import (
    BACKENDS,
    BASELINES,
    DEFAULT_PROMPT_CACHE_MIB,
    DEVICES,
    DRAFT_RULES,
    DTYPES,
    ENGINES,
    EXPORT_FORMATS,
    HOST_LINK_NAMES,
    LOOKUP_ENGINES,
    MIN_SPEEDUP,
    OFFLOAD_KINDS,
    PROFILE_DTYPES,
    REQUESTS_PER_CLIENT,
    RESIDENT_POLICIES,
    SERVING_BASELINES,
    VERIFICATION_RULES,
    VLLM_METHODS,
)
from specplan.core.errors import UserError
from specplan.core.method_settings import STREAMING_SINKS, STREAMING_WINDOW
from specplan.core.plan_schema import Plan, save_plan
from specplan.core.provenance import cli_command
from specplan.profiler.datasets import DATASETS

PROMPTS_HELP = ("NAME[:category[,category]] (NAME: one of the carried sets, " + ", ".join(DATASETS)
                + ") or PATH[:category[,...]]: a Spec-Bench-style .jsonl, a .txt file or a folder of them")
TRIFORCE_PROMPTS = 2  # long prompts per context `plan accept triforce` builds by default
ESSAYS_HELP = ("the texts long prompts are built from: haystack (the carried essays), a folder of .txt files, or a "
               "JSONL dataset (specbench:summarization,rag: news articles)")


def _set_quiet(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    from specplan.core import progress

    progress.set_quiet(value)
    return value


QUIET = click.Option(["--quiet", "-q"], is_flag=True, expose_value=False, is_eager=True, callback=_set_quiet,
                     help="no progress lines on stderr (results and errors still print)")


class Command(click.Command):
    """Every command takes --quiet."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(QUIET)


class InPipelineOrder(click.Group):
    """Lists its commands in the order they are defined (the pipeline's), not alphabetically."""

    command_class = Command

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


InPipelineOrder.group_class = InPipelineOrder


@click.group(cls=InPipelineOrder, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specplan")
def cli() -> None:
    """Profile, plan and run lossless speculative decoding on the hardware at hand."""


def _progress(message: str) -> None:
    """Progress notes: on stderr, whatever it is attached to (--quiet silences them; an error is still one line)."""
    from specplan.core import progress

    progress.say(message)


def _writable(ctx: click.Context, param: click.Parameter, path: Path | None) -> Path | None:
    """An output path, checked before any work: not a directory, and a file can be made where it goes (in its
    folder, or in the nearest existing folder above it when the folders are still to be made)."""
    if path is None:
        return None
    if path.is_dir():
        raise UserError(f"{path}: is a directory; give a file name to write")
    folder = next((p for p in (path.parent.resolve(), *path.parent.resolve().parents) if p.exists()), Path("/"))
    try:
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a directory")
        with tempfile.TemporaryFile(dir=folder):
            pass
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError("the file is read-only")
    except OSError as exc:
        raise UserError(f"{path}: cannot be written ({exc.strerror or exc})") from None
    return path


def _prefill_chunk_option():
    return click.option("--prefill-chunk", type=click.IntRange(min=0), default=0, show_default=True,
                        help="prompt tokens a joining request adds to each decode step (chunked prefill); 0: "
                             "prefill joining requests together before the next step")


def _fixed_drafting_option():
    return click.option("--fixed-drafting", is_flag=True,
                        help="every request drafts at every step as the plan says (default: a request whose drafts "
                             "yield too little to pay at the plan's price sits steps out; decoder/gate.py)")


def _no_sharing_option():
    return click.option("--no-sharing", is_flag=True,
                        help="a plan solved with --share-rows: each request drafts as the plan's schedule and its own "
                             "drafts say, instead of by the rows a step shares out (decoder/sharing.py)")


def _chat_option():
    return click.option("--chat/--no-chat", default=True, show_default=True,
                        help="apply the target's chat template to prompts (a model without one takes them as given)")


def _schedule_contexts_option() -> Callable:
    return click.option("--contexts", "schedule_contexts",
                        help="with --batches: one batch-size table per context, comma-separated (each sequence "
                             "follows the table of its own length) [one, at the acceptance's mean context]")


def _offload_options() -> Callable:
    def options(command: Callable) -> Callable:
        command = click.option("--resident-layers", type=click.IntRange(min=0),
                               help="with --offload weights: the target's first layers kept on the device [a GPU: as "
                                    "many as its free memory holds beside a 4,096-token cache; a CPU: none]")(command)
        return click.option("--offload", type=click.Choice(OFFLOAD_KINDS),
                            help="keep the target's later layers (weights) or its KV cache (kv) in host memory and "
                                 "stream them in every forward")(command)
    return options


def _check_offload(offload: str | None, resident_layers: int | None) -> None:
    if resident_layers is not None and offload != "weights":
        raise UserError("--resident-layers says how many layers an offloaded target keeps on the device: it needs "
                        "--offload weights")


def _min_speedup_option(help: str) -> Callable:
    def finite(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
        if not math.isfinite(value):
            raise UserError(f"--min-speedup must be a positive number, got {value}")
        return value
    return click.option("--min-speedup", type=click.FloatRange(min=0, min_open=True), default=MIN_SPEEDUP,
                        show_default=True, callback=finite, help=help)


def _stand_in_option() -> Callable:
    return click.option("--stand-in", is_flag=True,
                        help="the acceptance file is another model's (pair's), standing in for the profile's models "
                             "(e.g. configs modeled on a GPU): the plan is for the profile's models and says so")


def _output(required: bool = True, help: str | None = None):
    return click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=required,
                        callback=_writable, help=help)


def _renamed(value: Any, old_value: Any, old: str, new: str, required: bool = False) -> Any:
    """A flag renamed in this release: the old name still works for one release, hidden, and says the new one."""
    if old_value is not None:
        click.echo(f"plan: note: {old} is deprecated; use {new}", err=True)
        value = old_value if value is None else value
    if value is None and required:
        raise UserError(f"missing option {new}")
    return value


def _old_name(name: str, **kwargs: Any):
    return click.option(name, name.lstrip("-").replace("-", "_") + "_old", hidden=True, **kwargs)


DRAFT_VOCAB_HELP = ("the draft scores only the token ids below this (plus the stop tokens): a cheaper draft "
                    "step; profile, acceptance and plan must agree")


BACKEND_HELP = ("the forward that runs the models: lean (the families decoder/model.py runs, fast), compiled (the lean "
                "forward through torch.compile under CUDA graphs: GPU only, about a minute to compile each shape), "
                "transformers (any causal LM, the model's own forward), auto: lean where it can")


def _backend_option(default: str | None):
    return click.option("--backend", type=click.Choice(BACKENDS), default=default, show_default=default is not None,
                        help=BACKEND_HELP + ("" if default else "; default: the plan's, else auto"))


def _int_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"expected a comma-separated list of integers, got {text!r}") from None


@cli.command()
@click.option("--target", help="the target model: a preset, HF directory or .gguf; with --gpu NAME also a config.json "
                               "(no weights read)  [required]")
@_old_name("--model")
@click.option("--draft", help="draft model (its per-step cost is profiled too)")
@click.option("--dtype", type=click.Choice(PROFILE_DTYPES), default="fp32", show_default=True,
              help="fp16: modeled GPUs only")
@click.option("--draft-dtype", type=click.Choice(PROFILE_DTYPES), help="default: --dtype")
@click.option("--draft-vocab", type=click.IntRange(min=1), help=DRAFT_VOCAB_HELP)
@click.option("--contexts", help="context lengths L, comma-separated [128,1024,4096]")
@click.option("--sizes", help="new-token counts n, comma-separated [1,2,4,...,512]")
@click.option("--batches", help="batch sizes B: also time steps of B sequences of n new tokens each, t(B, n), "
                                "with B x n up to 256 rows, comma-separated [1]")
@click.option("--row-totals", type=click.IntRange(min=0), default=0,
              help="also time the target's forward of one sequence at every n up to this, by which `plan solve "
                   "lookahead --share-rows` prices steps whose rows are not a multiple of the batch size [0]")
@click.option("--budgets", help="TriForce retrieval budgets to time a cache build at, where below the context "
                                "[256,512,1024,2048,4096]")
@click.option("--window-prefill", help="SINKS,WINDOW: also time a StreamingLLM drafter's prefill of its window "
              "(the draft's, else the target's), which `plan solve triforce` charges once per prompt [off]")
@click.option("--gpu", help="a catalogue GPU to model (a100-80g, h100, ..., or the device's own name, as in "
                             "\"NVIDIA H100 PCIe\"), or `cpu` to model this CPU")
@click.option("--calibrate", multiple=True, type=click.Path(dir_okay=False),
              help="a profile measured on that GPU (repeatable): fit its cost model to them first")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="with --gpu NAME: tensor parallelism over this many such GPUs, each with its own host link")
@click.option("--offload", type=click.Choice(OFFLOAD_KINDS),
              help="with --gpu NAME: keep what does not fit the GPU's memory (the target's layers, or its cached "
                   "tokens) in host memory, streamed over the host link every forward")
@click.option("--host-link", type=click.Choice(HOST_LINK_NAMES), help="with --gpu NAME: the GPUs' link to host "
              "memory [the GPU's own]")
@click.option("--resident", type=click.Choice(RESIDENT_POLICIES), default="fill", show_default=True,
              help="with --offload: fill the GPU first, or keep nothing offloadable on it (every layer or cached "
                   "token streamed, as the papers' offloading baselines do)")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (default: all cores)")
@click.option("--repeats", type=click.IntRange(min=1), help="timed repeats per point [7, quick 3]")
@click.option("--quick", is_flag=True, help="fewer sizes and repeats")
@click.option("--resume", is_flag=True, help="go on from the timing passes an interrupted run completed")
@_backend_option("auto")
@click.option("--engine", type=click.Choice(("specplan", "llama.cpp", "llama-server", "vllm")), default="specplan",
              show_default=True,
              help="vllm (with --gpu NAME): model vLLM's execution, a batch's attention in one call per layer (for "
                   "`plan solve --engine vllm`; specplan's own runs each sequence's attention apart); "
                   "llama.cpp: time llama.cpp's own forward of the model's GGUF (the llamacpp extra), and with "
                   "--draft the draft's step, for `plan solve lookahead|sequoia --engine llama.cpp`; llama-server: "
                   "time its server's steps of B slots (--batches) verifying n rows each (make bench-server), for "
                   "`plan solve lookahead --engine llama-server`, and with --draft its draft model's work, for "
                   "`plan solve sequoia --engine llama.cpp`")
@_output()
def profile(target: str | None, model_old: str | None, draft: str | None, dtype: str, draft_dtype: str | None,
            draft_vocab: int | None, contexts: str | None, sizes: str | None, batches: str | None,
            row_totals: int, budgets: str | None,
            window_prefill: str | None, gpu: str | None, calibrate: tuple[str, ...], gpus: int, offload: str | None,
            host_link: str | None, resident: str, threads: int | None,
            repeats: int | None, quick: bool, resume: bool, backend: str, engine: str, output: Path) -> None:
    """Measure (or model) t(n) per context length and the draft's per-step cost."""
    target = _renamed(target, model_old, "--model", "--target", required=True)
    from specplan.profiler.latency import QUICK_SIZES, ProfileRequest, run_profile
    from specplan.show import describe_profile

    request = ProfileRequest(target=target, draft=draft, dtype=dtype, draft_dtype=draft_dtype,
                             draft_vocab=draft_vocab, gpu=gpu, calibrate=list(calibrate), backend=backend, gpus=gpus,
                             offload=offload, host_link=host_link, resident=resident, row_totals=row_totals,
                             engine=engine)
    if quick:
        request.sizes, request.repeats, request.warmup = list(QUICK_SIZES), 3, 1
    request.contexts = _int_list(contexts) or request.contexts
    request.sizes = _int_list(sizes) or request.sizes
    request.batches = _int_list(batches) or request.batches
    request.budgets = _int_list(budgets) if budgets is not None else request.budgets
    request.threads = threads or request.threads
    request.repeats = repeats or request.repeats
    if window_prefill is not None:
        sinks_window = _int_list(window_prefill)
        if len(sinks_window) != 2 or sinks_window[0] < 0 or sinks_window[1] < 1:
            raise UserError(f"--window-prefill takes SINKS,WINDOW (sinks >= 0, window >= 1), got {window_prefill!r}")
        request.window_prefill = (sinks_window[0], sinks_window[1])
    if engine == "llama.cpp":
        from specplan.core.profile_schema import save_profile
        from specplan.llamacpp import profile_llamacpp

        if row_totals:
            raise UserError("--row-totals prices our decoder's shared rows: it goes with --engine specplan")

        profiled = save_profile(profile_llamacpp(request, log=_progress), output)
    elif engine == "llama-server":
        from specplan.core.profile_schema import save_profile
        from specplan.server_profile import profile_llama_server

        profiled = save_profile(profile_llama_server(request, log=_progress), output)
    else:
        profiled = run_profile(request, output, resume, log=_progress)
    click.echo(describe_profile(profiled))
    click.echo(f"wrote {output}")


@cli.group(cls=InPipelineOrder)
def accept() -> None:
    """Measure acceptance statistics of a draft/target pair on a dataset."""


@accept.command("sequoia")
@click.option("--target", required=True)
@click.option("--draft", required=True)
@click.option("--dataset", required=True, help=PROMPTS_HELP)
@click.option("--prompts", type=click.IntRange(min=1), help="number of prompts (spread across categories) [all]")
@_old_name("--samples", type=click.IntRange(min=1))
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--width", type=click.IntRange(min=1), default=16, show_default=True, help="K: children ranks measured")
@click.option("--max-new-tokens", type=click.IntRange(min=1),
              default=128, show_default=True, help="continuation length per prompt")
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True)
@click.option("--draft-dtype", type=click.Choice(DTYPES), help="default: --dtype")
@click.option("--draft-vocab", type=click.IntRange(min=1), help=DRAFT_VOCAB_HELP)
@_chat_option()
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--paths", type=click.IntRange(min=1),
              default=64, show_default=True, help="simulated rejection paths per position")
@_backend_option("auto")
@_output()
def accept_sequoia(target: str, draft: str, dataset: str, prompts: int | None, samples_old: int | None,
                   temperature: float, top_p: float, width: int, max_new_tokens: int, dtype: str,
                   draft_dtype: str | None, draft_vocab: int | None, chat: bool, seed: int, paths: int, backend: str,
                   output: Path) -> None:
    """Sequoia's positional acceptance vector, by teacher forcing on the target's own continuations."""
    samples = _renamed(prompts, samples_old, "--samples", "--prompts")
    from specplan.decoder.sampling import SamplingParams
    from specplan.profiler.acceptance import run_sequoia_acceptance
    from specplan.show import describe_acceptance

    params = SamplingParams(temperature=temperature, top_p=top_p)
    document = run_sequoia_acceptance(target, draft, dataset, samples, params, width, max_new_tokens, dtype, chat,
                                      seed, paths, str(output), log=_progress, draft_dtype=draft_dtype,
                                      draft_vocab=draft_vocab, backend=backend)
    click.echo(describe_acceptance(document))
    click.echo(f"wrote {output}")


@accept.command("lookahead")
@click.option("--target", required=True)
@click.option("--dataset", required=True, help=PROMPTS_HELP)
@click.option("--prompts", type=click.IntRange(min=1), help="number of prompts (spread across categories) [all]")
@_old_name("--samples", type=click.IntRange(min=1))
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True)
@_chat_option()
@click.option("--decode-with", type=click.Path(dir_okay=False), default=None,
              help="store the outputs of this Lookahead plan's decoder (bf16: the text speculative decoding emits)")
@click.option("--engine", type=click.Choice(("specplan", "llama.cpp")), default="specplan", show_default=True,
              help="llama.cpp: store llama.cpp's own greedy outputs (the llamacpp extra), for its prompt-lookup plans")
@_output()
def accept_lookahead(target: str, dataset: str, prompts: int | None, samples_old: int | None, max_new_tokens: int,
                     dtype: str, chat: bool, decode_with: str | None, engine: str, output: Path) -> None:
    """The target's own greedy outputs on a dataset, for the offline trie replay (and engines' prompt lookup)."""
    samples = _renamed(prompts, samples_old, "--samples", "--prompts")
    from specplan.profiler.outputs import run_lookahead_acceptance

    engine_outputs = None
    if engine == "llama.cpp":
        from specplan.llamacpp import greedy_outputs as engine_outputs
    acceptance = run_lookahead_acceptance(target, dataset, samples, max_new_tokens, dtype, chat, str(output),
                                          log=_progress, decode_with=decode_with, engine_outputs=engine_outputs)
    tokens = sum(len(r.output) for r in acceptance.records)
    click.echo(f"{len(acceptance.records)} prompts, {tokens} generated tokens; wrote {output}")


@accept.command("triforce")
@click.option("--target", required=True)
@click.option("--draft", help="bottom draft model (with a StreamingLLM cache); without it, a Lookahead trie")
@click.option("--dataset", required=True, help=ESSAYS_HELP)
@click.option("--contexts", default="4096,8192", show_default=True, help="prompt lengths in tokens")
@click.option("--prompts", type=click.IntRange(min=1), help="prompts at each context length (needle, summary, ...) "
                                                             "[2]")
@_old_name("--samples", type=click.IntRange(min=1))
@click.option("--budgets", default="256,512,1024,2048", show_default=True)
@click.option("--chunks", default="8,16", show_default=True)
@click.option("--strides", default="64,256", show_default=True, help="retrieval-cache rebuild strides")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True)
@click.option("--sinks", type=click.IntRange(min=0), default=STREAMING_SINKS, show_default=True,
              help="StreamingLLM cache of the bottom model and of the streaming-only draft: sink tokens")
@click.option("--window", type=click.IntRange(min=1),
              default=STREAMING_WINDOW, show_default=True, help="... and recent tokens")
@click.option("--decode-with", type=click.Path(dir_okay=False), default=None,
              help="a greedy TriForce plan: measure along the text it decodes (outside fp32 it differs from the "
                   "target's one-token text)")
@click.option("--one-document", is_flag=True,
              help="every prompt asks about the same document (its last line differs), as the load of `plan bench "
                   "--one-document` does")
@click.option("--seed", type=int, default=0, show_default=True,
              help="the order of the essays in the documents (`plan bench` builds its long prompts with seed 0)")
@_output()
def accept_triforce(target: str, draft: str | None, dataset: str, contexts: str, prompts: int | None,
                    samples_old: int | None, budgets: str, chunks: str, strides: str, max_new_tokens: int,
                    temperature: float, top_p: float, dtype: str, sinks: int, window: int, decode_with: str | None,
                    one_document: bool, seed: int, output: Path) -> None:
    """Acceptance of the retrieval-cache target (per budget/chunk/stride) and of the bottom drafter."""
    samples = _renamed(prompts, samples_old, "--samples", "--prompts") or TRIFORCE_PROMPTS
    from specplan.decoder.sampling import SamplingParams
    from specplan.profiler.triforce_acceptance import run_triforce_acceptance

    grid = [(b, c, r) for b in _int_list(budgets) for c in _int_list(chunks) for r in _int_list(strides)]
    document = run_triforce_acceptance(target, draft, "model" if draft else "trie", dataset, _int_list(contexts),
                                       samples, grid, max_new_tokens, SamplingParams(temperature, top_p), dtype,
                                       sinks, window, str(output), log=_progress, decode_with=decode_with,
                                       one_document=one_document, seed=seed)
    click.echo(f"{'L':>6} {'B':>5} {'s':>3} {'R':>4} {'middle':>7} {'bottom':>7}")
    for e in document["entries"]:
        click.echo(f"{e['context']:>6} {e['budget']:>5} {e['chunk']:>3} {e['stride']:>4} {e['middle']:>7.3f} "
                   f"{e['bottom']:>7.3f}")
    click.echo(f"wrote {output}")


@cli.group(cls=InPipelineOrder)
def solve() -> None:
    """Turn a profile and acceptance statistics into a plan file."""


@solve.command("sequoia")
@click.option("--acceptance", "acceptance_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="acceptance/sequoia YAML (the positional acceptance vector)")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path),
              help="profile/latency YAML; without it the plan maximises tokens per step")
@click.option("--max-size", type=click.IntRange(min=1),
              required=True, help="largest tree size n (nodes, root included)")
@click.option("--max-depth", type=click.IntRange(min=0), required=True, help="largest tree depth d (draft steps)")
@click.option("--context", type=int, default=None, help="use the profile's t(n) at this context length")
@click.option("--top", type=click.IntRange(min=0),
              default=10, show_default=True, help="rows of the ranked table to print")
@click.option("--engine", type=click.Choice(ENGINES), default="specplan", show_default=True,
              help="the best tree this serving engine runs (its rules: planner/engines.py)")
@click.option("--heads", type=click.IntRange(min=1),
              help="medusa, eagle1: the draft heads of your model (its deepest level)")
@click.option("--batches", type=click.IntRange(min=1),
              help="a chain engine's plan (--engine vllm, trtllm-draft, llama.cpp): also schedule the draft length "
                   "for every batch size up to this one (a profile with --batches): the most output tokens/s over "
                   "the batch, or none")
@_min_speedup_option("with --batches: draft at a batch size only where predicted this much faster than one-token "
                     "decoding")
@_schedule_contexts_option()
@_stand_in_option()
@click.option("--max-new-tokens", type=click.IntRange(min=1),
              help="solve for requests of this many new tokens: each chain trace cut to its first N (default: whole; "
                   "a draft model's prompt prefill weighs more the fewer tokens a request asks)")
@_output()
def solve_sequoia_cmd(acceptance_path: Path, profile_path: Path | None, max_size: int, max_depth: int,
                      context: int | None, top: int, engine: str, heads: int | None, batches: int | None,
                      min_speedup: float, schedule_contexts: str | None, stand_in: bool, max_new_tokens: int | None,
                      output: Path) -> None:
    """Sequoia: the optimal token tree and its size/depth for this hardware (and a serving engine's rules)."""
    from specplan.planner.sequoia import solve_sequoia
    from specplan.show import describe_engine_cost, describe_schedule

    plan, ranked = solve_sequoia(acceptance_path, max_size, max_depth, profile_path, context, engine, heads, batches,
                                 stand_in, tuple(_int_list(schedule_contexts) or ()), min_speedup, max_new_tokens)
    header = f"{'n':>5} {'d':>3} {'G(n,d)':>8}"
    if profile_path is not None:
        header += f" {'step ms':>9} {'speedup':>8} {'tok/s':>8}"
    click.echo(header)
    for c in ranked[:top]:
        row = f"{c.size:>5} {c.depth:>3} {c.tokens_per_step:>8.4f}"
        if c.speedup is not None:
            row += f" {c.step_seconds * 1e3:>9.3f} {c.speedup:>8.3f} {c.tokens_per_second:>8.2f}"
        click.echo(row)
    save_plan(plan, output)
    if plan.engine != "specplan":
        click.echo(describe_engine_cost(plan))
    if plan.schedule is not None:
        click.echo(describe_schedule(plan.schedule, plan.method))
    chain_note = (f" (the longest chain its schedule drafts; at batch size 1: K = "
                  f"{(plan.schedule.entry_for(1).decoding_length or 1) - 1})" if plan.schedule is not None else "")
    click.echo(f"solved n <= {max_size}, d <= {max_depth} in {plan.solver['seconds'] * 1e3:.1f} ms; "
               f"chose n = {plan.tree.size}, d = {plan.tree.depth}{chain_note}; wrote {output}")


@solve.command("lookahead")
@click.option("--acceptance", "acceptance_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="acceptance/lookahead YAML (the target's greedy outputs)")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--decoding-lengths", help="L_d grid, comma-separated (default 2..64)")
@click.option("--branch-lengths", help="L_b grid, comma-separated (default 1..16)")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True)
@click.option("--engine", type=click.Choice(("specplan",) + LOOKUP_ENGINES), default="specplan", show_default=True,
              help="specplan: our Lookahead trie; hf, llama.cpp (llama-cpp-python), vllm: that engine's prompt "
                   "lookup, llama-server: its ngram-simple, sglang: its NGRAM trie, each replayed by its own rule (a "
                   "llama.cpp plan is priced on `plan profile --engine llama.cpp`)")
@click.option("--max-ngrams", help="prompt lookup: longest n-grams matched, comma-separated (default 1..4)")
@click.option("--draft-lengths", help="prompt lookup: tokens drafted (sglang: num_draft_tokens - 1), comma-separated "
                                      "(default 1..16)")
@click.option("--trie-depths", help="sglang: max_trie_depth values, comma-separated (default 18, its default)")
@click.option("--bfs-breadths", help="sglang: max_bfs_breadth values, comma-separated (default 1,2,4,10)")
@click.option("--match-types", help="sglang: BFS, PROB or both, comma-separated (default both)")
@click.option("--stop-tokens", help="prompt lookup (hf): the target's stop token ids, where the acceptance file "
                                    "does not record them")
@click.option("--batches", type=click.IntRange(min=1),
              help="also schedule the decoding length (llama-server: the tokens drafted) for every batch size up to "
                   "this one (a profile with --batches): the setting giving the most output tokens/s over the batch, "
                   "or none")
@_min_speedup_option("with --batches: draft at a batch size only where predicted this much faster than one-token "
                     "decoding")
@_schedule_contexts_option()
@_stand_in_option()
@click.option("--max-new-tokens", type=click.IntRange(min=1),
              help="solve for requests of this many new tokens: each acceptance output cut to its first N (default: "
                   "whole; a trie or an n-gram lookup drafts late tokens better, having read more of the output)")
@click.option("--share-rows", metavar="L_D,L_B",
              help="with --batches: the decoder shares each step's rows among the requests by their own drafts' "
                   "yields, under a trie of these lengths (e.g. 8,4), instead of one length for the batch")
@_output()
def solve_lookahead_cmd(acceptance_path: Path, profile_path: Path | None, decoding_lengths: str | None,
                        branch_lengths: str | None, top: int, engine: str, max_ngrams: str | None,
                        draft_lengths: str | None, trie_depths: str | None, bfs_breadths: str | None,
                        match_types: str | None, stop_tokens: str | None, batches: int | None,
                        min_speedup: float, schedule_contexts: str | None, stand_in: bool,
                        max_new_tokens: int | None, share_rows: str | None, output: Path) -> None:
    """Lookahead: decoding length L_d and branch length L_b by exact offline replay of the trie; or, with
    --engine, a serving engine's n-gram knobs by exact replay of its rule."""
    from specplan.planner.lookahead import BRANCH_LENGTHS, DECODING_LENGTHS, solve_lookahead
    from specplan.show import describe_schedule

    if engine != "specplan":
        if stand_in or schedule_contexts or share_rows:
            raise UserError("--contexts, --stand-in and --share-rows go with our Lookahead trie, not with --engine")
        if min_speedup != MIN_SPEEDUP and batches is None:
            raise UserError("--min-speedup goes with --batches")
        grid = _lookup_grid(engine, max_ngrams, draft_lengths, trie_depths, bfs_breadths, match_types)
        _solve_prompt_lookup(acceptance_path, profile_path, engine, grid, stop_tokens, top, output, batches,
                             min_speedup, max_new_tokens)
        return

    d_grid = tuple(_int_list(decoding_lengths) or DECODING_LENGTHS)
    b_grid = tuple(_int_list(branch_lengths) or BRANCH_LENGTHS)
    if min(d_grid) < 1 or min(b_grid) < 1:
        raise UserError("decoding lengths L_d and branch lengths L_b must be >= 1")
    shared = _int_list(share_rows) if share_rows else None
    if shared is not None and (len(shared) != 2 or not 1 <= shared[1] < shared[0]):
        raise UserError(f"--share-rows takes L_D,L_B with 1 <= L_B < L_D, got {share_rows!r}")
    plan, ranked = solve_lookahead(acceptance_path, profile_path, d_grid, b_grid, batches, stand_in,
                                   tuple(_int_list(schedule_contexts) or ()), max_new_tokens, min_speedup,
                                   tuple(shared) if shared else None)
    _echo_ranked(ranked[:top], [("L_d", lambda c: c.decoding_length), ("L_b", lambda c: c.branch_length)],
                 profile_path is not None)
    save_plan(plan, output)
    if plan.schedule is not None:
        click.echo(describe_schedule(plan.schedule, plan.method))
    click.echo(f"replayed {len(ranked)} settings in {plan.solver['seconds']:.1f} s; chose L_d = "
               f"{plan.settings.decoding_length}, L_b = {plan.settings.branch_length}; wrote {output}")
    _note_inexact_replay(plan)


def _echo_ranked(rows: list, knobs: list[tuple[str, Callable[[Any], Any]]], priced: bool) -> None:
    """A replay solver's ranked settings: its knobs (column title, value), tokens/step, and with a profile the step
    time and the predicted speedup."""
    widths = [max(5, len(title)) for title, _ in knobs]
    click.echo(" ".join(f"{title:>{width}}" for (title, _), width in zip(knobs, widths)) + f" {'tok/step':>9}"
               + (f" {'step ms':>8} {'speedup':>8}" if priced else ""))
    for c in rows:
        row = " ".join(f"{value(c):>{width}}" for (_, value), width in zip(knobs, widths))
        row += f" {c.tokens_per_step:>9.3f}"
        if c.speedup is not None:
            row += f" {c.step_seconds * 1e3:>8.2f} {c.speedup:>8.3f}"
        click.echo(row)


def _lookup_grid(engine: str, max_ngrams: str | None, draft_lengths: str | None, trie_depths: str | None,
                 bfs_breadths: str | None, match_types: str | None) -> list:
    from specplan.core.method_settings import SGLANG_MATCH_TYPES
    from specplan.planner.prompt_lookup import (
        BFS_BREADTHS,
        DRAFT_LENGTHS,
        MAX_NGRAMS,
        TRIE_DEPTHS,
        lookup_grid,
        ngram_tree_grid,
    )

    draft_grid = tuple(_int_list(draft_lengths) or DRAFT_LENGTHS)
    if engine == "sglang":
        depth_grid = tuple(_int_list(trie_depths) or TRIE_DEPTHS)
        breadth_grid = tuple(_int_list(bfs_breadths) or BFS_BREADTHS)
        if min(draft_grid) < 1 or min(depth_grid) < 2 or min(breadth_grid) < 1:
            raise UserError("draft lengths and BFS breadths must be >= 1, trie depths >= 2 (SGLang's own limits)")
        matches = tuple(match_types.split(",")) if match_types else SGLANG_MATCH_TYPES
        if unknown := [match for match in matches if match not in SGLANG_MATCH_TYPES]:
            raise UserError(f"unknown match type {unknown[0]!r} (SGLang's: {', '.join(SGLANG_MATCH_TYPES)})")
        return ngram_tree_grid(draft_grid, depth_grid, breadth_grid, matches)
    ngram_grid = tuple(_int_list(max_ngrams) or MAX_NGRAMS)
    if min(ngram_grid) < 1 or min(draft_grid) < 1:
        raise UserError("n-gram sizes and draft lengths must be >= 1")
    return lookup_grid(engine, ngram_grid, draft_grid)


def _solve_prompt_lookup(acceptance_path: Path, profile_path: Path | None, engine: str, grid: list,
                         stop_tokens: str | None, top: int, output: Path, batches: int | None,
                         min_speedup: float, output_tokens: int | None) -> None:
    from specplan.planner.prompt_lookup import LOOKUP_NAMES, solve_prompt_lookup
    from specplan.show import describe_schedule

    stops = tuple(_int_list(stop_tokens)) if stop_tokens else None
    plan, ranked = solve_prompt_lookup(acceptance_path, profile_path, engine, grid, stops, batches, min_speedup,
                                       output_tokens)
    knobs = [(key, lambda c, key=key: getattr(c.settings, key)) for key in ranked[0].settings.to_dict()
             if key != "enabled"]
    _echo_ranked(ranked[:top], knobs, profile_path is not None)
    save_plan(plan, output)
    if plan.schedule is not None:
        click.echo(describe_schedule(plan.schedule, plan.method))
    chosen = ", ".join(f"{key} {value}" for key, value in plan.settings.to_dict().items() if key != "enabled")
    click.echo(f"replayed {len(ranked)} settings of {engine}'s {LOOKUP_NAMES[engine]} in "
               f"{plan.solver['seconds']:.1f} s; chose {chosen}; wrote {output}")
    if not plan.settings.enabled:
        click.echo(f"note: no setting beats {engine}'s one-token decoding on this profile "
                   f"({plan.prediction.details['lookup_speedup']:.3f}x at best): the plan turns the lookup off",
                   err=True)


def _note_inexact_replay(plan: Plan) -> None:
    if plan.prediction.replay_exact is False:
        click.echo("note: the acceptance was measured decoding with other settings than these: decode with this "
                   f"plan (plan accept {plan.method} --decode-with) and solve again for an exact replay", err=True)


@solve.command("triforce")
@click.option("--acceptance", "acceptance_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--profile", "profile_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--context", type=int, help="plan for this context (default: the longest measured)")
@click.option("--two-level", is_flag=True, help="no bottom drafter: retrieval-cache self-speculation only")
@click.option("--rebuild-below", type=float, default=0.0, show_default=True,
              help="also rebuild when the rolling acceptance falls below this")
@_min_speedup_option("speculate (with --batches: at each batch size) only where predicted this much faster than "
                     "one-token decoding")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True)
@click.option("--batches", type=click.IntRange(min=1),
              help="also schedule the chain length gamma2 for every batch size up to this one (a profile with "
                   "--batches): the setting giving the most output tokens/s over the batch, or none")
@_output()
def solve_triforce_cmd(acceptance_path: Path, profile_path: Path, context: int | None, two_level: bool,
                       rebuild_below: float, min_speedup: float, top: int, batches: int | None, output: Path) -> None:
    """TriForce: gamma1, gamma2, budget, chunk and rebuild stride by an expected-time-per-token model."""
    from specplan.planner.triforce import solve_triforce
    from specplan.show import describe_schedule

    plan, ranked = solve_triforce(acceptance_path, profile_path, context, two_level=two_level,
                                  rebuild_below=rebuild_below, min_speedup=min_speedup, largest_batch=batches)
    click.echo(f"{'drafter':<9} {'g1':>3} {'g2':>3} {'B':>5} {'s':>3} {'R':>4} {'a_mid':>6} {'a_bot':>6} "
               f"{'tok/step':>8} {'ms/tok':>7} {'speedup':>7}")
    for c in ranked[:top]:
        if c.streaming:  # no middle level: a_mid is the streaming draft's acceptance by the target
            levels = (f"{'streaming':<9} {'-':>3} {c.gamma2:>3} {'-':>5} {'-':>3} {'-':>4} "
                      f"{c.middle_acceptance:>6.3f} {'-':>6}")
        else:
            levels = (f"{'two-level' if c.gamma1 == 0 else 'hierarchy':<9} {c.gamma1:>3} {c.gamma2:>3} {c.budget:>5} "
                      f"{c.chunk:>3} {c.stride:>4} {c.middle_acceptance:>6.3f} {c.bottom_acceptance:>6.3f}")
        click.echo(f"{levels} {c.tokens_per_step:>8.2f} {c.seconds_per_token * 1e3:>7.2f} {c.speedup:>7.3f}")
    save_plan(plan, output)
    if plan.schedule is not None:
        click.echo(describe_schedule(plan.schedule, plan.method))
    click.echo(f"wrote {output}")
    _note_inexact_replay(plan)
    if not plan.settings.speculate:
        best = plan.prediction.details["best_speculative"]["speedup"]
        click.echo(f"note: no setting is predicted faster than {min_speedup:g}x one-token decoding at context "
                   f"{plan.settings.context} (best {best:.2f}x): the plan decodes one token per step", err=True)


@cli.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="also draw a PNG")
@click.option("--compare", type=click.Path(dir_okay=False, path_type=Path),
              help="a second profile drawn beside the first (e.g. modeled against measured)")
def show(files: tuple[Path, ...], plot: Path | None, compare: Path | None) -> None:
    """Print a plan, profile or acceptance file readably, or one or more plan bench reports (.json: their
    tables; --plot draws every method's speedup and the plans' predicted against measured speedups)."""
    from specplan.show import show_files

    click.echo(show_files(list(files), plot, compare))
    if plot is not None:
        click.echo(f"wrote {plot}")


@cli.command()
@click.argument("plan_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(EXPORT_FORMATS), required=True,
              help="the engine: its rules are checked first (solve with --engine to fit them)")
@click.option("--draft-path", help="the draft model as the engine loads it (vllm, trtllm, llama.cpp, hf)")
@click.option("--heads", type=click.IntRange(min=1), help="medusa, eagle1: the draft heads of your model")
@click.option("--method", type=click.Choice(VLLM_METHODS), default="draft_model", show_default=True,
              help="vllm, sglang: what drafts the chain (draft_model: a separate draft model; eagle, eagle3: an EAGLE "
                   "head, whose schedule SGLang takes as adaptive-steps tiers)")
@click.option("--concurrency", type=click.IntRange(min=1),
              help="llama.cpp, and sglang with a separate draft, a plan with a schedule: the requests served at once "
                   "(one draft length for all: the schedule's there)")
@click.option("--context", type=click.IntRange(min=1), default=4096, show_default=True,
              help="llama.cpp with --concurrency: the most tokens a request may hold (its slots' size); a plan with a "
                   "schedule per context range: the range whose batch-size table is exported")
@_output(required=False, help="write here instead of stdout (required for sequoia's .pt)")
def export(plan_file: Path, fmt: str, draft_path: str | None, heads: int | None, method: str,
           concurrency: int | None, context: int, output: Path | None) -> None:
    """Export a Sequoia plan's tree as a serving engine takes it; how to run it goes to stderr."""
    from specplan.core.fileio import atomic_output
    from specplan.core.plan_schema import load_plan
    from specplan.planner.export import export_plan

    exported = export_plan(load_plan(plan_file), fmt, draft_path, heads, method, concurrency, context)
    if isinstance(exported.content, bytes):
        if output is None:
            raise UserError(f"--format {fmt} writes a binary file: give -o FILE")
        with atomic_output(output, "wb") as handle:
            handle.write(exported.content)
    elif output is None:
        click.echo(exported.content)
    else:
        with atomic_output(output) as handle:
            handle.write(exported.content.rstrip("\n") + "\n")
    click.echo(exported.instructions, err=True)


@cli.command()
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path),
              help="a plan file; without one, plain autoregressive decoding of --target")
@click.option("--prompt", help="the prompt text (see --chat)")
@click.option("--prompt-file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--requests", "requests_path", type=click.Path(dir_okay=False, path_type=Path),
              help='many requests, decoded together: one JSON object per line with a "prompt" and optional '
                   "max_new_tokens, temperature, top_p, top_k and seed (other fields are echoed back)")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="with --requests: the most requests in flight (continuous batching)")
@_prefill_chunk_option()
@_fixed_drafting_option()
@_no_sharing_option()
@click.option("--target", help="override the plan's target model")
@click.option("--draft", help="override the plan's draft model")
@click.option("--dtype", type=click.Choice(DTYPES), help="default: the plan's, else fp32")
@click.option("--draft-dtype", type=click.Choice(DTYPES), help="default: --dtype")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="(with --requests: for the requests that do not set theirs)")
@click.option("--temperature", type=float, help="default: the plan's (0 = greedy)")
@click.option("--top-p", type=float, help="default: the plan's, else 1")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off")
@click.option("--seed", type=int, default=0, show_default=True,
              help="(with --requests: request i draws from seed + i unless it sets its own)")
@click.option("--verify", type=click.Choice(VERIFICATION_RULES),
              help="verification rule (default: greedy at T = 0, else Sequoia's)")
@_chat_option()
@click.option("--device", type=click.Choice(DEVICES), help="default: cuda when available")
@click.option("--stream", is_flag=True, help="print tokens as they are accepted")
@click.option("--json", "as_json", is_flag=True,
              help="print one JSON object (with --requests: one per request in input order, then a summary)")
@_backend_option(None)
@_offload_options()
def generate(plan_path: Path | None, prompt: str | None, prompt_file: Path | None, requests_path: Path | None,
             concurrency: int, prefill_chunk: int, fixed_drafting: bool, no_sharing: bool, target: str | None,
             draft: str | None,
             dtype: str | None, draft_dtype: str | None, max_new_tokens: int, temperature: float | None,
             top_p: float | None, top_k: int, seed: int, verify: str | None, chat: bool, device: str | None,
             stream: bool, as_json: bool, backend: str | None, offload: str | None,
             resident_layers: int | None) -> None:
    """Generate with a plan (Sequoia, Lookahead, TriForce) or autoregressively: lossless either way."""
    import json

    from specplan.decoder.api import load_decoder
    from specplan.decoder.sampling import SamplingParams

    if sum(given is not None for given in (prompt, prompt_file, requests_path)) != 1:
        raise UserError("give exactly one of --prompt, --prompt-file and --requests")
    _check_offload(offload, resident_layers)
    _check_no_sharing(plan_path, no_sharing)
    if requests_path is not None:
        from specplan.core.request_file import load_requests

        if stream:
            raise UserError("--stream prints one request's tokens; with --requests, use --json or plan serve")
        entries = load_requests(requests_path)
        decoder = load_decoder(plan_path, target, draft, dtype, draft_dtype, verify, log=_progress, device=device,
                               backend=backend, offload=offload, resident_layers=resident_layers)
        _drafting_options(decoder, fixed_drafting, no_sharing)
        failed = _generate_requests(decoder, entries, concurrency, max_new_tokens, temperature, top_p, top_k, seed,
                                    chat, as_json, prefill_chunk)
        if failed:
            raise UserError(f"{failed} of {len(entries)} requests failed (said above); the others are printed")
        return
    if concurrency != 1 or prefill_chunk:
        raise UserError("--concurrency and --prefill-chunk go with --requests")
    if prompt_file is not None:
        try:
            prompt = prompt_file.read_text()
        except OSError as exc:
            raise UserError(f"{prompt_file}: cannot read: {exc.strerror}") from None
    decoder = load_decoder(plan_path, target, draft, dtype, draft_dtype, verify, log=_progress, device=device,
                           backend=backend, offload=offload, resident_layers=resident_layers)
    _drafting_options(decoder, fixed_drafting, no_sharing)
    defaults = decoder.default_params()
    params = SamplingParams(temperature=defaults.temperature if temperature is None else temperature,
                            top_p=defaults.top_p if top_p is None else top_p, top_k=top_k or defaults.top_k)
    printed = {"text": "", "tokens": []}

    def show(tokens: list[int]) -> None:
        printed["tokens"].extend(tokens)
        text = decoder.tokenizer.decode(printed["tokens"], skip_special_tokens=True)
        click.echo(text[len(printed["text"]):], nl=False)
        printed["text"] = text

    output = decoder.generate(prompt, max_new_tokens, params, seed, chat, show if stream and not as_json else None)
    result = output.result
    if as_json:
        click.echo(json.dumps(output.to_json()))
        return
    if stream:
        click.echo()
    else:
        click.echo(output.text)
    click.echo(f"[{len(result.tokens)} tokens, {result.steps} target steps, {result.tokens_per_step:.2f} tokens/step, "
               f"{result.tokens_per_second:.2f} tokens/s after a {result.prefill_seconds:.2f} s prefill; "
               f"stop: {result.stop_reason}; {output.backend} backend]", err=True)


@cli.command()
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path),
              help="a plan file; without one, plain autoregressive decoding of --target")
@click.option("--target", help="override the plan's target model")
@click.option("--draft", help="override the plan's draft model")
@click.option("--dtype", type=click.Choice(DTYPES), help="default: the plan's, else fp32")
@click.option("--draft-dtype", type=click.Choice(DTYPES), help="default: --dtype")
@click.option("--verify", type=click.Choice(VERIFICATION_RULES),
              help="verification rule (default: greedy at T = 0, else Sequoia's)")
@click.option("--device", type=click.Choice(DEVICES), help="default: cuda when available")
@_backend_option(None)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True,
              help="the most requests decoded together (continuous batching)")
@_prefill_chunk_option()
@_fixed_drafting_option()
@_no_sharing_option()
@click.option("--rule", type=click.Choice(DRAFT_RULES),
              help="decide each step's draft length by a serving engine's own rule (its defaults), on the drafter it "
                   "was made for: trtllm-auto on a Lookahead plan's n-grams, the others on a Sequoia chain plan's "
                   "draft model [the plan's schedule]")
@click.option("--setting", type=click.IntRange(min=2),
              help="draft this many nodes per sequence (root included) at every step, whatever the batch size: one "
                   "of the settings a Lookahead plan or a Sequoia chain's schedule chooses among [the plan's schedule]")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="requests waiting beyond --concurrency before new ones get HTTP 503")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="for requests that do not set max_tokens")
@click.option("--context", type=click.IntRange(min=1),
              help="the most tokens a request may hold, prompt and output (default: the model's context); the KV "
                   "caches of --concurrency such requests must fit in memory")
@click.option("--cache-ram", "prompt_cache_mib", type=click.IntRange(min=0), default=DEFAULT_PROMPT_CACHE_MIB,
              show_default=True, help="MiB of host memory for the prefixes slots would lose, which later requests "
                                      "sharing them start from (llama-server's --cache-ram; 0: none)")
@click.option("--step-log", type=click.Path(dir_okay=False, path_type=Path),
              help="write every decoding step here, one JSON line each: its batch size, how many sequences drafted, "
                   "its seconds, whether the clock timed it, the prices its requests decided at")
@_offload_options()
def serve(plan_path: Path | None, target: str | None, draft: str | None, dtype: str | None, draft_dtype: str | None,
          verify: str | None, device: str | None, backend: str | None, host: str, port: int, concurrency: int,
          prefill_chunk: int, fixed_drafting: bool, no_sharing: bool, rule: str | None, setting: int | None,
          max_queue: int,
          max_new_tokens: int,
          context: int | None, prompt_cache_mib: int, step_log: Path | None, offload: str | None,
          resident_layers: int | None) -> None:
    """An OpenAI-compatible endpoint (/v1/completions, /v1/chat/completions) over continuous batching."""
    from specplan.decoder.api import load_decoder
    from specplan.serve import ServeOptions, serve_forever

    _check_offload(offload, resident_layers)
    if rule is not None and setting is not None:
        raise UserError("--rule and --setting each decide the draft length: give one")
    _check_no_sharing(plan_path, no_sharing)
    decoder = load_decoder(plan_path, target, draft, dtype, draft_dtype, verify, log=_progress, device=device,
                           backend=backend, offload=offload, resident_layers=resident_layers)
    _drafting_options(decoder, fixed_drafting, no_sharing)
    if rule is not None:
        from specplan.planner.engines import DRAFT_RULE_SOURCES

        decoder.use_rule(rule)
        for source in DRAFT_RULE_SOURCES[rule]:
            _progress(f"drafting rule {rule}, as read in {source}")
    if setting is not None:
        decoder.fix_setting(setting)
    longest = decoder.target_forward.shape.max_context
    if context is not None and context > longest:
        raise UserError(f"--context {context} exceeds the model's context of {longest}")
    decoder.check_memory(concurrency, context or longest)
    name = target or (decoder.plan.models.target if decoder.plan else "model")
    serve_forever(decoder, name, ServeOptions(concurrency, max_queue, max_new_tokens, prefill_chunk, context,
                                              prompt_cache_mib, step_log), host, port, _progress)


def _check_no_sharing(plan_path: Path | None, no_sharing: bool) -> None:
    """Before any model loads: --no-sharing names a plan that shares rows."""
    if no_sharing:
        from specplan.core.plan_schema import load_plan

        if plan_path is None or load_plan(plan_path).sharing is None:
            raise UserError("--no-sharing: the plan shares no rows (solve it with --share-rows)")


def _drafting_options(decoder, fixed_drafting: bool, no_sharing: bool) -> None:
    if fixed_drafting:
        decoder.draft_every_step()
    if no_sharing:
        decoder.unshared()


def _generate_requests(decoder, entries: list, concurrency: int, max_new_tokens: int, temperature: float | None,
                       top_p: float | None, top_k: int, seed: int, chat: bool, as_json: bool,
                       prefill_chunk: int) -> int:
    """Decode a requests file's requests with continuous batching; print each (in input order) and a summary.
    Returns how many failed: each failure is one line on stderr naming its line number."""
    import json
    import time

    from specplan.core.request_file import BadLine
    from specplan.decoder.batching import Request
    from specplan.decoder.sampling import SamplingParams

    defaults = decoder.default_params()
    errors: dict[int, str] = {}
    requests, places = [], []  # the valid requests, and each one's index among the entries
    prompt_tokens: dict[int, int] = {}
    for index, entry in enumerate(entries):
        if isinstance(entry, BadLine):
            errors[index] = entry.error
            continue
        try:
            params = SamplingParams(
                temperature=next(v for v in (entry.temperature, temperature, defaults.temperature) if v is not None),
                top_p=next(v for v in (entry.top_p, top_p, defaults.top_p) if v is not None),
                top_k=next(v for v in (entry.top_k, top_k or None, defaults.top_k) if v is not None))
            ids = decoder.encode(entry.prompt, chat)
        except UserError as exc:
            errors[index] = str(exc)
            continue
        requests.append(Request(ids, entry.max_new_tokens or max_new_tokens, params,
                                entry.seed if entry.seed is not None else seed + index))
        places.append(index)
        prompt_tokens[index] = len(ids)
    start = time.perf_counter()
    completions = {}
    for completion in decoder.generate_many(requests, concurrency, prefill_chunk):
        index = places[completion.id]
        if completion.error is not None:
            errors[index] = completion.error
        else:
            completions[index] = completion
    wall = time.perf_counter() - start
    output_tokens = 0
    for index, entry in enumerate(entries):
        if index in errors:
            click.echo(f"error: line {entry.line}: {errors[index]}", err=True)
            continue
        completion = completions[index]
        output = decoder.output(completion.result, prompt_tokens[index])
        output_tokens += len(completion.result.tokens)
        if as_json:
            click.echo(json.dumps({**entry.extra, "line": entry.line, **output.to_json(),
                                   "time_to_first_token": completion.first_token_seconds}))
        else:
            click.echo(f"--- line {entry.line} ---\n{output.text}")
    summary = {"summary": True, "requests": len(entries), "failed": len(errors), "concurrency": concurrency,
               "output_tokens": output_tokens, "wall_seconds": wall,
               "output_tokens_per_second": output_tokens / wall if wall > 0 else 0.0,
               "backend": decoder.target_forward.backend}
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(f"[{len(entries) - len(errors)} of {len(entries)} requests, {output_tokens} tokens in {wall:.2f} s: "
                   f"{summary['output_tokens_per_second']:.2f} tokens/s at concurrency {concurrency}]", err=True)
    return len(errors)


@cli.command()
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path),
              help="the plan to run (`ours`); without one, `ours` is our one-token decoding of --target")
@click.option("--dataset", required=True, help=PROMPTS_HELP)
@click.option("--prompts", type=click.IntRange(min=1),
              default=8, show_default=True, help="prompts, spread across categories")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--baselines", help=f"comma-separated, of {', '.join(BASELINES)} (two-level, streaming: TriForce "
                                  "plans; llama.cpp: the llamacpp extra) [hf,hf-assisted,ours-ar]; with --concurrency, "
                                  f"of {', '.join(SERVING_BASELINES)} [ours-ar,llama-server], run in the order "
                                  "given, then --settings, --rules, and the --plan last unless named (ours)")
@click.option("--concurrency", "levels",
              help="the serving benchmark: closed-loop clients at each of these concurrencies (e.g. 1,2,4,8,16), "
                   "every system a server driven over HTTP; results appended to -o (JSON lines) as they finish, a "
                   "rerun skips those done")
@click.option("--rules", help="with --concurrency and a plan: also serve it under each of these engines' drafting "
                              f"rules (`plan serve --rule NAME`: systems rule-NAME), of {', '.join(DRAFT_RULES)}")
@click.option("--settings", help="with --concurrency and a plan with a schedule: also serve the plan at each of "
                                 "these drafting lengths fixed (`plan serve --setting N`: systems setting-N), "
                                 "comma-separated")
@click.option("--requests-per-client", type=click.IntRange(min=1), default=REQUESTS_PER_CLIENT, show_default=True,
              help="with --concurrency: each client's requests at a level (more: a steadier low concurrency)")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="with --concurrency: serve every system this many times a level, each round in an order of its "
                   "own (as many rounds as systems: each at every place once) and its requests in an order of "
                   "their own (the spread between rounds is the machine's noise and the arrivals')")
@click.option("--llama-server-drafts", "server_drafts",
              help="with --concurrency and a --draft (or a plan's): also llama-server drafting up to each of these "
                   "draft lengths (--spec-draft-n-max N, its other knobs at llama.cpp's defaults: systems "
                   "llama-server-draft-N), comma-separated")
@click.option("--llama-server-ngrams", "server_ngrams", metavar="N:M,...",
              help="with --concurrency: also llama-server with --spec-type ngram-simple looking up N tokens and "
                   "drafting up to M (systems llama-server-ngram-N-M), comma-separated")
@click.option("--target", help="override the plan's target model")
@click.option("--draft", help="override the plan's draft model")
@click.option("--dtype", type=click.Choice(DTYPES))
@click.option("--draft-dtype", type=click.Choice(DTYPES))
@click.option("--temperature", type=float, help="default: the plan's")
@click.option("--top-p", type=float)
@click.option("--verify", type=click.Choice(VERIFICATION_RULES))
@click.option("--seed", type=int, default=0, show_default=True)
@_chat_option()
@click.option("--context", type=int, help="long prompts of this many tokens built from --dataset (" + ESSAYS_HELP + ")")
@click.option("--one-document", is_flag=True,
              help="with --context: every prompt asks about the same document (its last line differs), as clients "
                   "asking questions of one long text do")
@click.option("--device", type=click.Choice(DEVICES), help="default: cuda when available")
@click.option("--step-logs", is_flag=True,
              help="with --concurrency: our servers log every step (`plan serve --step-log`) beside -o, a file per "
                   "system, level and round")
@click.option("--reprice", is_flag=True,
              help="re-time the forwards (and builds) the plan's prediction priced, between the prompts, and report "
                   "the prediction re-priced with them (TriForce, Sequoia and Lookahead plans)")
@_backend_option(None)
@_output(help="report.json (a .md table and a .png plot are written beside it)")
def bench(plan_path: Path | None, dataset: str, prompts: int, max_new_tokens: int, baselines: str | None,
          levels: str | None, rules: str | None, settings: str | None, requests_per_client: int, rounds: int,
          server_drafts: str | None, server_ngrams: str | None, target: str | None,
          draft: str | None, dtype: str | None, draft_dtype: str | None, temperature: float | None,
          top_p: float | None, verify: str | None, seed: int, chat: bool, context: int | None, one_document: bool,
          device: str | None, step_logs: bool, reprice: bool, backend: str | None, output: Path) -> None:
    """Our decoder against transformers and llama.cpp baselines on the same prompts, in one run."""
    from specplan.bench import LOOKUP_BASELINES, BenchRequest, markdown_table, run_bench
    from specplan.core.plan_schema import load_plan
    from specplan.decoder.api import load_decoder
    from specplan.decoder.sampling import SamplingParams

    if one_document and context is None:
        raise UserError("--one-document builds long prompts: it goes with --context")
    if levels is not None:
        _serving_bench(plan_path, dataset, prompts, max_new_tokens, baselines, _int_list(levels),
                       _int_list(settings) if settings else [], [r for r in (rules or "").split(",") if r],
                       _int_list(server_drafts) if server_drafts else [], _ngram_pairs(server_ngrams),
                       requests_per_client, rounds, target, draft,
                       dtype, chat, context, one_document, step_logs, output)
        return
    if settings or rules or server_drafts or server_ngrams or rounds != 1 or step_logs:
        raise UserError("--settings, --rules, --rounds, --llama-server-drafts, --llama-server-ngrams and --step-logs "
                        "go with --concurrency (the serving benchmark)")
    baselines = baselines if baselines is not None else "hf,hf-assisted,ours-ar"
    lookup_plan = load_plan(plan_path) if plan_path is not None else None
    if lookup_plan is not None and lookup_plan.method != "prompt-lookup":
        lookup_plan = None
    if lookup_plan is not None:  # an engine's prompt lookup: our one-token decoding of its target beside the engine
        if lookup_plan.engine not in LOOKUP_BASELINES:
            raise UserError(f"{plan_path} is {lookup_plan.engine}'s prompt lookup, which plan bench cannot run here: "
                            f"plan export --format {lookup_plan.engine} and run it in {lookup_plan.engine}")
        missing = [b for b in LOOKUP_BASELINES[lookup_plan.engine] if b not in baselines.split(",")]
        if missing:
            raise UserError(f"{plan_path} is {lookup_plan.engine}'s prompt lookup: add --baselines "
                            f"{','.join(missing)} (its one-token decoding and its lookup with the plan's knobs)")
        plan_path, target, dtype = None, target or lookup_plan.models.target, dtype or lookup_plan.models.dtype
    decoder = load_decoder(plan_path, target, draft, dtype, draft_dtype, verify, log=_progress, device=device,
                           backend=backend)
    defaults = decoder.default_params()
    params = SamplingParams(temperature=defaults.temperature if temperature is None else temperature,
                            top_p=defaults.top_p if top_p is None else top_p)
    request = BenchRequest(dataset, prompts, max_new_tokens, [b for b in baselines.split(",") if b], params, seed,
                           chat, context=context, one_document=one_document, reprice=reprice)
    if lookup_plan is not None:
        request.prompt_lookup, request.lookup_plan = lookup_plan.settings, lookup_plan
    report = run_bench(decoder, request, output, log=_progress)
    click.echo(markdown_table(report))
    click.echo(f"wrote {output} (+ .md, .png)")


def _ngram_pairs(text: str | None) -> list[tuple[int, int]]:
    """--llama-server-ngrams N:M,...: (size_n, size_m) pairs, each >= 1 (llama.cpp's own limits)."""
    pairs = []
    for item in (text or "").split(","):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) != 2 or not all(part.isdigit() and int(part) >= 1 for part in parts):
            raise UserError(f"--llama-server-ngrams takes N:M pairs of positive integers, got {item!r}")
        pairs.append((int(parts[0]), int(parts[1])))
    return pairs


def _serving_bench(plan_path: Path | None, dataset: str, prompts: int, max_new_tokens: int, baselines: str | None,
                   levels: list[int], settings: list[int], rules: list[str], server_drafts: list[int],
                   server_ngrams: list[tuple[int, int]], requests_per_client: int, rounds: int, target: str | None,
                   draft: str | None, dtype: str | None, chat: bool, context: int | None, one_document: bool,
                   step_logs: bool, output: Path) -> None:
    """plan bench --concurrency: our server and llama.cpp's, closed loop, at each concurrency (specplan/serving.py)."""
    import os

    import torch

    from specplan.core.machine import machine_label, this_machine
    from specplan.core.models import load_model
    from specplan.core.plan_schema import load_plan
    from specplan.profiler.haystack import served_prompts
    from specplan.serving import (
        System,
        llama_server_command,
        llama_server_flags,
        llama_server_gguf,
        llama_server_needs_draft,
        plan_serve_command,
        run_serving_bench,
        serving_prices,
        slot_context,
        transformers_static_batches,
        warmup_tokens,
    )

    if not levels or min(levels) < 1:
        raise UserError("--concurrency takes positive integers, e.g. 1,2,4,8,16")
    names = [b for b in (baselines or "ours-ar,llama-server").split(",") if b]
    unknown = [b for b in names if b not in SERVING_BASELINES]
    if unknown:
        raise UserError(f"unknown serving baseline {unknown[0]!r} (choose from {', '.join(SERVING_BASELINES)})")
    plan = load_plan(plan_path) if plan_path is not None else None
    if settings and (plan is None or plan.schedule is None):
        raise UserError("--settings measures a plan's schedule against its settings: give a --plan with a schedule")
    outside = [length for length in settings if not 2 <= length <= (plan.largest_setting or 0)]
    if outside:
        raise UserError(f"--settings {outside[0]}: this plan drafts 2 to {plan.largest_setting} nodes per sequence "
                        "(root included)")
    unknown_rules = [r for r in rules if r not in DRAFT_RULES]
    if unknown_rules or (rules and plan is None):
        raise UserError(f"unknown drafting rule {unknown_rules[0]!r} (choose from {', '.join(DRAFT_RULES)})"
                        if unknown_rules else "--rules runs a plan's drafter under each rule: give a --plan")
    names += [f"setting-{length}" for length in settings] + [f"rule-{name}" for name in rules]
    names += [f"llama-server-draft-{length}" for length in server_drafts]
    names += [f"llama-server-ngram-{n}-{m}" for n, m in server_ngrams]
    # a prompt-lookup plan holds an engine's n-gram knobs, which llama-server-export serves; ours serves the others
    names += ["ours"] if plan is not None and plan.method != "prompt-lookup" else []
    if server_drafts and min(server_drafts) < 1:
        raise UserError("--llama-server-drafts takes draft lengths >= 1")
    target = target or (plan.models.target if plan else None)
    if target is None:
        raise UserError("name a --target (or give a --plan)")
    dtype = dtype or (plan.models.dtype if plan else None) or "fp32"
    draft = draft or (plan.models.draft if plan else None)
    loaded = load_model(target, dtype, log=_progress)
    encoded = served_prompts(dataset, loaded.tokenizer, prompts, chat, context, one_document)
    warmup = warmup_tokens(plan)
    slot = slot_context(encoded, max_new_tokens, warmup)
    threads = os.cpu_count() or 1
    prices, basis = serving_prices(plan, settings, max_new_tokens, requests_per_client, _progress, encoded) \
        if plan else ({}, None)
    systems = []

    def ours(name: str, options: list[str]) -> System:
        return System(name, plan_serve_command(options, slot), logs_steps=step_logs)

    for name in dict.fromkeys(names):
        if name == "ours-ar":
            systems.append(ours(name, ["--target", target, "--dtype", dtype]))
        elif name in ("ours", "ours-fixed", "ours-unshared"):
            if plan_path is None:
                raise UserError(f"{name} serves a --plan")
            fixed = {"ours-fixed": ["--fixed-drafting"], "ours-unshared": ["--no-sharing"]}.get(name, [])
            systems.append(ours(name, ["--plan", str(plan_path), *fixed]))
        elif name.startswith("rule-"):
            systems.append(ours(name, ["--plan", str(plan_path), "--rule", name.removeprefix("rule-")]))
        elif name.startswith("setting-"):
            systems.append(ours(name, ["--plan", str(plan_path), "--setting", name.removeprefix("setting-")]))
        elif name == "hf-batch":
            if dtype == "gguf":
                raise UserError("hf-batch runs transformers on dequantized weights: give --dtype fp32 or bf16")
            stops = sorted(loaded.stop_token_ids)
            pad = loaded.tokenizer.pad_token_id
            torch.set_num_threads(threads)  # the servers' threads
            systems.append(System(name, in_process=transformers_static_batches(
                loaded.model, stops[0] if pad is None else pad, stops)))
        else:
            draft_gguf = None
            if llama_server_needs_draft(name, plan):
                if not draft:
                    raise UserError(f"{name} needs a --draft model (its GGUF)")
                draft_gguf = str(load_model(draft, "gguf", log=_progress).gguf_file())
            systems.append(System(name, llama_server_command(llama_server_gguf(loaded), threads,
                                                             llama_server_flags(name, draft_gguf, plan, slot), slot)))
    machine = machine_label({**this_machine("cpu"), "threads": threads})  # the servers' threads
    for system in systems:
        system.predict = prices.get(system.name)
        system.price_basis = basis if system.predict is not None else None
    run_serving_bench(systems, encoded, levels, max_new_tokens, requests_per_client, output, lambda text: len(
        loaded.tokenizer(text, add_special_tokens=False)["input_ids"]), machine, _progress, warmup, rounds)
    click.echo(f"wrote {output}")


MAX_ERROR_CHARS = 400  # an error is one readable line, whatever the user's file held
ERROR_PREFIX = "plan: error: "


def _one_line(message: str) -> str:
    text = " ".join(message.split()).encode("utf-8", "backslashreplace").decode("utf-8")
    room = MAX_ERROR_CHARS - len(ERROR_PREFIX)
    return text if len(text) <= room else text[: room - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    command_token = cli_command.set(shlex.join(["plan", *args]))  # every file written records it
    try:
        cli.main(args=args, prog_name="plan", standalone_mode=False)
    except UserError as exc:
        click.echo(ERROR_PREFIX + _one_line(str(exc)), err=True)
        return 2
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        click.echo(ERROR_PREFIX + _one_line(exc.format_message()), err=True)
        return 2
    except OSError as exc:  # a full disk, a file removed under us: after the work, still one line
        where = f"{exc.filename}: " if exc.filename else ""
        click.echo(ERROR_PREFIX + _one_line(f"{where}{exc.strerror or exc}"), err=True)
        return 2
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("plan: interrupted", err=True)
        return 130
    finally:
        cli_command.reset(command_token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
