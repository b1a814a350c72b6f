"""Work around a name clash in PyTorch's CPU FlexAttention template (torch 2.13/2.14).

``CppFlexAttentionTemplate.modification`` turns the size symbols of the runtime block
sizes back into ``cur_qSplitSize``/``cur_kvSplitSize`` with a plain ``str.replace``. When
the kernel also uses a size variable whose name extends that symbol's name (``ks1`` and
``ks18``), the replace corrupts the longer one and the generated C++ does not compile
("'cur_kvSplitSize8' was not declared"). Paged mask mods index per-row tables, which adds
enough size variables to hit this. The fix repeats the same substitution with word
boundaries. It is applied once, on import, and only touches that one method.
"""

from __future__ import annotations

import re

import sympy


def apply() -> None:
    import torch._inductor.graph  # noqa: F401  (imports the codegen modules in an order that works)
    from torch._inductor.codegen import cpp as cpp_codegen
    from torch._inductor.codegen.cpp_flex_attention_template import CppFlexAttentionTemplate

    original = CppFlexAttentionTemplate.modification
    if getattr(original, "_flexpage_fixed", False):
        return

    def modification(self, subgraph_buffer, output_name, output_idx):  # type: ignore[no-untyped-def]
        created = []
        kernel_group_cls = cpp_codegen.KernelGroup

        class RecordingKernelGroup(kernel_group_cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                super().__init__(*args, **kwargs)
                created.append(self)

        block_vars = self.block_vars
        # symbols that never occur, so the original's str.replace finds nothing to corrupt
        self.block_vars = (sympy.Symbol("flexpage_unused_q"), sympy.Symbol("flexpage_unused_kv"))
        cpp_codegen.KernelGroup = RecordingKernelGroup
        try:
            code = original(self, subgraph_buffer, output_name, output_idx)
        finally:
            cpp_codegen.KernelGroup = kernel_group_cls
            self.block_vars = block_vars
        sizevars = created[-1].args.sizevars
        for symbol, runtime_name in zip(block_vars, ("cur_qSplitSize", "cur_kvSplitSize")):
            if symbol in sizevars:
                code = re.sub(rf"\b{re.escape(sizevars[symbol])}\b", runtime_name, code)
        return code

    modification._flexpage_fixed = True  # type: ignore[attr-defined]
    CppFlexAttentionTemplate.modification = modification
