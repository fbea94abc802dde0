"""`plan serve`: an OpenAI-compatible HTTP endpoint (/v1/completions, /v1/chat/completions, streaming or not) over
the continuous-batching scheduler (decoder/batching.py), on aiohttp.

The model runs in one engine loop, which owns the scheduler: the event loop hands it requests and cancellations
through a queue, and it hands back each step's tokens and each completion with call_soon_threadsafe. `plan serve`
runs the engine loop in the main thread and the event loop in a thread of its own: torch's kernels called from a
thread other than the main one ran a one-token step about 8% slower (docs/benchmark-log.md). A request
that cannot be decoded (malformed JSON, a bad field, a prompt over the context) gets HTTP 400 with a one-line
reason and fails alone; a full queue gets 503; a client that goes away has its sequence cancelled, which frees its
slot at the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from aiohttp import web

from specplan.core.choices import DEFAULT_PROMPT_CACHE_MIB
from specplan.core.errors import UserError
from specplan.decoder.api import Decoder
from specplan.decoder.batching import Completion, Request, StepRecord
from specplan.decoder.engine import GenerationResult
from specplan.decoder.sampling import SamplingParams

# How often a handler waiting on its request looks whether the client is still there (seconds).
DISCONNECT_POLL_SECONDS = 0.25
MAX_STEP_ERROR_CHARS = 200  # a failed step's reason, one line, in each of its requests' error
# A prompt's characters beyond any model's context (2M tokens is about 8M characters): refused before tokenizing.
MAX_PROMPT_CHARS = 8 << 20


@dataclass(frozen=True)
class ServeOptions:
    """How `plan serve` serves: sequences in flight, requests waiting beyond them, a request's default new tokens,
    prompt tokens a step carries for joining requests (0: prefill them before the next step), and the most tokens a
    request may hold, prompt and output (None: the model's context; llama-server's per-slot -c); where every step is
    logged (None: nowhere)."""

    concurrency: int = 4
    max_queue: int = 64
    max_new_tokens: int = 256
    prefill_chunk: int = 0
    context: int | None = None
    prompt_cache_mib: int = DEFAULT_PROMPT_CACHE_MIB
    step_log: Path | None = None


@dataclass
class Ticket:
    """One HTTP request's passage through the engine thread: its events arrive on `events` (the event loop's)."""

    request: Request
    events: asyncio.Queue
    stream: bool = False  # its tokens go to the client step by step (else only its completion: no event a step)
    scheduler_id: int | None = None  # set by the engine thread
    cancelled: bool = False
    loop: asyncio.AbstractEventLoop | None = None  # the event loop its events go to


class EngineLoop:
    """The scheduler's loop, in a thread of its own (`start`) or the caller's (`run`); `submit` and `cancel` are
    safe to call from any thread."""

    def __init__(self, decoder: Decoder, concurrency: int, max_queue: int, prefill_chunk: int = 0,
                 prompt_cache_mib: int = DEFAULT_PROMPT_CACHE_MIB, step_log: IO[str] | None = None) -> None:
        self.decoder = decoder
        self.scheduler = decoder.scheduler(concurrency, prefill_chunk, prompt_cache_mib)
        self.step_log = StepLogWriter(step_log) if step_log is not None else None
        self.scheduler.step_log = self.step_log
        self.capacity = concurrency + max_queue
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.in_flight = 0  # tickets submitted and not yet completed (event loop's count)
        self.tickets: dict[int, Ticket] = {}  # by scheduler id (engine thread's)
        self.stopping = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="specplan-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def submit(self, ticket: Ticket, loop: asyncio.AbstractEventLoop) -> None:
        if self.in_flight >= self.capacity:
            raise QueueFull(f"the queue is full ({self.capacity} requests in flight or waiting); retry later")
        self.in_flight += 1
        self.inbox.put(("submit", ticket, loop))
        self.wake.set()

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancelled = True
        self.inbox.put(("cancel", ticket, None))
        self.wake.set()

    def run(self) -> None:
        """Step the scheduler until `stop`."""
        try:
            self._run()
        finally:
            if self.step_log is not None:
                self.step_log.handle.close()

    def _run(self) -> None:
        while not self.stopping:
            self._drain_inbox()
            if self.scheduler.idle:
                self.wake.wait(timeout=1.0)
                self.wake.clear()
                continue
            try:
                completions = self.scheduler.step()
            except Exception as exc:  # noqa: BLE001 - a step that raises fails its requests, not the server
                reason = " ".join(str(exc).split())[:MAX_STEP_ERROR_CHARS] or type(exc).__name__
                completions = self.scheduler.abort(f"the decoding step failed: {reason}")
            for completion in completions:
                ticket = self.tickets.pop(completion.id)
                ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, ("done", completion))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, ticket, loop = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                ticket.loop = loop
                request = ticket.request
                request.on_tokens = _forwarder(ticket, loop) if ticket.stream else None
                ticket.scheduler_id = self.scheduler.submit(request)
                self.tickets[ticket.scheduler_id] = ticket
                if ticket.cancelled:
                    self.scheduler.cancel(ticket.scheduler_id)
            elif ticket.scheduler_id is not None:
                self.scheduler.cancel(ticket.scheduler_id)


def _forwarder(ticket: Ticket, loop: asyncio.AbstractEventLoop) -> Callable[[list[int]], None]:
    def forward(tokens: list[int]) -> None:
        loop.call_soon_threadsafe(ticket.events.put_nowait, ("tokens", list(tokens)))
    return forward


def _timings(result: GenerationResult) -> dict[str, Any]:
    """Beside the usage, as llama-server gives its `timings`: the tokens, the target forwards they took, those of
    the forwards in which the request drafted (scored draft tokens beside its root), the prompt tokens its slot's
    cache held (llama-server's cache_n), and, where the request decided step by step whether to draft, its steps by
    why and the prices it decided at, per batch size (decoder/gate.py)."""
    return {"predicted_n": len(result.tokens), "steps": result.steps, "drafted_steps": result.drafted_steps,
            "cache_n": result.cached_prompt_tokens, **({"decisions": result.decisions} if result.decisions else {}),
            **({"step_prices": {str(batch): list(price) for batch, price in result.step_prices.items()}}
               if result.step_prices else {})}


class StepLogWriter:
    """Scheduler steps as JSON lines (StepRecord's fields; `started` in seconds since the log began)."""

    def __init__(self, handle: IO[str]) -> None:
        self.handle = handle
        self.began = time.perf_counter()

    def __call__(self, record: StepRecord) -> None:
        line = {key: round(value, 6) if isinstance(value, float) else value for key, value in asdict(record).items()}
        line["started"] = round(record.started - self.began, 6)
        self.handle.write(json.dumps(line) + "\n")


class QueueFull(Exception):
    pass


@dataclass
class Parsed:
    """An HTTP request body read as a generation request."""

    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int | None
    stream: bool
    chat: bool
    usage: bool = False  # a streamed response ends with a chunk of token counts (stream_options.include_usage)
    ignore_eos: bool = False


def _number(body: dict[str, Any], name: str, kind: type, low: float, high: float) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            kind is int and not float(value).is_integer()):
        raise UserError(f"{name} must be {'an integer' if kind is int else 'a number'}")
    if not low <= value <= high:
        raise UserError(f"{name} must be in [{low:g}, {high:g}]")
    return kind(value)


class Server:
    def __init__(self, decoder: Decoder, engine: EngineLoop, model_name: str, options: ServeOptions) -> None:
        self.decoder, self.engine, self.model_name = decoder, engine, model_name
        self.max_new_tokens = options.max_new_tokens
        self.context = options.context
        self.ids = itertools.count()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_PROMPT_CHARS * 2)
        app.add_routes([web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                        web.get("/v1/models", self.models), web.get("/health", self.health)])
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "in_flight": self.engine.in_flight})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "owned_by": "specplan"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _parse(self, body: Any, chat: bool) -> Parsed:
        if not isinstance(body, dict):
            raise UserError("the body must be a JSON object")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise UserError('"messages" must be a non-empty list of {"role", "content"} strings')
            if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
                raise UserError("the messages are too long")
            prompt = self._encode_chat(messages)
        else:
            text = body.get("prompt")
            if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
                text = text[0]
            vocab = self.decoder.target_forward.shape.vocab
            if isinstance(text, list) and text and all(type(t) is int and 0 <= t < vocab for t in text):
                prompt = list(text)  # token ids, as OpenAI's API allows
            elif not isinstance(text, str) or not text:
                raise UserError(f'"prompt" must be a non-empty string or a list of token ids below {vocab}')
            elif len(text) > MAX_PROMPT_CHARS:
                raise UserError("the prompt is too long")
            else:
                prompt = self.decoder.encode(text, chat=False)
        if _number(body, "n", int, 1, 1) not in (None, 1):
            raise UserError("n must be 1")
        defaults = self.decoder.default_params()
        temperature = _number(body, "temperature", float, 0.0, 100.0)
        top_p = _number(body, "top_p", float, 1e-9, 1.0)
        top_k = _number(body, "top_k", int, 0, 2**31)
        params = SamplingParams(temperature=defaults.temperature if temperature is None else temperature,
                                top_p=defaults.top_p if top_p is None else top_p,
                                top_k=defaults.top_k if top_k is None else top_k)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = _number({"max_tokens": limit}, "max_tokens", int, 1, 2**31) or self.max_new_tokens
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise UserError("stream must be true or false")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise UserError("stream_options must be an object")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise UserError("ignore_eos must be true or false")
        return Parsed(prompt, max_new, params, _number(body, "seed", int, 0, 2**63 - 1), stream, chat,
                      usage=options.get("include_usage") is True, ignore_eos=ignore_eos)

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        tokenizer = self.decoder.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("the model has no chat template: use /v1/completions")
        try:
            ids = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # a template's own refusal (roles out of order, an unknown role)
            raise UserError(f"the chat template refused the messages: {str(exc).splitlines()[0][:200]}") from None
        return list(ids)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = json.loads(await request.text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not JSON")
        try:
            parsed = self._parse(body, chat)
            self.decoder.engine.check_fits(len(parsed.prompt), parsed.max_new_tokens)
            if self.context is not None and len(parsed.prompt) + parsed.max_new_tokens > self.context:
                raise UserError(f"the prompt ({len(parsed.prompt)} tokens) plus {parsed.max_new_tokens} new tokens "
                                f"exceeds the server's context of {self.context} (--context)")
        except UserError as exc:
            return _error(400, str(exc))
        loop = asyncio.get_running_loop()
        generation = Request(parsed.prompt, parsed.max_new_tokens, parsed.params, parsed.seed,
                             ignore_eos=parsed.ignore_eos)
        ticket = Ticket(generation, asyncio.Queue(), stream=parsed.stream)
        try:
            self.engine.submit(ticket, loop)
        except QueueFull as exc:
            return _error(503, str(exc))
        watch = asyncio.create_task(self._watch(request, ticket))
        try:
            if parsed.stream:
                return await self._stream(request, ticket, parsed)
            return await self._whole(request, ticket, parsed)
        finally:
            watch.cancel()
            self.engine.in_flight -= 1

    async def _next_event(self, ticket: Ticket) -> tuple[str, Any] | None:
        """The ticket's next event, or None once its client has gone (`_watch`)."""
        event = await ticket.events.get()
        return None if event[0] == "gone" else event

    async def _watch(self, request: web.Request, ticket: Ticket) -> None:
        """Every DISCONNECT_POLL_SECONDS, whether the client is still there; once it has gone, its sequence is
        cancelled and its handler woken. One task a request: a timed wait for each event cost the HTTP thread, which
        shares the cores with the forward, a task and a timer a step."""
        while True:
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
            if request.transport is None or request.transport.is_closing():
                self.engine.cancel(ticket)
                ticket.events.put_nowait(("gone", None))
                return

    async def _whole(self, request: web.Request, ticket: Ticket, parsed: Parsed) -> web.StreamResponse:
        while True:
            event = await self._next_event(ticket)
            if event is None:
                return web.Response(status=499)
            if event[0] == "done":
                break
        completion: Completion = event[1]
        if completion.error is not None:
            return _error(400, completion.error)
        result = completion.result
        text = self.decoder.tokenizer.decode(result.tokens, skip_special_tokens=True)
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.stop_reason, "logprobs": None}
        if parsed.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({
            "id": self._id(parsed), "object": "chat.completion" if parsed.chat else "text_completion",
            "created": int(time.time()), "model": self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(parsed.prompt), "completion_tokens": len(result.tokens),
                      "total_tokens": len(parsed.prompt) + len(result.tokens)}, "timings": _timings(result)})

    async def _stream(self, request: web.Request, ticket: Ticket, parsed: Parsed) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk_id, created = self._id(parsed), int(time.time())
        kind = "chat.completion.chunk" if parsed.chat else "text_completion"
        tokens: list[int] = []
        sent = ""

        def chunk(text: str | None, finish: str | None, first: bool = False) -> bytes:
            if parsed.chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            data = {"id": chunk_id, "object": kind, "created": created, "model": self.model_name, "choices": [choice]}
            return f"data: {json.dumps(data)}\n\n".encode()

        try:
            if parsed.chat:
                await response.write(chunk(None, None, first=True))
            while True:
                event = await self._next_event(ticket)
                if event is None:
                    return response
                if event[0] == "tokens":
                    tokens.extend(event[1])
                    text = self.decoder.tokenizer.decode(tokens, skip_special_tokens=True)
                    if not text.endswith("\ufffd") and len(text) > len(sent):  # no half of a UTF-8 character
                        await response.write(chunk(text[len(sent):], None))
                        sent = text
                    continue
                completion: Completion = event[1]
                if completion.error is not None:
                    await response.write(f"data: {json.dumps({'error': {'message': completion.error}})}\n\n".encode())
                    return response
                text = self.decoder.tokenizer.decode(tokens, skip_special_tokens=True)
                await response.write(chunk(text[len(sent):], completion.result.stop_reason))
                if parsed.usage:
                    usage = {"prompt_tokens": len(parsed.prompt), "completion_tokens": len(tokens),
                             "total_tokens": len(parsed.prompt) + len(tokens)}
                    data = {"id": chunk_id, "object": kind, "created": created, "model": self.model_name,
                            "choices": [], "usage": usage, "timings": _timings(completion.result)}
                    await response.write(f"data: {json.dumps(data)}\n\n".encode())
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
        except ConnectionResetError:  # the client went away mid-stream
            self.engine.cancel(ticket)
            return response
        except asyncio.CancelledError:
            self.engine.cancel(ticket)
            raise

    def _id(self, parsed: Parsed) -> str:
        return f"{'chatcmpl' if parsed.chat else 'cmpl'}-{next(self.ids)}"


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


