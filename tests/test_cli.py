"""``flexpage generate``: prompts in, completions and a one-line summary out; bad options
end with a non-zero exit code and a one-line message naming the problem (no traceback).

Runs in-process through typer's ``CliRunner``, with eager attention (``--eager``) and a
small pool (``--num-blocks``) so that no test waits for a compile or a 1 GiB pool.
"""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from flexpage.cli import app

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SUMMARY = re.compile(
    r"(?P<prompts>\d+) prompts, (?P<tokens>\d+) tokens in [\d.]+ s = [\d.]+ tokens/s \| KV utilisation [\d.]+% \| "
    r"prefix-cache hits \d+ tokens \(\d+%\) \| preemptions (?P<preemptions>\d+)"
)


def invoke(*args: str):
    # wide terminal: the summary line must not be wrapped
    return CliRunner().invoke(app, ["generate", *args], env={"COLUMNS": "300", "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def tiny(tiny_model) -> str:
    return str(tiny_model("llama"))


@pytest.mark.slow
def test_generate_with_the_default_model_prints_the_summary():
    result = invoke("The capital of France is", "--max-tokens", "4", "--dtype", "float32", "--eager",
                    "--num-blocks", "16")
    assert result.exit_code == 0, result.output
    match = SUMMARY.search(result.output)
    assert match, result.output
    assert (match["prompts"], match["tokens"], match["preemptions"]) == ("1", "4", "0")
    assert "The capital of France is" in result.output


def test_generate_several_prompts_and_samples(tiny):
    result = invoke("Hello there", "Once upon a time", "--model", tiny, "--max-tokens", "3", "--dtype", "float32",
                    "--eager", "--num-blocks", "32", "--n", "2", "--temperature", "0.8", "--seed", "1")
    assert result.exit_code == 0, result.output
    match = SUMMARY.search(result.output)
    assert match, result.output
    assert (match["prompts"], match["tokens"]) == ("2", str(2 * 2 * 3))
    for prompt in ("Hello there", "Once upon a time"):
        assert f"{prompt} (sample 0)" in result.output and f"{prompt} (sample 1)" in result.output


def test_generate_chat(tiny):
    result = invoke("Hi!", "--chat", "--model", tiny, "--max-tokens", "2", "--dtype", "float32", "--eager",
                    "--num-blocks", "32")
    assert result.exit_code == 0, result.output
    assert SUMMARY.search(result.output), result.output


def test_no_prompt_is_a_usage_error():
    result = invoke("--max-tokens", "4")
    assert result.exit_code == 2
    assert "Missing argument" in result.output


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--max-tokens", "0"], "max_tokens must be >= 1"),
        (["--max-tokens", "many"], "Invalid value for '--max-tokens'"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--n", "0"], "n must be >= 1"),
    ],
    ids=["max-tokens-zero", "max-tokens-not-int", "negative-temperature", "top-p-above-one", "n-zero"],
)
def test_bad_sampling_options_exit_with_a_message(option, message, tiny):
    result = invoke("Hello", "--model", tiny, "--eager", "--num-blocks", "32", *option)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_bad_prompt_exits_with_a_message(tiny):
    result = invoke("", "--model", tiny, "--dtype", "float32", "--eager", "--num-blocks", "32")
    assert result.exit_code == 2, result.output
    assert "empty" in result.output


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--dtype", "float8"], "dtype"),
        (["--block-size", "0"], "block_size"),
        (["--num-blocks", "1"], "num_blocks"),
        (["--kv-cache-memory", "lots"], "kv_cache_memory"),
        (["--model", "/no/such/model/folder"], "does not exist"),
        (["--model-impl", "vllm"], "model_impl"),
    ],
    ids=["unknown-dtype", "block-size-zero", "num-blocks-one", "kv-cache-memory-not-a-size", "missing-model",
         "unknown-model-impl"],
)
def test_bad_engine_options_exit_with_a_message(option, message, tiny):
    """Engine options are checked when the engine is built; the error must still reach the user as a message."""
    args = ["Hello", "--eager", "--num-blocks", "32", "--model", tiny, *option]
    result = invoke(*args)
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), f"uncaught {result.exception!r}"
    assert message in result.output


def test_cli_and_server_defaults_match_the_engine_config():
    """The CLI repeats the engine's block-size and model-impl defaults as literals (``--help`` stays import-free)."""
    import typer.main

    from flexpage.config import EngineConfig
    from flexpage.server.main import ServeSettings

    engine = EngineConfig()
    for command in ("generate", "serve"):
        click_command = typer.main.get_command(app).commands[command]
        defaults = {p.name: p.default for p in click_command.params}
        assert defaults["block_size"] == engine.block_size, command
        assert defaults["attention_block_size"] == engine.attention_block_size, command
        assert defaults["model_impl"] == engine.model_impl, command
    settings = ServeSettings()
    assert (settings.block_size, settings.attention_block_size, settings.model_impl, settings.compile_step) == (
        engine.block_size, engine.attention_block_size, engine.model_impl, engine.compile_step)
    serve = {p.name: p.default for p in typer.main.get_command(app).commands["serve"].params}
    assert (serve["kv_budget"], serve["kv_eviction"]) == (engine.kv_budget_tokens, engine.kv_eviction)
    assert (settings.kv_budget_tokens, settings.kv_eviction) == (engine.kv_budget_tokens, engine.kv_eviction)
    assert serve["quantization"] == settings.quantization == engine.quantization


@pytest.mark.parametrize("spec, message", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method: got 'eagle'"),
    ('{"method": "ngram"', "speculative_config: not valid JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "kv_budget": 64}', "kv_budget: unknown key for method 'ngram'"),
])
def test_serve_refuses_a_bad_speculative_config_before_loading_anything(spec, message):
    result = CliRunner().invoke(app, ["serve", "--model", "/no/such/model", "--speculative-config", spec],
                                env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    assert message in result.output
