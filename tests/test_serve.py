"""plan serve: the openai client against our endpoint, greedy output equal to plan generate's, a malformed request
refused alone, a client that leaves mid-stream freeing its sequence."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

import pytest

from specplan.decoder.api import load_decoder
from specplan.serve import ServeOptions, start_in_background

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server():
    decoder = load_decoder(None, target="tiny-random-llama", device="cpu")
    running = start_in_background(decoder, "tiny-random-llama", ServeOptions(concurrency=2, max_queue=4,
                                                                              max_new_tokens=16, context=3500))
    yield decoder, running
    running.close()


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_a_streamed_chat_completion_equals_plan_generate(server):
    decoder, running = server
    stream = client(running).chat.completions.create(
        model="tiny-random-llama", messages=[{"role": "user", "content": "tell me a story"}], max_tokens=12,
        temperature=0, stream=True)
    pieces, finish = [], None
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    expected = decoder.generate("tell me a story", 12, chat=True)
    assert "".join(pieces) == expected.text and finish == expected.result.stop_reason
    assert len([p for p in pieces if p]) > 1  # it streamed, token by token


def test_a_completion_streamed_and_whole_equals_plan_generate(server):
    decoder, running = server
    expected = decoder.generate("once upon a time", 10, chat=False)
    whole = client(running).completions.create(model="m", prompt="once upon a time", max_tokens=10, temperature=0)
    assert whole.choices[0].text == expected.text and whole.usage.completion_tokens == 10
    streamed = client(running).completions.create(model="m", prompt="once upon a time", max_tokens=10,
                                                  temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text


@pytest.mark.parametrize("body, reason", [
    ({"prompt": ""}, '"prompt" must be a non-empty string'),
    ({"prompt": "hi", "temperature": -1}, "temperature must be in"),
    ({"prompt": "hi", "max_tokens": 5000}, "exceeds the model's context of 4096"),
    ({"prompt": "hi", "max_tokens": 3600}, "exceeds the server's context of 3500 (--context)"),
    ({"prompt": "hi", "n": 3}, "n must be"),
    ({"prompt": "hi", "extra_body": {"ignore_eos": "yes"}}, "ignore_eos must be true or false"),
])
def test_a_malformed_request_gets_400_and_the_server_keeps_serving(server, body, reason):
    _, running = server
    with pytest.raises(openai.BadRequestError) as raised:
        client(running).completions.create(model="m", **body)
    assert reason in raised.value.body["message"]
    url = urlparse(running.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    connection.request("POST", "/v1/chat/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 400 and json.loads(response.read())["error"]["message"] == "the body is not JSON"
    assert client(running).completions.create(model="m", prompt="still there?", max_tokens=3).usage.completion_tokens


def test_a_request_that_ignores_eos_runs_to_its_max_tokens_past_a_stop_token(server, monkeypatch):
    """`ignore_eos` (vLLM's and llama-server's field; the serving bench's warm-up sends it): the reply goes on past a
    stop token, the same greedy text as a reply with no stop tokens; without it the reply ends there."""
    decoder, running = server
    free = decoder.generate("once upon a time", 10, chat=False)
    monkeypatch.setattr(decoder.engine, "stop_ids", {free.result.tokens[3]})
    stopped = client(running).completions.create(model="m", prompt="once upon a time", max_tokens=10, temperature=0)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 4
    ignoring = client(running).completions.create(model="m", prompt="once upon a time", max_tokens=10, temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert ignoring.choices[0].text == free.text and ignoring.usage.completion_tokens == 10
    assert ignoring.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_mid_reply_frees_its_sequence(server, stream):
    _, running = server
    url = urlparse(running.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = json.dumps({"prompt": "a long one", "max_tokens": 3000, "temperature": 0, "stream": stream})
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first event
    else:  # gone while its whole reply is still being decoded
        deadline = time.monotonic() + 30
        while not running.engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
    connection.close()
    scheduler = running.engine.scheduler
    deadline = time.monotonic() + 30
    while (scheduler.running or running.engine.tickets) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not scheduler.running and not running.engine.tickets
    assert client(running).completions.create(model="m", prompt="next", max_tokens=2).usage.completion_tokens == 2


def test_a_step_that_raises_fails_its_requests_and_the_server_keeps_serving(server, monkeypatch):
    decoder, running = server
    forward = decoder.engine.target.forward
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory\n(a second line)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(decoder.engine.target, "forward", fails_once)
    with pytest.raises(openai.BadRequestError) as raised:
        client(running).completions.create(model="m", prompt="first", max_tokens=4, temperature=0)
    assert raised.value.body["message"] == "the decoding step failed: out of memory (a second line)"
    assert not running.engine.scheduler.running
    assert client(running).completions.create(model="m", prompt="then", max_tokens=3).usage.completion_tokens == 3


@pytest.mark.slow  # a `plan serve` process per level
def test_the_serving_benchmark_writes_each_level_as_it_finishes_and_resumes(run_cli, tmp_path):
    """plan bench --concurrency: `plan serve` started as its own process per level, closed-loop clients over HTTP,
    each step in its step log (`--step-logs`); a rerun skips the levels already in the results file."""
    out = tmp_path / "serving.jsonl"
    args = ("bench", "--concurrency", "3", "--target", "tiny-random-llama", "--dataset", "specbench",
            "--baselines", "ours-ar,hf-batch", "--max-new-tokens", 8, "--prompts", 6, "--step-logs", "-o", out)
    code, _, err = run_cli(*args)
    assert code == 0, err
    steps = [json.loads(line) for line in (tmp_path / "serving.ours-ar.c3.r1.steps.log").read_text().splitlines()]
    assert len(steps) >= 8 and all(1 <= s["batch"] <= 3 and s["drafted"] == 0 and s["seconds"] > 0 for s in steps)
    started = [s["started"] for s in steps]
    assert sum(s["finished"] for s in steps) >= 6 and started == sorted(started) and {s["kind"] for s in steps} == {
        "plain"}
    levels = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["system"], r["concurrency"], r["requests"]) for r in levels] == [("ours-ar", 3, 6), ("hf-batch", 3, 6)]
    for level in levels:  # the same greedy tokens, counted the same way (no end-of-sequence token in 8)
        assert level["failed"] == 0 and level["output_tokens"] == 8 * 6 and level["tokens_per_second"] > 0
        assert level["ttft_p50"] > 0 and level["tpot_p95"] >= level["tpot_p50"]
    code, _, err = run_cli(*args)
    assert code == 0 and "done before, skipped" in err and len(out.read_text().splitlines()) == 2
    code, table, _ = run_cli("show", out, "--plot", tmp_path / "serving.png")
    assert code == 0 and "| ours-ar | 3 |" in table and "| 1.00 |" in table
    assert (tmp_path / "serving.png").stat().st_size > 0
    out.write_text(out.read_text() + '{"system": "x"}\n')
    code, _, err = run_cli("show", out)
    assert code == 2 and "line 3 is not a serving benchmark result" in err


def test_a_grids_plot_averages_repeated_runs_and_draws_the_best_fixed_setting():
    """plan show RUN1.jsonl RUN2.jsonl --plot: each system's mean over the runs at a concurrency with their range, and
    the best of the fixed settings (ours-ar being off) by mean at each concurrency."""
    from specplan.serving import LevelResult, level_lines

    def level(system: str, concurrency: int, rate: float) -> LevelResult:
        return LevelResult(system, concurrency, 4, 256, 256 / rate, rate, None, None, None, None, 0, "cpu")

    levels = [level("ours", 1, 30.0), level("ours-ar", 1, 24.0), level("setting-2", 1, 28.0),
              level("ours", 4, 40.0), level("ours-ar", 4, 44.0), level("setting-2", 4, 36.0),
              level("ours", 1, 26.0), level("ours-ar", 1, 22.0), level("setting-2", 1, 29.0)]
    lines = {line.label: line.points for line in level_lines(levels)}
    assert lines["ours"] == [(1, 28.0, 26.0, 30.0), (4, 40.0, 40.0, 40.0)]
    assert lines["best fixed setting (off included)"] == [(1, 28.5, 28.0, 29.0), (4, 44.0, 44.0, 44.0)]
    assert "best fixed setting (off included)" not in {line.label for line in level_lines(
        [r for r in levels if r.system != "setting-2"])}


def test_transformers_static_batches_send_each_batch_when_the_last_is_done():
    """hf-batch: C prompts per padded batch, the next batch sent only when every row of the last has stopped; each
    row's tokens counted up to its end-of-sequence token, its first token at the batch's first step."""
    from specplan.core.models import load_model
    from specplan.serving import transformers_static_batches

    loaded = load_model("tiny-random-llama")
    stops = sorted(loaded.stop_token_ids)
    run = transformers_static_batches(loaded.model, stops[0], stops)
    prompts = [[5, 6, 7], [8] * 9, [9, 10], [11] * 4, [12] * 6]
    timings = run(prompts, 2, 6)
    assert len(timings) == 5 and all(0 < t.tokens <= 6 and t.sent < t.first_token <= t.done for t in timings)
    batches = [timings[0:2], timings[2:4], timings[4:]]
    assert [len({t.sent for t in batch}) for batch in batches] == [1, 1, 1]
    for earlier, later in zip(batches, batches[1:]):
        assert later[0].sent >= max(t.done for t in earlier)
    assert batches[0][0].first_token == batches[0][1].first_token  # one step makes both rows' first tokens


def test_a_response_reports_its_target_forwards_and_the_bench_reads_them(server):
    """Each response ends with its `timings` (tokens, target forwards, those drafted), which the serving benchmark
    turns into tokens per step and the share of steps drafted, ours as reported, llama-server's from its draft
    counts."""
    import asyncio

    from specplan.serving import closed_loop, drafted_share, measured_tokens_per_step, reported_forwards

    decoder, running = server
    prompts = [decoder.tokenizer("once upon a time")["input_ids"], decoder.tokenizer("far away")["input_ids"]]
    timings, failed = asyncio.run(closed_loop(running.url, prompts, 2, 5, lambda text: 0))
    assert failed == 0 and all(t.steps == t.tokens == 5 for t in timings)  # one-token decoding: a token a forward
    assert all(0 <= t.cached < len(prompts[t.prompt]) for t in timings)  # the prompt tokens its slot's cache held
    assert sorted(t.prompt for t in timings) == [0, 1]  # which prompt each answers: the price takes its length
    assert measured_tokens_per_step(timings) == 1.0
    assert all(t.drafted_steps == 0 for t in timings) and drafted_share(timings) == 0.0
    assert reported_forwards({"predicted_n": 10, "draft_n": 6, "draft_n_accepted": 4}) == 6  # llama-server's
    assert reported_forwards({"predicted_n": 10}) == 10  # a request of llama-server's that drafted nothing
    assert reported_forwards({}) is None


def test_the_bench_sums_the_requests_decisions_and_keeps_them_with_the_level(tmp_path):
    """A response carries its request's steps by why it drafted or not (ours, where it decided); a level sums them
    over the requests that reported them and keeps them in its results file."""
    from dataclasses import asdict

    from specplan.decoder.engine import GenerationResult
    from specplan.serve import _timings
    from specplan.serving import LevelResult, RequestTiming, load_levels

    decided = GenerationResult([5, 6, 7], 0.1, 0.2, 2, decisions={"pays: drafts": 1, "sits out: plain": 1},
                               step_prices={2: (1.25, 1.5)})
    assert _timings(decided)["decisions"] == {"pays: drafts": 1, "sits out: plain": 1}
    assert _timings(decided)["step_prices"] == {"2": [1.25, 1.5]}  # as JSON carries it
    assert not {"decisions", "step_prices"} & set(_timings(GenerationResult([5], 0.1, 0.2, 1)))
    timings = [RequestTiming(0.0, 0.1, 1.0, 10, 8, 0, 5, {"pays: drafts": 5, "sits out: plain": 3},
                             step_prices={"2": [1.2, 1.4], "10": [1.5, 1.3]}),
               RequestTiming(0.0, 0.2, 1.5, 10, 9, 1, 6, {"pays: drafts": 6, "timing: plain": 3},
                             step_prices={"2": [1.4, 1.0]}),
               RequestTiming(0.0, 0.2, 1.5, 10, 10, 2)]  # a server that reports none
    level = LevelResult.summarize("ours", 2, timings, 0, "test")
    assert level.decisions == {"pays: drafts": 11, "sits out: plain": 3, "timing: plain": 3}
    assert level.step_prices == {"2": [pytest.approx(1.3), pytest.approx(1.2)], "10": [1.5, 1.3]}
    assert list(level.step_prices) == ["2", "10"]  # by batch size
    assert LevelResult.summarize("ours-ar", 2, timings[2:], 0, "test").step_prices is None
    path = tmp_path / "levels.jsonl"
    path.write_text(json.dumps(asdict(level)) + "\n" + json.dumps({**asdict(level), "decisions": None}) + "\n")
    assert [r.decisions for r in load_levels(path)] == [level.decisions, None]
    assert load_levels(path)[0].step_prices == level.step_prices
