"""An opt-in tuning of PyTorch's CPU FlexAttention template for paged decode (torch 2.13).

The CPU template visits one (row, head, key block) at a time. For the small query blocks
of paged decode (one token's ``G`` packed query heads: 1-8 rows) two of its choices cost
more than the attention itself (``perf`` of a batch-64 GQA decode call: 28% in MKL's
generic bf16 gemm, 22% in the q@k^T micro-gemm):

- ``P @ V`` goes through ``cpublas::brgemm``, which for unpacked bf16 falls back to a full
  MKL gemm call per key block (converting to fp32 inside). The template already has a
  micro-gemm for it (its fp16 path uses it); the tuned template uses it for bf16 too.
- Its micro-gemms block one query row at a time (``GemmBlocking(1, 16, 1)``), so each key
  tile is reloaded for every row. The tuned template blocks ``min(query block rows, 8)``
  rows, which keeps the whole query block in registers for decode.

Together 1.5-3x faster bf16 decode calls (``bench/attention.py``,
docs/attention-benchmark.md), identical numerics up to float summation order. float32
kernels keep the stock template (brgemm is a fast sgemm there; both changes measured slower).

Only kernels compiled with ``kernel_options={TUNED_OPTION: TUNING_VERSION}`` get the tuned
template (flexpage always passes it); everything else in the process, including PyTorch's
experimental ``PagedAttention`` our benchmark compares against, stays stock. The option is
part of the compiled graph, so Inductor's cache keys tuned and stock kernels apart -- and
kernels of an older tuning: bump ``TUNING_VERSION`` whenever the tuning changes.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

TUNED_OPTION = "FLEXPAGE_TUNED_CPU_TEMPLATE"
TUNING_VERSION = 2  # 2: float32 kernels stay stock
_MAX_BLOCK_M = 8
_STOCK_PV_BRANCH = "          if (!std::is_same_v<scalar_t, at::Half>) {\n            at::native::cpublas::brgemm("
_TUNED_PV_BRANCH = "          if (false) {  // flexpage: P@V through the micro-gemm\n            at::native::cpublas::brgemm("

# set while flex_attention is lowered, read when the lowering constructs its template
_lowering_tuned: contextvars.ContextVar[bool] = contextvars.ContextVar("flexpage_tuned", default=False)


def apply() -> None:
    """Install the hooks once; a no-op (stock kernels, still correct) if PyTorch's template changed."""
    import torch._inductor.graph  # noqa: F401  (imports the codegen modules in an order that works)
    from torch._inductor import lowering
    from torch._inductor.codegen import cpp_flex_attention_template as template_module
    from torch._inductor.codegen import cpp_micro_gemm

    template_cls = template_module.CppFlexAttentionTemplate
    if getattr(template_cls, "_flexpage_tuning", False):
        return
    stock_template = template_module.FLEX_ATTENTION_TEMPLATE
    if stock_template.count(_STOCK_PV_BRANCH) != 1:
        return
    tuned_template = stock_template.replace(_STOCK_PV_BRANCH, _TUNED_PV_BRANCH)

    hop = torch.ops.higher_order.flex_attention
    stock_lowering = lowering.lowerings[hop]

    def flex_attention_lowering(*args: Any, **kwargs: Any) -> Any:
        kernel_options = args[6] if len(args) > 6 else kwargs.get("kernel_options", {})
        token = _lowering_tuned.set(bool(kernel_options.get(TUNED_OPTION, False)))
        try:
            return stock_lowering(*args, **kwargs)
        finally:
            _lowering_tuned.reset(token)

    stock_init = template_cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        stock_init(self, *args, **kwargs)
        self.flexpage_tuned = _lowering_tuned.get()  # templates are rendered after lowering returns

    stock_choose = template_cls.choose_flex_template

    def choose_flex_template(self, *args: Any, **kwargs: Any) -> str:
        chosen = stock_choose(self, *args, **kwargs)
        return tuned_template if _is_tuned(self) and chosen is stock_template else chosen

    stock_micro_gemm_define = template_cls.micro_gemm_define

    def micro_gemm_define(self, kernel_name: str) -> str:
        if not _is_tuned(self):
            return stock_micro_gemm_define(self, kernel_name)
        stock_gemm = cpp_micro_gemm.CppMicroGemmFP32Vec
        block_m = max(1, min(int(self.q_block_size), _MAX_BLOCK_M))

        class RowBlockedGemm(stock_gemm):  # type: ignore[misc, valid-type]
            def __init__(self, name, input_dtype, input2_dtype, output_dtype, compute_dtype, blocking,  # noqa: ANN001
                         *rest) -> None:  # noqa: ANN002
                blocking = type(blocking)(block_m, blocking.block_n, blocking.block_k)
                super().__init__(name, input_dtype, input2_dtype, output_dtype, compute_dtype, blocking, *rest)

        cpp_micro_gemm.CppMicroGemmFP32Vec = RowBlockedGemm
        try:
            return stock_micro_gemm_define(self, kernel_name)
        finally:
            cpp_micro_gemm.CppMicroGemmFP32Vec = stock_gemm

    lowering.lowerings[hop] = flex_attention_lowering
    template_cls.__init__ = __init__
    template_cls.choose_flex_template = choose_flex_template
    template_cls.micro_gemm_define = micro_gemm_define
    template_cls._flexpage_tuning = True


def _is_tuned(template: Any) -> bool:
    """float32 keeps the stock template: there ``cpublas::brgemm`` is a fast sgemm and row
    blocking does not pay (measured, docs/attention-benchmark.md)."""
    reduced = template.input_nodes[0].get_dtype() in (torch.bfloat16, torch.float16)
    return getattr(template, "flexpage_tuned", False) and reduced
