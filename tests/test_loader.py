"""Tests for flexpage.model.loader: GGUF conversion and path resolution."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import time

import pytest
import torch

from flexpage.model import loader
from flexpage.model.loader import (
    DEFAULT_MODEL_NAME,
    load_hf_model,
    load_tokenizer,
    resolve_model_path,
)

PROMPT = "The capital of France is"


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_converted_folder_matches_gguf_logits(default_model_path: pathlib.Path) -> None:
    """The cached folder must be a lossless copy of the de-quantised GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = loader._default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    ).eval()
    converted = AutoModelForCausalLM.from_pretrained(
        default_model_path, local_files_only=True, dtype=torch.float32
    ).eval()

    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference(ids).logits
        got = converted(ids).logits
    assert got.shape == (1, ids.shape[1], 49152)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got - expected).abs().max()


def test_converted_folder_layout(default_model_path: pathlib.Path) -> None:
    assert default_model_path.name == DEFAULT_MODEL_NAME
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (default_model_path / name).is_file(), name
    assert not list(default_model_path.parent.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"))


def test_load_hf_model_is_inference_ready(default_model_path: pathlib.Path) -> None:
    model = load_hf_model(default_model_path, torch.bfloat16, attn_implementation="sdpa")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.dtype == torch.bfloat16
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (576, 30, 9)
    assert (cfg.num_key_value_heads, cfg.vocab_size) == (3, 49152)
    assert getattr(cfg, "quantization_config", None) is None


def test_tokenizer_round_trip_and_chat_template(default_model_path: pathlib.Path) -> None:
    tokenizer = load_tokenizer(default_model_path)
    text = "Hello, paged attention! 123"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text

    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_special_tokens_survive_conversion(default_model_path: pathlib.Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    special = loader._gguf_special_token_ids(loader._default_gguf_path())
    assert special["bos"] == 1 and special["eos"] == 2
    tokenizer = load_tokenizer(default_model_path)
    config = AutoConfig.from_pretrained(default_model_path, local_files_only=True)
    generation = GenerationConfig.from_pretrained(default_model_path, local_files_only=True)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    for source in (tokenizer, config, generation):
        assert source.bos_token_id == special["bos"]
        assert source.eos_token_id == special["eos"]


def test_second_resolve_is_fast_and_stable(default_model_path: pathlib.Path) -> None:
    start = time.perf_counter()
    again = resolve_model_path(None)
    assert time.perf_counter() - start < 2.0
    assert again == default_model_path


def test_directory_with_config_is_returned_as_is(default_model_path: pathlib.Path) -> None:
    assert resolve_model_path(default_model_path) == default_model_path
    assert resolve_model_path(str(default_model_path)) == default_model_path


# --------------------------------------------------------------------------- bad inputs


def _assert_value_error(model: object, value_text: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model_path(model)  # type: ignore[arg-type]
    message = str(info.value)
    assert "model" in message and value_text in message, message


def test_bad_inputs_raise_value_error_naming_model(tmp_path: pathlib.Path) -> None:
    _assert_value_error(str(tmp_path / "missing"), "missing")
    _assert_value_error("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
    _assert_value_error("", "''")
    _assert_value_error(42, "42")

    text_file = tmp_path / "weights.bin"
    text_file.write_bytes(b"x")
    _assert_value_error(str(text_file), "weights.bin")

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    _assert_value_error(empty_dir, "empty")

    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"a")
    (two / "b.gguf").write_bytes(b"b")
    _assert_value_error(two, "two")


# --------------------------------------------------------------------------- gguf routing (fake converter)


def _fake_convert(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    (out_dir / "config.json").write_text("{}", encoding="utf-8")
    (out_dir / "source.txt").write_text(gguf_path.name, encoding="utf-8")


@pytest.fixture
def fake_cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> list[pathlib.Path]:
    """Point the cache at tmp_path and record conversions instead of running them."""
    calls: list[pathlib.Path] = []

    def convert(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
        calls.append(gguf_path)
        _fake_convert(gguf_path, out_dir)

    monkeypatch.setenv(loader.CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_convert_gguf", convert)
    return calls


def test_gguf_file_converted_once_into_keyed_folder(tmp_path: pathlib.Path, fake_cache: list) -> None:
    gguf = tmp_path / "src" / "tiny.Q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"gguf-bytes")

    first = resolve_model_path(gguf)
    assert first.parent == tmp_path / "cache" / "gguf"
    assert first.name.startswith("tiny.Q8_0-")
    assert (first / "source.txt").read_text() == "tiny.Q8_0.gguf"
    assert resolve_model_path(str(gguf)) == first
    # A directory holding exactly that one gguf (and no config.json) maps to the same folder.
    assert resolve_model_path(gguf.parent) == first
    assert fake_cache == [gguf]

    # Replacing the file (new size and mtime) gives a new key and a fresh conversion.
    gguf.write_bytes(b"different-gguf-bytes")
    os.utime(gguf, ns=(1_000_000_000, 1_000_000_000))
    second = resolve_model_path(gguf)
    assert second != first
    assert fake_cache == [gguf, gguf]


def test_default_model_honours_cache_env(tmp_path: pathlib.Path, fake_cache: list) -> None:
    path = resolve_model_path(None)
    assert path == tmp_path / "cache" / DEFAULT_MODEL_NAME
    assert fake_cache == [loader._default_gguf_path()]


# --------------------------------------------------------------------------- atomic publish


def test_failed_build_leaves_nothing_behind(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "model"

    def crash(out_dir: pathlib.Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        loader._publish_atomically(target, crash)
    assert not target.exists()
    assert not list(tmp_path.glob(".model.tmp-*"))


def test_stale_temp_dirs_are_cleaned(tmp_path: pathlib.Path) -> None:
    stale = tmp_path / ".model.tmp-crashed"
    stale.mkdir()
    (stale / "partial.safetensors").write_bytes(b"half")
    target = loader._publish_atomically(tmp_path / "model", lambda d: _fake_convert(pathlib.Path("x.gguf"), d))
    assert (target / "config.json").is_file()
    assert not stale.exists()


def _slow_build(out_dir: pathlib.Path) -> None:
    counter = out_dir.parent / "builds.log"
    with open(counter, "a", encoding="utf-8") as fh:
        fh.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    (out_dir / "config.json").write_text("{}")


def _publish_in_child(target: str) -> None:
    loader._publish_atomically(pathlib.Path(target), _slow_build)


def test_concurrent_processes_build_once(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "model"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_publish_in_child, args=(str(target),)) for _ in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert (target / "config.json").is_file()
    assert len((tmp_path / "builds.log").read_text().split()) == 1
    assert not list(tmp_path.glob(".model.tmp-*"))
