"""An opt-in tuning of PyTorch's CPU FlexAttention template for paged attention (torch 2.13).

The CPU template visits one (row, head, key block) at a time. For every dtype the tuned
template cuts what a visit costs beyond reading the block:

- a partial block's mask (it depends on indices only) is evaluated *before* the q@k^T gemm,
  and the block is shortened to its last column some query row can see (both found and
  applied in vector code: as scalar loops they were a quarter of a bf16 prefill kernel's
  non-gemm time; 4x256 GQA prefill 1.47-1.50 vs 1.70-2.14 ms): a sequence's last
  key block is usually partly filled, and the stock template reads all of it (K and V) and
  masks the unfilled slots afterwards;
- no per-block heap allocation of index buffers, no identity score mod (a copy of the score
  tile onto itself), no linear search to tell partial from full blocks (partial ones are
  listed first), no pool-sized K/V packing buffers per call unless the kernel packs;
- its threads take (row, head, query block) items one at a time from a shared counter, not
  in equal contiguous shares: items differ in cost (causal query blocks, rows of other
  lengths, padding), and a prefill's static split left one of two threads waiting ~20% of
  the kernel's time (the anchors workload's prefill 3.06-3.22 -> 2.86-3.11 s, Zen 5).

For the small query blocks of bf16/fp16 decode (one token's ``G`` packed query heads: 1-8
rows) two more choices cost more than the attention itself (``perf`` of a batch-64 GQA
decode call: 28% in MKL's generic bf16 gemm, 22% in the q@k^T micro-gemm):

- ``P @ V`` goes through ``cpublas::brgemm``, which for unpacked bf16 falls back to a full
  MKL gemm call per key block (converting to fp32 inside). The template already has a
  micro-gemm for it (its fp16 path uses it); the tuned template uses it for bf16 too.
- Its micro-gemms block one query row at a time (``GemmBlocking(1, 16, 1)``), so each key
  tile is reloaded for every row. The tuned template blocks ``min(query block rows, 16)``
  rows, which keeps the whole query block in registers for decode.

Those two give 1.5-3x faster bf16 decode calls. A decode call also reads each key block once,
from memory, with little work per byte: each of its visits starts the reads of its block's values
and of the next key block (software prefetch; 15-20% faster bf16 decode calls once the KV
outgrows the caches). On CPUs with AVX512-BF16, kernels compiled
with a non-empty ``DOT_BF16_OPTION`` (flexpage passes one there, see :func:`dot_bf16_option`)
run both bf16 micro-gemms on ``vdpbf16ps`` (``dot_bf16.h``):
a pair of bf16 products per float32 lane, no widening, half the shuffles of the stock
transposed tile; ``q @ k^T`` prefetches the next 16 key rows while it computes (a decode call
streams its keys from memory, and the loads waited: ~15% faster bf16 decode calls). Prefill
query blocks (whole blocks of 16 rows) go to its ``rows_of_16``, which copies the rows and
rearranges each key or value tile once per call rather than once per 16 rows, at strides the
compiler knows (the per-tile helpers spilled their row addresses and accumulators); their
softmax converts the probabilities to bf16 with ``vcvtneps2bf16`` (``exp_sum_bf16``), and
every tuned kernel finds a row's max without storing the row again: a 1,024-token bf16 GQA
prefill call took ~2.6-2.9 ms instead of 4.2 (AMD EPYC Zen 5). float32
decode keeps ``brgemm`` and one-row blocks (a fast sgemm there; both changes measured
slower); float32 prefill query blocks
(32 rows) block 16 rows in the q@k^T micro-gemm: 1.4-2x faster prefill calls
(``bench/prefill.py``). In AVX2 code (no AVX-512) only float32 prefill is tuned that way,
and its q@k^T runs on ``avx2_fp32.h`` (the stock AVX2 transposed micro-gemm gains nothing
from row blocks); its mask code loads key indices with plain loads (:func:`_full_int64_loads`).
Numerics are identical up to float summation order.

Tuned kernels also read 8-bit keys and values (the int8 KV cache, ``kv_cache_dtype="int8"``):
Inductor's lowering refuses keys of another dtype than the query's, and the template types
them as the query's; the tuned lowering lets int8 through (stock kernels still refuse it), the
template reads them as their own type, never packs them for AMX, and its micro-gemms widen them
as they load. In AVX-512 code a decode token's row block runs on ``int8_kv.h`` (q @ k^T on
VNNI dot products where the CPU has them, P @ V reading each value row once): a batch-8, 8k-token
bf16 decode call 1.5x faster than over bf16 keys, where Inductor's own int8 product was no faster.

Where the kernel packs K and V into the VNNI layout for its AMX brgemm (bf16/fp16 query
blocks of 64+ rows on CPUs with AMX), the stock template packs every key block of the pool
on every call; the tuned one packs only the blocks the call visits.

Only kernels compiled with ``kernel_options={TUNED_OPTION: TUNING_VERSION}`` get the tuned
template (flexpage always passes it); everything else in the process, including PyTorch's
experimental ``PagedAttention`` our benchmark compares against, stays stock. The option is
part of the compiled graph, so Inductor's cache keys tuned and stock kernels apart -- and
kernels of an older tuning: bump ``TUNING_VERSION`` whenever the tuning changes (the FX
graph cache does not see template text).
"""

