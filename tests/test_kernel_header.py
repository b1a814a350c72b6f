"""Inductor's precompiled kernel header, built ahead on a helper thread
(flexpage.backends.cpu.kernel_header): the same header Inductor's own kernels ask for, built
once per compile cache."""

from __future__ import annotations

import pytest
from torch._inductor import codecache

from flexpage import background
from flexpage.backends.cpu import kernel_header

# a kernel as Inductor's C++ code generation writes one (prefix header, vector code)
INDUCTOR_LIKE_KERNEL = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(float* out) {
    auto v = at::vec::Vectorized<float>(1.0f);
    (v + v).store(out);
}
"""


@pytest.fixture
def header_requests(monkeypatch, tmp_path):
    """The (header, command line) pairs that kernel loads ask Inductor to precompile, from a
    code cache emptied for the test (a kernel loaded before is looked up in memory); the
    compile cache's marker kept to the test."""
    requests = []
    precompile = codecache._precompile_header

    def recording(header, hashable_cmd_line, **compile_command):  # noqa: ANN001, ANN202
        requests.append((header, hashable_cmd_line))
        return precompile(header, hashable_cmd_line, **compile_command)

    monkeypatch.setattr(codecache, "_precompile_header", recording)
    monkeypatch.setattr(codecache.CppPythonBindingsCodeCache, "cache", {})
    monkeypatch.setattr(kernel_header, "_marker", lambda: tmp_path / "kernel-header" / "built")
    return requests


def test_the_header_built_ahead_is_the_one_inductors_kernels_ask_for(header_requests):
    from torch._inductor.async_compile import AsyncCompile

    kernel_header.build()
    ahead = list(header_requests)
    AsyncCompile().cpp_pybinding(["float*"], INDUCTOR_LIKE_KERNEL)  # as generated code loads a kernel
    assert ahead and header_requests[len(ahead):] == ahead


def test_a_compile_cache_is_built_for_once(monkeypatch, tmp_path):
    marker = tmp_path / "kernel-header" / "built"
    monkeypatch.setattr(kernel_header, "_marker", lambda: marker)
    builds = []
    build = kernel_header.build
    monkeypatch.setattr(kernel_header, "build", lambda: (builds.append(marker.exists()), build()))

    kernel_header.build_in_background()  # a first start with this compile cache
    kernel_header.wait()
    assert builds == [False] and marker.exists()

    kernel_header.build_in_background()  # a later one
    assert "flexpage-kernel-header" not in background.running()
    kernel_header.wait()
    assert builds == [False]
