"""Work around two bugs in PyTorch's CPU FlexAttention lowering (torch 2.13/2.14).

1. A name clash in the template (below).
2. Tensors a mask or score mod reads (``score_mod_other_buffers``/``mask_mod_other_buffers``)
   that the same graph computes (e.g. a row's start position from a padding mask, when the
   whole model is one compiled graph) reach the template unrealised, and it fails to find a
   kernel (``NoValidChoicesError``; inside: ``NotImplementedError: Pointwise``): the lowering
   lists them as the template's buffers before realising them. :func:`apply` realises them
   first.

The name clash:

``CppFlexAttentionTemplate.modification`` turns the size symbols of the runtime block
sizes back into ``cur_qSplitSize``/``cur_kvSplitSize`` with a plain ``str.replace``. When
the kernel also uses a size variable whose name extends that symbol's name (``ks1`` and
``ks18``), the replace corrupts the longer one and the generated C++ does not compile
("'cur_kvSplitSize8' was not declared"). Paged mask mods index per-row tables, which adds
enough size variables to hit this. Worse, the block-size symbols get names ``ks{count}``
that can equal the ``k{symbol}`` name of a size variable the template registered first
(``ks6`` twice), so even an exact substitution rewrites the wrong bound. The fix names the
two block-size symbols uniquely up front and substitutes those names with word boundaries.
It only touches that one method, and is installed by :func:`flexpage.backends.cpu.torch_patches.install`.
"""

from __future__ import annotations

import re

import sympy


def apply() -> None:
    import torch._inductor.graph  # noqa: F401  (imports the codegen modules in an order that works)
    from torch._inductor.codegen import cpp as cpp_codegen
    from torch._inductor.codegen.cpp_flex_attention_template import CppFlexAttentionTemplate

    _realise_captured_buffers_first()
    original = CppFlexAttentionTemplate.modification
    if getattr(original, "_flexpage_fixed", False):
        return

    def modification(self, subgraph_buffer, output_name, output_idx):  # type: ignore[no-untyped-def]
        kernel_group_cls = cpp_codegen.KernelGroup

        block_vars = self.block_vars
        unique_names = ("flexpage_cur_q_split_size", "flexpage_cur_kv_split_size")

        class RecordingKernelGroup(kernel_group_cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                super().__init__(*args, **kwargs)
                # name the block-size symbols up front: KernelArgs would call them ks{len(sizevars)},
                # which can equal the k{symbol} name of a size variable the template pre-registers
                for symbol, unique in zip(block_vars, unique_names):
                    self.args.sizevars[symbol] = unique

        # symbols that never occur, so the original's str.replace finds nothing to corrupt
        self.block_vars = (sympy.Symbol("flexpage_unused_q"), sympy.Symbol("flexpage_unused_kv"))
        cpp_codegen.KernelGroup = RecordingKernelGroup
        try:
            code = original(self, subgraph_buffer, output_name, output_idx)
        finally:
            cpp_codegen.KernelGroup = kernel_group_cls
            self.block_vars = block_vars
        for unique, runtime_name in zip(unique_names, ("cur_qSplitSize", "cur_kvSplitSize")):
            code = re.sub(rf"\b{unique}\b", runtime_name, code)
        return code

    modification._flexpage_fixed = True  # type: ignore[attr-defined]
    CppFlexAttentionTemplate.modification = modification


def _realise_captured_buffers_first() -> None:
    from torch._inductor.kernel.flex import flex_attention as lowering
    from torch._inductor.kernel.flex import flex_cpu
    from torch._inductor.kernel.flex.common import maybe_realize

    if getattr(lowering.lower_cpu, "_flexpage_fixed", False):
        return

    def lower_cpu(query, key, value, subgraph, block_mask, scale, kernel_options,  # type: ignore[no-untyped-def]
                  score_mod_other_buffers, mask_mod_other_buffers):
        # flex_cpu's own at call time: template_tuning replaces it (8-bit K/V)
        return flex_cpu.lower_cpu(query, key, value, subgraph, block_mask, scale, kernel_options,
                                  maybe_realize(list(score_mod_other_buffers)),
                                  maybe_realize(list(mask_mod_other_buffers)))

    lower_cpu._flexpage_fixed = True  # type: ignore[attr-defined]
    lowering.lower_cpu = lower_cpu