from __future__ import annotations

import contextvars
import hashlib
import re
from typing import Any, NamedTuple
from types import SimpleNamespace

import torch

from flexpage.backends.cpu.description import DOT_BF16_ENV_SWITCH, describe  # noqa: F401  (re-exported)
from flexpage.backends.cpu.template_edits import (
    AVX2_FP32_CALL,
    AVX2_FP32_HELPERS,
    DETERMINISTIC_EDITS,
    DETERMINISTIC_TRANSPOSED_CHOICE,
    DOT_BF16_CALL,
    DOT_BF16_HELPERS,
    DOT_BF16_ROWS_CALL,
    DOT_BF16_SOURCE,
    ENTRY_ROW_LOOP,
    INT8_KV_HELPERS,
    INT8_KV_ROWS_CALL,
    KERNEL_BODY_START,
    KV8_EDITS,
    KV_TYPE_EDIT,
    LEAN_EDITS,
    LEAN_PV_BRANCH,
    MICRO_GEMM_INT8_A_EDIT,
    STOCK_TRANSPOSED_CHOICE,
    TAIL_EDITS,
    TUNED_PV_BRANCH,
)

TUNED_OPTION = "FLEXPAGE_TUNED_CPU_TEMPLATE"
#: kernel option: every query row computed by the same arithmetic whatever the call's shape (see
#: :data:`~flexpage.backends.cpu.template_edits.DETERMINISTIC_EDITS`); only with :data:`TUNED_OPTION`
DETERMINISTIC_OPTION = "FLEXPAGE_DETERMINISTIC_CPU_TEMPLATE"
#: kernel option: bf16 micro-gemms on AVX512-BF16 dot products (see :func:`dot_bf16_option`);
#: only with :data:`TUNED_OPTION`, never deterministic
DOT_BF16_OPTION = "FLEXPAGE_AVX512_BF16_DOT"
TUNING_VERSION = 37  # 2: float32 kernels stay stock; 5: lean per-key-block work and tail trimming, every dtype;
# 6: no K/V packing buffers unless packing; 7: only the visited key blocks are packed;
# 12: float32 prefill micro-gemms block up to 16 rows (8-11: experiments);
# 13: AVX2 kernels never pack and keep stock micro-gemms; 14-15: deterministic kernels;
# 16-17: deterministic kernels block rows too; 18: bf16 dot-product micro-gemms;
# 19: AVX2 float32 prefill blocks rows, q @ k^T on avx2_fp32.h; AVX2 full-width int64 loads plain;
# 20: the bf16 q @ k^T prefetches the next 16 key rows; 21: a partial block's mask applied and trimmed in vector code;
# 22: no stock q @ k^T fallback where the head dimension is a known multiple of the helper's step;
# 23: a tail of rows computed in power-of-two row blocks; 24: items handed to threads one at a time;
# 25-26: bf16 prefill micro-gemms in whole 16-row blocks (dot_bf16.h rows_of_16), AVX512-BF16 probabilities, row max
# 27-32: a bf16/fp16 visit of few query rows (decode) prefetches its block's values and the next block (27-30: experiments)
# 33-37: 8-bit keys and values, in AVX-512 code their row-block products on int8_kv.h (34-36: experiments)
_MAX_BLOCK_M = 16  # float32 prefill: 8 rows 10-15% slower, 32 no faster
_MIN_FP32_BLOCKED_ROWS = 16  # decode blocks (1-8 packed query heads) keep one-row blocking in float32


