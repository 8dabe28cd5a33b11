"""The command line: what each command prints, and how it ends on what it cannot take."""

from __future__ import annotations

import pytest

from engine import cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "hi", "--max-tokens", "0"], "max_tokens=0 is not allowed"),
        (["generate", "hi", "--temperature", "-1"], "temperature=-1.0 is not allowed"),
        (["bench", "--random-weights", "nope"], "random_weights='nope'; choose one of"),
        (["generate", "hi", "--model", "/nonexistent.gguf"], "/nonexistent.gguf does not exist"),
        (
            ["generate", "hi", "--random-weights", "tiny", "--kv-cache-bytes", "10"],
            "the KV budget of 10 bytes holds 0 tokens",
        ),
        (
            ["generate", "hi", "--random-weights", "tiny", "--tensor-parallel-size", "3"],
            "does not split over tensor_parallel_size=3",
        ),
    ],
)
def test_the_cli_refuses_what_it_cannot_take_in_one_line(argv, message, capsys) -> None:
    """An option, a model or a request the engine refuses ends the command with its message
    and status 2 (it printed a traceback with the message last); a request's fields are
    refused before the model loads."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"engine {argv[0]}: error: ") and message in err, err
    assert "Traceback" not in err


def test_the_cli_refuses_a_requests_fields_before_loading_the_model(monkeypatch) -> None:
    from engine.shell import engine

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded for a request the CLI refuses")

    monkeypatch.setattr(engine, "Engine", no_model)
    assert cli.main(["generate", "hi", "--top-p", "0"]) == 2


def test_engine_bench_runs_on_random_weights(capsys) -> None:
    """Random weights come without a tokenizer: the benchmark's prompts are token ids then
    (its chat prompts were refused, so `engine bench --random-weights` never ran)."""
    assert (
        cli.main(
            [
                "bench",
                "--random-weights",
                "tiny",
                "--num-prompts",
                "3",
                "--max-tokens",
                "4",
                "--quiet",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("3 prompts, 12 tokens in ")


def test_engine_generate_takes_and_prints_token_ids_on_random_weights(capsys) -> None:
    """Without a tokenizer the prompt is token ids separated by spaces, and the output is
    token ids (the prompt was refused: "give the prompt as a list of token ids", which the
    command line could not)."""
    argv = ["generate", "1 2 3", "--random-weights", "tiny", "--max-tokens", "5"]
    argv += ["--temperature", "0"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) == 5 and all(t.isdigit() for t in captured.out.split())
    assert "[5 tokens in " in captured.err
    assert cli.main(["generate", "hi", "--random-weights", "tiny"]) == 2
    assert "'hi' is not token ids" in capsys.readouterr().err
