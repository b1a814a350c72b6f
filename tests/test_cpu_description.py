"""The CPU description (flexpage.backends.cpu.description), the kernel fallback policy, and
``flexpage env``. Every rule is checked on made-up CPUs, so nothing here depends on the CPU
that runs it."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from typer.testing import CliRunner

from flexpage.backends.cpu import block_kernel, description, fallback
from flexpage.backends.cpu.description import CPUDescription, PathRecord, describe
from flexpage.backends.cpu.fallback import FALLBACK_ENV, KernelFallbackError

ZEN4 = CPUDescription(machine="x86_64", vendor="AuthenticAMD", model_name="AMD EPYC 9R14",
                      flags=frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni"}),
                      aten_capability="AVX512", onednn=True, onednn_bf16=True, avx512_bf16=True, amx_tile=False,
                      amx_fp16=False, vec_isa="avx512 avx512_vnni")
SAPPHIRE_RAPIDS = CPUDescription(machine="x86_64", vendor="GenuineIntel", model_name="Intel Xeon Platinum 8488C",
                                 flags=frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile",
                                                  "amx_bf16"}),
                                 aten_capability="AVX512", onednn=True, onednn_bf16=True, avx512_bf16=True,
                                 amx_tile=True, amx_fp16=False, vec_isa="avx512 avx512_vnni amx_tile")
ZEN3 = CPUDescription(machine="x86_64", vendor="AuthenticAMD", model_name="AMD EPYC 7R13",
                      flags=frozenset({"avx2", "fma", "f16c"}), aten_capability="AVX2", onednn=True,
                      onednn_bf16=False, avx512_bf16=False, amx_tile=False, amx_fp16=False, vec_isa="avx2")
GRAVITON = CPUDescription(machine="aarch64", vendor="", model_name="", flags=frozenset({"asimd", "bf16"}),
                          aten_capability="SVE256", onednn=True, onednn_bf16=False, avx512_bf16=False,
                          amx_tile=False, amx_fp16=False, vec_isa="")


def test_the_description_is_read_once_and_holds_this_machines_facts():
    assert describe() is describe()
    d = describe()
    assert d.machine and isinstance(d.flags, frozenset)
    assert d.default_dtype in (torch.float32, torch.bfloat16) and d.dtype_reason
    assert any(p.name == "dtype (auto)" for p in d.paths.paths())
    from flexpage.model.dtypes import default_dtype

    assert default_dtype() is d.default_dtype


@pytest.mark.parametrize(("cpu", "dtype", "because"), [
    (ZEN4, torch.bfloat16, "AVX512-BF16 instructions"),
    (SAPPHIRE_RAPIDS, torch.bfloat16, "AMX-BF16 instructions"),
    (ZEN3, torch.float32, "not AVX-512"),
    (dataclasses.replace(ZEN4, onednn_bf16=False), torch.float32, "oneDNN has no bf16"),
    (dataclasses.replace(ZEN4, flags=frozenset({"avx512f"}), avx512_bf16=False), torch.float32, "no avx512_bf16"),
    (dataclasses.replace(ZEN3, cuda=True), torch.bfloat16, "CUDA"),
])
def test_the_default_dtype_and_why(cpu: CPUDescription, dtype: torch.dtype, because: str):
    assert cpu.default_dtype is dtype
    assert because in cpu.dtype_reason


def test_projection_rules():
    assert [ZEN4.row_step(torch.bfloat16), SAPPHIRE_RAPIDS.row_step(torch.bfloat16), ZEN4.row_step(torch.float32)] \
        == [8, 16, 2]
    assert ZEN4.can_prepack(torch.bfloat16) and ZEN3.can_prepack(torch.float32)
    assert not ZEN3.can_prepack(torch.bfloat16)
    assert not dataclasses.replace(ZEN3, onednn=False).can_prepack(torch.float32)
    assert ZEN4.bf16_blocks_at_every_row(has_bf16_panels=True)
    assert not SAPPHIRE_RAPIDS.bf16_blocks_at_every_row(has_bf16_panels=True)  # AMX tiles outrun the panels
    assert not ZEN4.bf16_blocks_at_every_row(has_bf16_panels=False)
    assert ZEN3.block_kernel_cpu and not GRAVITON.block_kernel_cpu


def test_attention_rules():
    assert (ZEN4.compiles_avx512(), SAPPHIRE_RAPIDS.compiles_avx512(), ZEN3.compiles_avx512()) == (True, True, False)
    assert SAPPHIRE_RAPIDS.packs_for_amx(torch.bfloat16) and not SAPPHIRE_RAPIDS.packs_for_amx(torch.float16)
    assert dataclasses.replace(SAPPHIRE_RAPIDS, amx_fp16=True).packs_for_amx(torch.float16)
    assert not ZEN4.packs_for_amx(torch.bfloat16) and not SAPPHIRE_RAPIDS.packs_for_amx(torch.float32)
    assert ZEN4.dot_bf16() and not ZEN3.dot_bf16()
    assert not dataclasses.replace(ZEN4, dot_bf16_switch=False).dot_bf16()  # FLEXPAGE_BF16_DOT=0
    assert not dataclasses.replace(ZEN4, vec_isa="avx2").dot_bf16()  # ATEN_CPU_CAPABILITY=avx2
    # prefill rows: bf16 where AMX packs or dot products run, float32 where only stock micro-gemms would
    assert [cpu.attention_dtype(torch.bfloat16) for cpu in (ZEN4, SAPPHIRE_RAPIDS, ZEN3)] \
        == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert [cpu.attention_dtype(torch.float16) for cpu in (ZEN4, SAPPHIRE_RAPIDS, ZEN3)] == [torch.float32] * 3
    assert ZEN3.attention_dtype(torch.float32) is torch.float32


def test_summary_and_facts_name_the_cpu_and_its_paths():
    assert ZEN4.summary() == "AMD EPYC 9R14; avx512 avx512_vnni, no AMX, AVX512-BF16"
    assert SAPPHIRE_RAPIDS.summary().endswith("AMX-BF16, AVX512-BF16")
    facts = ZEN3.facts()
    assert facts["flags"] == ["avx2", "f16c", "fma"] and facts["default_dtype"] == "float32"
    json.dumps(facts)  # plain data


def test_the_path_record_keeps_each_choice_once_in_order_and_marks_failures():
    record = PathRecord()
    record.record("projections", "oneDNN packed bfloat16", "a")
    record.record("gguf block kernel", "float32 weights", "the build failed: boom", ok=False)
    record.record("projections", "oneDNN packed bfloat16", "b")  # the same choice again: its reason updated
    record.record("projections", "GGUF blocks (bfloat16)")
    assert [(p.name, p.choice, p.reason) for p in record.paths()] == [
        ("projections", "oneDNN packed bfloat16", "b"), ("gguf block kernel", "float32 weights", "the build failed: boom"),
        ("projections", "GGUF blocks (bfloat16)", "")]
    assert [p.name for p in record.failures()] == ["gguf block kernel"]
    assert record.lines()[1] == "gguf block kernel: FAILED, float32 weights (the build failed: boom)"
    record.forget("projections")
    assert [p.name for p in record.paths()] == ["gguf block kernel"]


@pytest.fixture
def failing_build(monkeypatch: pytest.MonkeyPatch):
    """A GGUF block kernel whose build fails (the compiler is never run), in a description of
    this machine with an empty path record, that claims the kernel's instructions."""
    from flexpage.backends.cpu import env_report

    fresh = dataclasses.replace(describe(), flags=describe().flags | {"avx2", "fma", "f16c"}, paths=PathRecord())
    for module in (block_kernel, fallback, description, env_report):
        monkeypatch.setattr(module, "describe", lambda: fresh)

    def broken(cpp_extension):  # noqa: ANN001
        raise RuntimeError("Error building extension 'flexpage_gguf_linear': g++: fatal error: no input files")

    monkeypatch.setattr(block_kernel, "_load", broken)
    block_kernel._build_once.cache_clear()
    yield fresh
    block_kernel._build_once.cache_clear()