class _Lowering(NamedTuple):
    tuned: bool  # the kernel asked for the tuned template
    identity_score: bool  # its score mod returns the score unchanged
    deterministic: bool = False  # it asked for DETERMINISTIC_OPTION
    dot_bf16: bool = False  # it asked for DOT_BF16_OPTION (and is not deterministic)


# set while flex_attention is lowered, read when the lowering constructs its template
_lowering: contextvars.ContextVar[_Lowering] = contextvars.ContextVar(
    "flexpage_lowering", default=_Lowering(False, False))


def apply() -> bool:
    """Install the hooks once (see :func:`flexpage.backends.cpu.torch_patches.install`); returns
    whether they are installed: not if PyTorch's template text changed (stock kernels, still correct)."""
    import torch._inductor.graph  # noqa: F401  (imports the codegen modules in an order that works)
    from torch._inductor import lowering
    from torch._inductor.codegen import cpp_flex_attention_template as template_module
    from torch._inductor.codegen import cpp_micro_gemm
    from torch._inductor.kernel.flex import flex_attention as flex_attention_module

    template_cls = template_module.CppFlexAttentionTemplate
    if getattr(template_cls, "_flexpage_tuning", False):
        return True
    stock_template = template_module.FLEX_ATTENTION_TEMPLATE
    if any(stock_template.count(old) != 1 for old, _ in (*LEAN_EDITS, *KV8_EDITS)):
        return False
    if template_module.INIT_PARAMS.count(KV_TYPE_EDIT[0]) != 1:
        return False
    lean_template = stock_template
    for old, new in (*LEAN_EDITS, *KV8_EDITS):
        lean_template = lean_template.replace(old, new)
    reduced_template = lean_template.replace(LEAN_PV_BRANCH, TUNED_PV_BRANCH)
    if any(reduced_template.count(old) != 1 for old, _ in DETERMINISTIC_EDITS):
        return False
    stock_kernel = cpp_micro_gemm.CppMicroGemmFP32Vec.TEMPLATE_KERNEL
    if stock_kernel.count(STOCK_TRANSPOSED_CHOICE) != 2 or stock_kernel.count(KERNEL_BODY_START) != 1:
        return False
    if stock_kernel.count(MICRO_GEMM_INT8_A_EDIT[0]) != 1:
        return False
    kv8_lowering = _lower_cpu_reading_8bit_kv()
    if kv8_lowering is None:
        return False
    tail_entry = cpp_micro_gemm.CppMicroGemmFP32Vec.TEMPLATE_ENTRY
    if any(tail_entry.count(old) != 1 for old, _ in TAIL_EDITS) or tail_entry.count(ENTRY_ROW_LOOP) != 1:
        return False
    for old, new in TAIL_EDITS:
        tail_entry = tail_entry.replace(old, new)
    deterministic_template = reduced_template
    for old, new in DETERMINISTIC_EDITS:
        deterministic_template = deterministic_template.replace(old, new)

    hop = torch.ops.higher_order.flex_attention
    stock_lowering = lowering.lowerings[hop]

    def flex_attention_lowering(*args: Any, **kwargs: Any) -> Any:
        kernel_options = args[6] if len(args) > 6 else kwargs.get("kernel_options", {})
        score_mod = args[3] if len(args) > 3 else kwargs.get("subgraph")
        tuned = bool(kernel_options.get(TUNED_OPTION, False))
        deterministic = tuned and bool(kernel_options.get(DETERMINISTIC_OPTION, False))
        dot_bf16 = tuned and not deterministic and bool(kernel_options.get(DOT_BF16_OPTION, False))
        key = args[1] if len(args) > 1 else kwargs.get("key")
        if key is not None and key.get_dtype() == torch.int8 and not tuned:
            raise ValueError("8-bit keys and values need flexpage's tuned CPU template (kernel option "
                             f"{TUNED_OPTION}); PyTorch's stock CPU kernel reads one dtype only")
        token = _lowering.set(_Lowering(tuned, tuned and _is_identity(score_mod), deterministic, dot_bf16))
        try:
            return stock_lowering(*args, **kwargs)
        finally:
            _lowering.reset(token)

    stock_init = template_cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        stock_init(self, *args, **kwargs)
        lowering_state = _lowering.get()  # templates are rendered after lowering returns
        self.flexpage_tuned = lowering_state.tuned
        self.flexpage_identity_score = lowering_state.identity_score
        self.flexpage_deterministic = lowering_state.deterministic
        self.flexpage_dot_bf16 = lowering_state.dot_bf16
        # bf16 kernels with the dot-product helpers (dot_bf16.h is in their micro-gemm code)
        self.flexpage_bf16_softmax = self.flexpage_dot_bf16 and self.input_nodes[0].get_dtype() == torch.bfloat16

    stock_choose = template_cls.choose_flex_template

    def choose_flex_template(self, query: Any, key: Any, num_threads: Any) -> str:
        # the stock chooser reads ``node.data.data.layout.size``, a chain only an input buffer has:
        # a query computed inside a larger compiled graph is a view of another buffer
        chosen = stock_choose(self, _sized(query), _sized(key), num_threads)
        if getattr(self, "flexpage_deterministic", False):
            # never the decoding template: it splits a row's keys between threads, and its
            # merge order follows the thread count and the call's shape
            return deterministic_template
        if not getattr(self, "flexpage_tuned", False) or chosen is not stock_template:
            return chosen
        return reduced_template if _is_reduced(self) and _compiles_avx512() else lean_template

    stock_modification = template_cls.modification

    def modification(self, *args: Any, **kwargs: Any) -> str:
        code = stock_modification(self, *args, **kwargs)
        if getattr(self, "flexpage_tuned", False) and not _compiles_avx512():
            code = _full_int64_loads(code)
        return code

    stock_micro_gemm_define = template_cls.micro_gemm_define

    def micro_gemm_define(self, kernel_name: str) -> str:
        # deterministic kernels block rows wherever tuned ones may, whatever the query block: a
        # decode row must get the arithmetic of the same token's row in a prefill block
        deterministic = getattr(self, "flexpage_deterministic", False)
        blocked = (_rows_blocked(self) and not deterministic) or (deterministic and _compiles_avx512())
        kv_dtype = self.input_nodes[1].get_dtype()  # the micro-gemms' B: keys, then values
        if not (getattr(self, "flexpage_tuned", False) and (blocked or kv_dtype == torch.int8)):
            return stock_micro_gemm_define(self, kernel_name)
        stock_gemm = cpp_micro_gemm.CppMicroGemmFP32Vec
        block_m = max(1, min(int(self.q_block_size), _MAX_BLOCK_M)) if blocked else None
        kernel_text = stock_gemm.TEMPLATE_KERNEL.replace(*MICRO_GEMM_INT8_A_EDIT)
        if self.flexpage_deterministic:
            kernel_text = kernel_text.replace(STOCK_TRANSPOSED_CHOICE, DETERMINISTIC_TRANSPOSED_CHOICE)
        head_dim = _static_head_dim(self)
        entry = tail_entry
        if self.flexpage_dot_bf16:
            call = _known_head_dim_test(DOT_BF16_CALL, head_dim, 32)
            kernel_text = DOT_BF16_HELPERS + kernel_text.replace(KERNEL_BODY_START, KERNEL_BODY_START + call)
            rows_call = _known_head_dim_test(DOT_BF16_ROWS_CALL, head_dim, 32)
            entry = entry.replace(ENTRY_ROW_LOOP, ENTRY_ROW_LOOP + rows_call)
        if kv_dtype == torch.int8 and _compiles_avx512():
            kernel_text = INT8_KV_HELPERS + kernel_text
            entry = entry.replace(ENTRY_ROW_LOOP, ENTRY_ROW_LOOP + INT8_KV_ROWS_CALL)
        if not (_compiles_avx512() or self.flexpage_deterministic):
            call = _known_head_dim_test(AVX2_FP32_CALL, head_dim, 8)
            kernel_text = AVX2_FP32_HELPERS + kernel_text.replace(KERNEL_BODY_START, KERNEL_BODY_START + call)

        class RowBlockedGemm(stock_gemm):  # type: ignore[misc, valid-type]
            TEMPLATE_KERNEL = kernel_text
            TEMPLATE_ENTRY = entry

            def __init__(self, name, input_dtype, input2_dtype, output_dtype, compute_dtype, blocking,  # noqa: ANN001
                         *rest) -> None:  # noqa: ANN002
                if block_m is not None:
                    blocking = type(blocking)(block_m, blocking.block_n, blocking.block_k)
                super().__init__(name, input_dtype, kv_dtype, output_dtype, compute_dtype, blocking, *rest)

        cpp_micro_gemm.CppMicroGemmFP32Vec = RowBlockedGemm
        try:
            return stock_micro_gemm_define(self, kernel_name)
        finally:
            cpp_micro_gemm.CppMicroGemmFP32Vec = stock_gemm

    lowering.lowerings[hop] = flex_attention_lowering
    template_module.INIT_PARAMS = template_module.INIT_PARAMS.replace(*KV_TYPE_EDIT)
    from torch._inductor.kernel.flex import flex_cpu

    if flex_attention_module.lower_cpu is flex_cpu.lower_cpu:  # not wrapped (inductor_fix calls flex_cpu's)
        flex_attention_module.lower_cpu = kv8_lowering
    flex_cpu.lower_cpu = kv8_lowering
    template_cls.__init__ = __init__
    template_cls.choose_flex_template = choose_flex_template
    template_cls.micro_gemm_define = micro_gemm_define
    template_cls.modification = modification
    template_cls._flexpage_tuning = True
    return True


