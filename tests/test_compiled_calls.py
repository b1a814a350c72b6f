"""How flexpage's compiled attention calls are keyed and called.

``call_compiled``: the shared compiled attention functions outgrow Dynamo's default of 8
variants per code object (under ``fullgraph=True`` a hard failure); the limit is raised
for the call that compiles a new variant, and only there.

``kernel_options_for``: the options are part of the compiled graph, hence of Inductor's
cache key; they name the CPU vector ISA, so kernels compiled for another ISA are never
loaded from a shared cache."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from flexpage.backends.cpu import template_tuning, torch_patches
from flexpage.attention.flex import VEC_ISA_OPTION, call_compiled, isa_kernel_options, kernel_options_for


def test_more_variants_than_dynamos_default_limit_compile_and_the_limit_stays_put():
    def scale(x: torch.Tensor, factor: int) -> torch.Tensor:
        return x * factor

    compiled = torch.compile(scale, fullgraph=True, dynamic=False)  # each factor is its own variant
    limit = torch._dynamo.config.recompile_limit
    x = torch.ones(3)
    for factor in range(limit + 4):
        assert call_compiled(compiled, x, factor).tolist() == [factor] * 3
    assert torch._dynamo.config.recompile_limit == limit
    for factor in range(limit + 4):  # every variant is cached: no new compile, no failure
        assert call_compiled(compiled, x, factor)[0] == factor


def test_kernel_options_name_the_tuned_template_the_vector_isa_and_the_bf16_dot_products():
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    assert torch_patches.install().active  # the tested torch: both patches go in
    options = kernel_options_for(torch.device("cpu"), {"PARTITION_SIZE": 512})
    assert options == {"PARTITION_SIZE": 512, VEC_ISA_OPTION: str(pick_vec_isa()),
                       template_tuning.TUNED_OPTION: template_tuning.TUNING_VERSION,
                       template_tuning.DOT_BF16_OPTION: template_tuning.dot_bf16_option()}
    # deterministic kernels never ask for the bf16 dot products (they keep the stock arithmetic)
    deterministic = kernel_options_for(torch.device("cpu"), None, deterministic=True)
    assert deterministic[template_tuning.DETERMINISTIC_OPTION] is True
    assert template_tuning.DOT_BF16_OPTION not in deterministic
    assert isa_kernel_options(torch.device("meta")) == {}


def test_inductors_vector_isa_probe_is_kept_on_disk_for_the_next_process(monkeypatch, tmp_path):
    """Inductor probes the ISAs by compiling test programs (~1 s each); where nothing asks for
    another ISA than the best, the probe stops at the first valid one -- Inductor's own first
    -- and a later process (a cleared cache) takes it from disk, not from a new probe. A caller
    during a probe on another thread waits for its answer. Asked for another ISA
    (``ATEN_CPU_CAPABILITY``), the whole probe's answer is kept apart. Whether AVX512-BF16
    built is kept too: the ISA read from disk compiles with the probed ISA's flags (its
    kernels' cache keys are the probing process's, not a second build of each)."""
    import json

    from torch._inductor import cpu_vec_isa as inductor

    from flexpage.backends.cpu import vec_isa_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    vec_isa_cache.apply()  # installed once per process (kernel options already did)
    probed = [str(isa) for isa in inductor.valid_vec_isa_list.probe()]  # Inductor's own probe, run now
    inductor.valid_vec_isa_list.cache_clear()  # as a new process
    folder = tmp_path / "flexpage-vec-isa"
    try:
        vec_isa_cache.probe_in_background()  # as an engine starts: the caller below waits for its answer
        picked = vec_isa_cache.cpu_vec_isa()
        [kept] = folder.iterdir()
        assert json.loads(kept.read_text())["isas"] == probed[:1] == [picked]
        assert [str(isa) for isa in inductor.valid_vec_isa_list()] == probed[:1]
        assert all(isa in inductor.supported_vec_isa_list for isa in inductor.valid_vec_isa_list())
        [best] = inductor.valid_vec_isa_list()
        probed_flags = best.build_arch_flags()
        if hasattr(best, "_is_avx512_bf16_supported"):  # as a new process's object, never build-checked
            best._is_avx512_bf16_supported = False
        inductor.valid_vec_isa_list.cache_clear()
        assert [isa.build_arch_flags() for isa in inductor.valid_vec_isa_list()] == [probed_flags]
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
        assert [str(isa) for isa in inductor.valid_vec_isa_list()] == probed
        assert len(list(folder.iterdir())) == 2
        monkeypatch.delenv("ATEN_CPU_CAPABILITY")
        kept.write_text(json.dumps({"isas": ["avx2"], "avx512_bf16": []}))  # as if this CPU had only AVX2
        inductor.valid_vec_isa_list.cache_clear()
        assert vec_isa_cache.cpu_vec_isa() == "avx2"
    finally:
        inductor.valid_vec_isa_list.cache_clear()


def test_a_process_limited_to_avx2_compiles_under_another_key():
    """``ATEN_CPU_CAPABILITY=avx2`` makes Inductor emit AVX2 code: its kernels must not share
    a cache entry with this process's (which ran them and corrupted its heap)."""
    code = "import torch; from flexpage.attention.flex import isa_kernel_options; print(isa_kernel_options(torch.device('cpu')))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str({VEC_ISA_OPTION: "avx2"})


