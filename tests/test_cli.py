"""The CLI's vocabulary and manners: one name per concept across commands (old names kept a release, hidden, with a
note), progress on stderr whatever it is attached to and silenced by --quiet, an output path checked before any work,
and a failure that stays one line whatever happened before it."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml

from specplan.cli import cli

from toy import one_error

PROMPTS = [{"question_id": i, "category": "c", "turns": [f"count {i} 1 2 3"]} for i in range(3)]


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(prompt) for prompt in PROMPTS))
    return path


def test_every_command_names_models_prompts_chat_and_temperature_alike():
    """--target wherever a model is named, --prompts for a count of prompts, one --chat/--no-chat (default on) and one
    --temperature (default 0) wherever they apply, and --quiet everywhere."""
    commands = {("profile",): cli.commands["profile"]}
    for group in ("accept", "solve"):
        commands.update({(group, name): command for name, command in cli.commands[group].commands.items()})
    commands.update({(name,): cli.commands[name] for name in ("show", "export", "generate", "bench")})
    for name, command in commands.items():
        options = {opt: param for param in command.params for opt in param.opts if not getattr(param, "hidden", False)}
        assert "--quiet" in options, name
        assert "--model" not in options and "--samples" not in options and "--batch" not in options, name
        if "--chat" in options:
            assert options["--chat"].default is True, name
        if "--temperature" in options and name != ("generate",) and name != ("bench",):  # those: the plan's, else 0
            assert options["--temperature"].default == 0.0, name
    assert "--target" in {opt for p in cli.commands["profile"].params for opt in p.opts}
    for name in ("sequoia", "lookahead", "triforce"):
        assert "--prompts" in {opt for p in cli.commands["accept"].commands[name].params for opt in p.opts}


def test_old_flag_names_still_work_for_a_release_and_say_the_new_one(run_cli, dataset, tmp_path):
    out = tmp_path / "a.yaml"
    code, _, stderr = run_cli("accept", "lookahead", "--target", "tiny-random-llama", "--dataset", dataset,
                              "--samples", 2, "--max-new-tokens", 4, "-o", out)
    assert code == 0, stderr
    assert "--samples is deprecated; use --prompts" in stderr
    assert len(yaml.safe_load(out.read_text())["records"]) == 2
    code, _, stderr = run_cli("profile", "--model", "tiny-random-llama", "--sizes", "1,2", "--contexts", "16",
                              "--repeats", 1, "-o", tmp_path / "p.yaml")
    assert code == 0 and "--model is deprecated; use --target" in stderr, stderr


def test_every_file_the_cli_writes_records_the_command_that_wrote_it(run_cli, dataset, tmp_path):
    """Profiles and acceptance files as plans: making one again (on another host, after a change) is one copy away;
    a library call writes none."""
    from specplan.core.provenance import provenance

    profile, acceptance = tmp_path / "p.yaml", tmp_path / "a.yaml"
    profiling = ["profile", "--target", "tiny-random-llama", "--sizes", "1,2", "--contexts", "16", "--repeats", "1",
                 "-o", str(profile)]
    accepting = ["accept", "lookahead", "--target", "tiny-random-llama", "--dataset", str(dataset),
                 "--max-new-tokens", "4", "-o", str(acceptance)]
    for args, path in ((profiling, profile), (accepting, acceptance)):
        code, _, stderr = run_cli(*args)
        assert code == 0, stderr
        assert yaml.safe_load(path.read_text())["provenance"]["command"] == shlex.join(["plan", *args])
        code, stdout, stderr = run_cli("show", path)
        assert code == 0 and stdout.rstrip().endswith(f"written by: {shlex.join(['plan', *args])}"), stderr
    assert "command" not in provenance()


def test_progress_goes_to_stderr_when_it_is_not_a_terminal_and_quiet_silences_it(run_cli, dataset, tmp_path):
    """Under capture (as under nohup) stderr is no terminal: progress still prints, a line per prompt."""
    out = tmp_path / "a.yaml"
    code, stdout, stderr = run_cli("accept", "lookahead", "--target", "tiny-random-llama", "--dataset", dataset,
                                   "--max-new-tokens", 4, "-o", out)
    assert code == 0
    assert stderr.count("[") >= len(PROMPTS) and "prompt tokens" in stderr  # one line per prompt
    assert "wrote" in stdout
    code, stdout, stderr = run_cli("accept", "lookahead", "--target", "tiny-random-llama", "--dataset", dataset,
                                   "--max-new-tokens", 4, "--quiet", "-o", out)
    assert code == 0 and stderr == "" and "wrote" in stdout


def test_an_output_that_cannot_be_written_is_refused_before_any_work(run_cli, tmp_path, monkeypatch):
    from specplan.profiler import latency

    monkeypatch.setattr(latency, "run_profile", lambda *a, **k: pytest.fail("profiled before checking the output"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for output in (blocker / "p.yaml", tmp_path):  # under a file; a directory
        code, _, stderr = run_cli("profile", "--target", "tiny-random-llama", "-o", output)
        assert code == 2 and one_error(stderr) and str(output) in stderr, stderr


def test_an_os_error_while_writing_is_one_line(run_cli, tmp_path, monkeypatch):
    from specplan.core import fileio

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "plan.yaml"))

    monkeypatch.setattr(fileio, "write_yaml", full_disk)
    monkeypatch.setattr("specplan.core.plan_schema.write_yaml", full_disk)
    acceptance = tmp_path / "acc.yaml"
    acceptance.write_text(yaml.safe_dump({"kind": "acceptance/sequoia", "positional": [0.6, 0.2]}))
    code, _, stderr = run_cli("solve", "sequoia", "--acceptance", acceptance, "--max-size", 4, "--max-depth", 2,
                              "-o", tmp_path / "plan.yaml")
    assert code == 2 and one_error(stderr) and "No space left on device" in stderr, stderr


def test_a_model_without_a_chat_template_takes_prompts_as_given_and_says_so_once(run_cli, tmp_path):
    """The chat template is on by default; a base model has none: the prompt is encoded as given."""
    from specplan.core.models import load_model
    from specplan.core.prompts import encode_prompt

    loaded = load_model("tiny-random-llama")
    loaded.tokenizer.chat_template = None
    directory = tmp_path / "base"
    loaded.model.save_pretrained(directory)
    loaded.tokenizer.save_pretrained(directory)
    code, stdout, stderr = run_cli("generate", "--target", directory, "--prompt", "one two", "--max-new-tokens", 6,
                                   "--json")
    assert code == 0, stderr
    assert stderr.count("no chat template") == 1
    expected = json.loads(run_cli("generate", "--target", "tiny-random-llama", "--prompt", "one two", "--no-chat",
                                  "--max-new-tokens", 6, "--json")[1])["tokens"]
    assert json.loads(stdout)["tokens"] == expected
    assert encode_prompt(loaded.tokenizer, "one two", chat=True) == encode_prompt(loaded.tokenizer, "one two", False)