# The check in Inductor's CPU lowering of flex_attention that refuses keys of another dtype than
# the query's; the edited lowering lets 8-bit keys and values through (the flex_attention front
# end allows them already), and only the tuned template reads them (the lowering hook refuses the rest).
_STOCK_DTYPE_CHECK = "    if query.dtype != key.dtype or query.dtype != value.dtype:"
_KV8_DTYPE_CHECK = ("    if key.dtype != value.dtype or (key.dtype != query.dtype and key.dtype != torch.int8):"
                    "  # flexpage: 8-bit K/V")


def _lower_cpu_reading_8bit_kv() -> Any:
    """Inductor's ``lower_cpu`` with its dtype check widened to 8-bit keys and values, compiled
    from its own source in its own module's namespace; None where the check's text is not there."""
    import inspect

    from torch._inductor.kernel.flex import flex_cpu

    source = inspect.getsource(flex_cpu.lower_cpu)
    if source.count(_STOCK_DTYPE_CHECK) != 1 or not source.startswith("def lower_cpu("):
        return None
    namespace = dict(vars(flex_cpu))
    exec(compile(source.replace(_STOCK_DTYPE_CHECK, _KV8_DTYPE_CHECK), flex_cpu.__file__, "exec"), namespace)
    return namespace["lower_cpu"]