_STOCK_RUN = """
import warnings
import torch
from attention_reference import BatchSpec, Geometry, PagedCase, rel_err
from flexpage.backends.cpu import template_tuning, torch_patches
from flexpage.attention.flex import kernel_options_for
from flexpage.recipes import causal

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    status = torch_patches.install()
assert not status.active and status.reason == "FLEXPAGE_TORCH_PATCHES=0", status
assert [str(w.message) for w in caught if "stock CPU FlexAttention" in str(w.message)], caught
assert template_tuning.TUNED_OPTION not in kernel_options_for(torch.device("cpu"), None)
spec = BatchSpec("mixed", seq_lens=(40, 70), query_lens=(1, 37))
geometry = Geometry("fp32", torch.float32, q_heads=6, kv_heads=2, head_dim=64, tol=1e-5)
case = PagedCase(spec, geometry, causal(), page_size=16, num_pages=16, width=8, seed=0)
err = rel_err(case.run(compile=True), case.reference())
assert err < geometry.tol, err
print("ok")
"""


def test_without_the_patches_stock_kernels_run_and_are_correct(tmp_path):
    """``FLEXPAGE_TORCH_PATCHES=0`` (as an untested torch or a changed template would): one warning,
    no tuned-template option, and a compiled paged call (decode and prefill rows) still matches
    the dense reference. A fresh process, since the patches are process-wide, and its own
    compile cache, so no stock kernel is ever stored where tuned ones are looked up. float32:
    the stock bf16 prefill kernel packs K/V for AMX whenever the CPU has AMX, and fails when
    its code is compiled for AVX2 (``ATEN_CPU_CAPABILITY=avx2`` on an AMX CPU: "pack_vnni2 is
    only supported when avx512 is supported"); the tuned template never packs in AVX2 code."""
    env = {**os.environ, "FLEXPAGE_TORCH_PATCHES": "0", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _STOCK_RUN], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_kernels_that_differ_only_in_their_size_arguments_get_one_source_and_calls_find_their_arguments():
    """Two graphs pass one attention kernel the same sizes under other names and in another
    order; rewritten to name and order them by first use in the body, the two sources are one
    (one compile), and the returned kernel puts each caller's arguments where they belong."""
    from flexpage.backends.cpu.canonical_kernel_names import canonical_kernel

    def source(params: str, batch: str, heads: str) -> str:
        return ('#include <x>\nextern "C"\nvoid kernel(const float* in_ptr0, float* out_ptr0, %s)\n{\n'
                '  int64_t batch = %s;\n  int64_t heads = %s * %s;\n  int64_t tmp_ks5 = 0;  // not a size argument\n}\n'
                % (params, batch, heads, batch))

    # graph A: kernel(x, out, ks1=unused, ks7=batch, ks3=heads); graph B: kernel(x, out, ks0=heads, ks2=batch, ks9=unused)
    a = canonical_kernel(source("const int64_t ks1, const int64_t ks7, const int64_t ks3", "ks7", "ks3"))
    b = canonical_kernel(source("const int64_t ks0, const int64_t ks2, const int64_t ks9", "ks2", "ks0"))
    assert a.source == b.source
    assert "int64_t batch = ks0;" in a.source and "int64_t heads = ks1 * ks0;" in a.source and "tmp_ks5 = 0" in a.source
    assert "const int64_t ks0, const int64_t ks1, const int64_t ks2)" in a.source
    args_a = ("x", "out", "unused", "batch", "heads")
    assert [args_a[i] for i in a.order] == ["x", "out", "batch", "heads", "unused"]
    args_b = ("x", "out", "heads", "batch", "unused")
    assert [args_b[i] for i in b.order] == ["x", "out", "batch", "heads", "unused"]


def test_kernels_already_in_canonical_form_keep_their_source_and_their_direct_call():
    from flexpage.backends.cpu.canonical_kernel_names import canonical_kernel

    pointwise = ('extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0, const int64_t ks1)\n'
                 '{ for (int64_t x = 0; x < ks0 * ks1; ++x) out_ptr0[x] = in_ptr0[x]; }\n')
    assert canonical_kernel(pointwise).source == pointwise
    assert not canonical_kernel(pointwise).reordered
    assert not canonical_kernel("no kernel here").reordered


def test_the_patched_compile_entry_point_compiles_the_canonical_source_and_reorders_the_call(monkeypatch):
    from torch._inductor import codecache
    from torch._inductor.async_compile import AsyncCompile

    assert torch_patches.install().active
    compiled: list[str] = []

    def load(argtypes: list[str], source: str, *args: object, **kwargs: object):
        compiled.append(source)
        return lambda *call_args: call_args

    monkeypatch.setattr(codecache.CppPythonBindingsCodeCache, "load_pybinding", load)
    monkeypatch.setattr("torch._inductor.async_compile.get_compile_threads", lambda: 1)
    source = ('extern "C"\nvoid kernel(float* out_ptr0, const int64_t ks4, const int64_t ks2)\n'
              '{ out_ptr0[0] = ks2 - ks4; }\n')
    kernel = AsyncCompile().cpp_pybinding(["float*", "const int64_t", "const int64_t"], source)
    assert compiled == ['extern "C"\nvoid kernel(float* out_ptr0, const int64_t ks0, const int64_t ks1)\n'
                        '{ out_ptr0[0] = ks0 - ks1; }\n']
    assert kernel("out", 4, 2) == ("out", 2, 4)