def test_a_failed_kernel_build_falls_back_loudly_by_default(failing_build, monkeypatch):
    monkeypatch.delenv(FALLBACK_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="GGUF block kernel is not available.*float32 weights"):
        assert block_kernel.build() is False
    [failed] = failing_build.paths.failures()
    assert failed.name == "gguf block kernel" and "g++: fatal error" not in failed.choice
    assert failed.reason.startswith("the GGUF block kernel is not available: the build failed: Error building")


def test_a_failed_kernel_build_is_a_hard_failure_when_asked(failing_build, monkeypatch):
    monkeypatch.setenv(FALLBACK_ENV, "error")
    with pytest.raises(KernelFallbackError, match="FLEXPAGE_KERNEL_FALLBACK=error"):
        block_kernel.build()
    assert [p.name for p in failing_build.paths.failures()] == ["gguf block kernel"]  # recorded all the same


def test_an_unknown_fallback_policy_is_refused(monkeypatch):
    monkeypatch.setenv(FALLBACK_ENV, "ignore")
    with pytest.raises(ValueError, match="FLEXPAGE_KERNEL_FALLBACK: got 'ignore', expected one of warn, error"):
        fallback.fallback_policy()


def test_flexpage_env_prints_a_report_for_a_bug_report():
    from flexpage.cli import app

    result = CliRunner().invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    for heading in ("versions:", "cpu:", "dtype:", "projections:", "attention:", "gguf block kernel:",
                    "compile caches:", "paths taken:"):
        assert heading in result.output
    assert f"torch: {torch.__version__}" in result.output
    assert "Inductor vector ISA: " in result.output and "flags that matter: " in result.output

    result = CliRunner().invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["dtype"]["default (auto)"] == str(describe().default_dtype).removeprefix("torch.")
    assert any(line.startswith("torch patches: ") for line in report["paths taken"])


def test_flexpage_env_reports_a_failed_kernel_build_and_fails_when_asked(failing_build, monkeypatch):
    from flexpage.cli import app
    from flexpage.model import gguf_linear

    monkeypatch.setattr(gguf_linear, "available", block_kernel.build)  # not its cached answer of this process
    monkeypatch.setenv(FALLBACK_ENV, "warn")
    with pytest.warns(RuntimeWarning):
        result = CliRunner().invoke(app, ["env", "--build-kernels"])
    assert result.exit_code == 0, result.output
    assert "FAILED to build" in result.output
    assert "gguf block kernel: FAILED, float32 weights (about 5x the memory) (the GGUF block kernel is not" in result.output
    monkeypatch.setenv(FALLBACK_ENV, "error")
    result = CliRunner().invoke(app, ["env", "--build-kernels"])
    assert result.exit_code == 1
    assert "FLEXPAGE_KERNEL_FALLBACK=error" in result.output


def test_serve_refuses_an_unknown_kernel_fallback_before_loading_anything(monkeypatch):
    from flexpage.cli import app

    monkeypatch.setenv(FALLBACK_ENV, "warn")  # restored after the test, whatever the command sets
    result = CliRunner().invoke(app, ["serve", "--kernel-fallback", "sometimes"])
    assert result.exit_code == 2
    assert "--kernel-fallback: got 'sometimes', expected one of warn, error" in result.output
    assert os.environ[FALLBACK_ENV] == "warn"