def installed() -> bool:
    """Whether :func:`apply` has installed the hooks in this process."""
    import torch._inductor.graph  # noqa: F401  (imports the codegen modules in an order that works)
    from torch._inductor.codegen import cpp_flex_attention_template as template_module

    return bool(getattr(template_module.CppFlexAttentionTemplate, "_flexpage_tuning", False))


def dot_bf16_option() -> str:
    """The value flexpage gives :data:`DOT_BF16_OPTION`: ``""`` (stock bf16 micro-gemms) unless
    Inductor compiles AVX-512 code for a CPU with AVX512-BF16 (and ``FLEXPAGE_BF16_DOT`` is
    not ``"0"``); there a digest of ``dot_bf16.h``, so that Inductor's cache, which keys a
    kernel by its graph and not by the code a template renders, never returns kernels built
    from another version of the helpers.

    On an AMD EPYC (Zen 4) a 48-row bf16 GQA decode call ran in 0.74-0.81x the stock
    kernel's time, and bf16 prefill rows in ~0.7x the time of the float32 copy they attended
    in before (:func:`~flexpage.attention.flex.gathered_attention_dtype`). Deterministic
    kernels keep the stock arithmetic: their rows must compute alike in any call, and the
    dot products sum in pairs, in another order than the float32 multiply-adds."""
    if not describe().dot_bf16():
        return ""
    return hashlib.sha256(DOT_BF16_SOURCE.encode()).hexdigest()[:16]


def _static_head_dim(template: Any) -> int | None:
    """The query's head dimension where the graph fixes it (else None)."""
    size = template.input_nodes[0].get_size()[-1]
    return int(size) if getattr(size, "is_number", True) else None


