"""Let Inductor compile graphs that call oneDNN's packed linear on weights passed in as inputs.

flexpage's projections run ``mkldnn._linear_pointwise`` on weights packed once for oneDNN
(:mod:`flexpage.model.packed_linear`). Inductor lowers that op only for weights that are
graph constants (its ``freezing`` pass packs them itself) and asserts otherwise; its
pattern matcher also fuses a following activation or ``add`` into the oneDNN call, which
rounds bf16 differently from the eager ops and (``add``) fails to lower. The compiled step
(:mod:`flexpage.model.compiled_step`) passes the packed weights as inputs, so that one graph
serves every layer. For such weights this patch makes the op an extern call of the same
kernel eager code runs, and keeps the pattern matcher from fusing into it; graphs with
constant weights lower and fuse as before. Installed by
:func:`flexpage.backends.cpu.torch_patches.install`.
"""

from __future__ import annotations

from typing import Any

import torch


def apply() -> None:
    from torch._inductor import lowering, mkldnn_lowerings  # noqa: F401  (registers the oneDNN lowerings)
    from torch._inductor.fx_passes import mkldnn_fusion
    from torch._inductor.virtualized import V

    unary = torch.ops.mkldnn._linear_pointwise.default
    if getattr(lowering.lowerings[unary], "_flexpage_patched", False):
        return
    stock_lowering = lowering.lowerings[unary]
    extern_linear = lowering.fallback_handler(unary, add_to_fallback_set=False)

    def lower(x: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
        if weight.get_name() in V.graph.constants:
            return stock_lowering(x, weight, *args, **kwargs)
        return extern_linear(x, weight, *args, **kwargs)

    stock_check = mkldnn_fusion._is_single_computation_op

    def fusable_computation(computation_op: Any, lowp_dtype: Any = None) -> Any:
        """The matcher's check that a match holds one unfused computation, plus: a linear's
        weight is a constant (a ``get_attr`` node), not a graph input."""
        check = stock_check(computation_op, lowp_dtype)

        def fn(match: Any) -> bool:
            linears = [n for n in match.nodes if n.target is unary]
            return check(match) and all(n.args[1].op == "get_attr" for n in linears)

        return fn

    lower._flexpage_patched = True  # type: ignore[attr-defined]
    lowering.lowerings[unary] = lower
    # read when the fusion patterns are registered (at the first compile) and when the binary
    # ones are checked: a process that compiled before the patch keeps unary fusions, which
    # lower through ``lower`` (same kernel, activation applied by oneDNN)
    mkldnn_fusion._is_single_computation_op = fusable_computation
