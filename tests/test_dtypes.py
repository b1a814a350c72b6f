"""Tests for flexpage.model.dtypes: dtype names, and bf16 only where every kernel has it natively."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flexpage.backends.cpu import description
from flexpage.model.dtypes import default_dtype, parse_dtype


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("BF16", torch.bfloat16),
        ("torch.float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_parse_dtype(name: str | torch.dtype, expected: torch.dtype) -> None:
    assert parse_dtype(name) is expected


def test_parse_dtype_auto_is_default() -> None:
    assert parse_dtype("auto") is default_dtype()
    assert default_dtype() in (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("bad", ["int8", "float64", "", "fp8", torch.int8, torch.float64])
def test_parse_dtype_rejects_unknown(bad: str | torch.dtype) -> None:
    with pytest.raises(ValueError) as info:
        parse_dtype(bad)
    message = str(info.value)
    assert "dtype" in message and repr(bad) in message, message


@pytest.mark.parametrize(
    ("capability", "onednn_bf16", "flags", "expected"),
    [
        ("AVX512", True, {"avx512f", "avx512_bf16"}, torch.bfloat16),  # AMD EPYC (Zen 4)
        ("AVX512", True, {"avx512f", "amx_bf16", "amx_tile"}, torch.bfloat16),  # Intel Xeon with AMX
        ("AVX512", True, {"avx512f"}, torch.float32),  # AVX-512 without bf16 instructions (Skylake)
        ("AVX2", True, {"avx2", "avx512_bf16"}, torch.float32),  # ATEN_CPU_CAPABILITY=avx2 on a bf16 CPU
        ("AVX2", False, {"avx2", "fma"}, torch.float32),  # a CPU without AVX-512
        ("AVX512", False, {"avx512f", "avx512_bf16"}, torch.float32),  # ONEDNN_MAX_CPU_ISA below AVX-512
        ("DEFAULT", False, set(), torch.float32),
    ],
)
def test_default_dtype_is_bf16_only_where_every_kernel_has_native_bf16(
    monkeypatch: pytest.MonkeyPatch, capability: str, onednn_bf16: bool, flags: set[str], expected: torch.dtype,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    monkeypatch.setattr(description, "cpu_flags", lambda: flags)
    assert description.read_machine().default_dtype is expected  # describe() read this machine once


def test_default_dtype_on_gpu_is_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert description.read_machine().default_dtype is torch.bfloat16


def test_a_cpu_without_avx512_gets_float32() -> None:
    """The real check, not a patched one: ATEN_CPU_CAPABILITY=avx2 is how such a CPU looks to PyTorch."""
    code = "from flexpage.model.dtypes import default_dtype; print(default_dtype())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch.float32"