@dataclass
class RunningServer:
    """A server started in a background thread (tests, benchmarks): its URL, and `close` to stop it."""

    url: str
    engine: EngineLoop
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner
    thread: threading.Thread

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.engine.stop()


def build(decoder: Decoder, model_name: str, options: ServeOptions) -> tuple[web.Application, EngineLoop]:
    if options.max_queue < 0:
        raise UserError(f"the queue limit must be >= 0, got {options.max_queue}")
    step_log = None
    if options.step_log is not None:
        try:
            step_log = open(options.step_log, "w", buffering=1)  # line-buffered: a stopped server leaves whole lines
        except OSError as exc:
            raise UserError(f"cannot write the step log {options.step_log} ({exc.strerror or exc})") from None
    engine = EngineLoop(decoder, options.concurrency, options.max_queue, options.prefill_chunk,
                        options.prompt_cache_mib, step_log)
    return Server(decoder, engine, model_name, options).app(), engine


def start_in_background(decoder: Decoder, model_name: str, options: ServeOptions = ServeOptions(),
                        host: str = "127.0.0.1", port: int = 0, engine_thread: bool = True) -> RunningServer:
    """The HTTP server's event loop in a background thread, and the engine's loop in another (unless not
    `engine_thread`: then the caller runs `engine.run()`)."""
    app, engine = build(decoder, model_name, options)
    if engine_thread:
        engine.start()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, host, port)
    loop.run_until_complete(site.start())
    bound_host, bound_port = runner.addresses[0][:2]
    thread = threading.Thread(target=loop.run_forever, name="specplan-http", daemon=True)
    thread.start()
    return RunningServer(f"http://{bound_host}:{bound_port}", engine, loop, runner, thread)


def serve_forever(decoder: Decoder, model_name: str, options: ServeOptions, host: str, port: int,
                  say: Callable[[str], None]) -> None:
    """Serve until SIGINT or SIGTERM: the event loop in a background thread, the engine in this (the main) one."""
    try:
        server = start_in_background(decoder, model_name, options, host, port, engine_thread=False)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    say(f"======== Running on {server.url} ========")
    signal.signal(signal.SIGTERM, lambda *_: server.engine.stop())
    try:
        server.engine.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
