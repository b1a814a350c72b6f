"""The AVX512-BF16 dot-product helpers of the tuned attention kernels (``dot_bf16.h``), alone.

The kernel tests (tests/test_paged_attention.py) check whole attention calls against float64
within bf16's tolerance; here the helpers' prefill row blocks and decode tiles are checked
product by product, over shapes the kernels rarely meet together (every copy stride, odd key
counts, tails of columns), by a small C++ driver built with the compiler Inductor uses.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import flexpage.backends.cpu

HEADER_DIR = Path(flexpage.backends.cpu.__file__).parent
DRIVER = Path(__file__).parent / "native" / "dot_bf16_rows.cpp"


@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported() or shutil.which("g++") is None,
                    reason="the helpers run on CPUs with AVX512-BF16, built by g++")
def test_row_blocks_and_decode_tiles_equal_a_float64_reference_and_write_only_their_columns(tmp_path: Path):
    """``rows_of_16`` (q @ k^T and P @ V, with and without accumulation) and the per-tile ``qk``
    at a decode's 1-4 rows compute exactly the products of their bf16 inputs (all sums exact)
    and leave C's other columns alone."""
    binary = tmp_path / "dot_bf16_rows"
    subprocess.run(["g++", "-O2", "-march=native", "-std=c++17", "-I", str(HEADER_DIR), str(DRIVER), "-o",
                    str(binary)], check=True, capture_output=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "504 cases, 0 bad"