def _known_head_dim_test(call: str, head_dim: int | None, step: int) -> str:
    """``call`` (a micro-gemm's call of a flexpage helper, guarded by ``K % step == 0``) with the
    guard made ``true`` where the kernel's head dimension is a known multiple of ``step``.

    Why: the stock micro-gemm code after the call is then dead and g++ drops it before it
    optimises. Kept, its sixteen row-block instantiations of the stock q @ k^T made ``g++ -O3``
    of the bf16 prefill attention kernel take 12.4 s instead of 5.1 s (AMD EPYC Zen 5), on the
    critical path of a cold start."""
    test = f"K % {step} == 0"
    if call.count(test) != 1:
        raise AssertionError(f"flexpage: the micro-gemm call lost its test {test!r}")
    return call.replace(test, "true") if head_dim is not None and head_dim % step == 0 else call


def _is_reduced(template: Any) -> bool:
    """P@V through the micro-gemm and row blocking are for bf16/fp16 only: for float32
    ``cpublas::brgemm`` is a fast sgemm and row blocking does not pay (measured,
    docs/attention-benchmark.md)."""
    return template.input_nodes[0].get_dtype() in (torch.bfloat16, torch.float16)


# In AVX2 code a load of int64 vectors given a count (ATen's ``Vectorized<int64_t>::loadu(ptr,
# count)``) copies the elements through a stack buffer even when the count fills the vector, and
# the wide load that follows stalls on the narrower stores (store forwarding). Inductor's mask and
# score code loads the key indices that way in its main loop, with the loop's full width: on an
# AMD EPYC (Zen 3) those loads were ~10% of a 4 x 256 float32 prefill call. A full-width count
# means the plain load, which is what the tuned kernels get.
_FULL_INT64_LOAD = re.compile(r"(at::vec::VectorizedN<int64_t,(\d+)>::loadu\([^;]*?), static_cast<int64_t>\((\d+)L?\)\)(?=;)")
_INT64_LANES_AVX2 = 4


def _full_int64_loads(code: str) -> str:
    """``code`` (AVX2 mask or score code) with full-width counted int64 loads made plain loads."""
    def plain(match: re.Match) -> str:
        vectors, count = int(match.group(2)), int(match.group(3))
        if count != vectors * _INT64_LANES_AVX2 or not _closes_at_end(match.group(0)):
            return match.group(0)
        return match.group(1) + ")"

    return _FULL_INT64_LOAD.sub(plain, code)


def _closes_at_end(call: str) -> bool:
    """Whether the first parenthesis of ``call`` closes at its last character (the count is the
    load's own last argument, not some later call's)."""
    depth = 0
    for at in range(call.index("("), len(call)):
        depth += {"(": 1, ")": -1}.get(call[at], 0)
        if depth == 0:
            return at == len(call) - 1
    return False


def _rows_blocked(template: Any) -> bool:
    """Micro-gemms block ``min(query block rows, 16)`` rows: in AVX-512 code for bf16/fp16,
    and for float32 prefill query blocks (there the stock one-row blocking reloads each key
    tile per row). In AVX2 code for float32 prefill query blocks only, whose q @ k^T then
    runs on ``avx2_fp32.h``; AVX2 bf16/fp16 kernels stay stock. (Deterministic kernels
    decide in ``micro_gemm_define``.)"""
    prefill = int(template.q_block_size) >= _MIN_FP32_BLOCKED_ROWS
    if _compiles_avx512():
        return _is_reduced(template) or prefill
    return prefill and template.input_nodes[0].get_dtype() == torch.float32


def _compiles_avx512() -> bool:
    return describe().compiles_avx512()  # VecAVX512 and its subclasses (VNNI, AMX)


def packs_for_amx(dtype: torch.dtype) -> bool:
    """Whether kernels for ``dtype`` on this CPU run their products on the AMX brgemm over
    packed K/V (:meth:`~flexpage.backends.cpu.description.CPUDescription.packs_for_amx`)."""
    return describe().packs_for_amx(dtype)


def _is_identity(score_mod: Any) -> bool:
    """Whether a lowered score-mod subgraph returns its score unchanged (flex_attention's default)."""
    graph = getattr(getattr(score_mod, "graph_module", None), "graph", None)
    if graph is None:
        return False
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    (output,) = [node for node in graph.nodes if node.op == "output"]
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    return bool(placeholders) and result is placeholders[0]


def _sized(node: Any) -> SimpleNamespace:
    """A stand-in exposing ``node``'s size where the stock template chooser looks for it."""
    return SimpleNamespace(data=SimpleNamespace(data=SimpleNamespace(layout=SimpleNamespace(size=node.get_size()))))
