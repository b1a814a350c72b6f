"""Should a dtype's weights be pre-packed for oneDNN on this CPU? Plain ``F.linear`` against oneDNN's
packed linear, SmolLM2-135M's projection shapes, per row count.

    python -m bench.packed_linear [--dtypes float32 bfloat16] [--reps 30]

``flexpage.model.packed_linear.can_prepack`` packs bf16 weights only. This measures what packing
would give each dtype on the machine at hand (weights packed once for a 64-row batch, as
``PackedLinear`` does): median time of each projection and of one forward's worth of them (30
layers' q|k|v, o, gate|up and down, plus the LM head over the rows), and the largest difference
between the two results. Prints a table; nothing is written.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.throughput import median_ms

#: (output, input) features of SmolLM2-135M's projections; the per-layer ones run 30 times a forward
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30
ROWS = (1, 2, 8, 16, 48, 64, 256, 1024)
BATCH_HINT = 64


def median_us(fn: Callable[[], object], reps: int) -> float:
    """Median of ``reps`` calls after three warm-up calls (the first builds oneDNN's kernel)."""
    for _ in range(3):
        fn()
    return median_ms(fn, reps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, oneDNN bf16: "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print(f"{'dtype':<9} {'rows':>5} {'plain ms':>9} {'packed ms':>10} {'packed/plain':>13} {'max |diff|':>11}")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            print(f"{name:<9} skipped: this CPU's oneDNN has no bf16 kernels")
            continue
        for rows in ROWS:
            plain_total = packed_total = worst = 0.0
            for shape, (out_features, in_features) in SHAPES.items():
                weight = (torch.randn(out_features, in_features) * 0.05).to(dtype)
                x = torch.randn(rows, in_features).to(dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
                worst = max(worst, (F.linear(x, weight).float() - torch.ops.mkldnn._linear_pointwise(
                    x, packed, None, "none", [], "").float()).abs().max().item())
                times = LAYERS if shape != "lm_head" else 1
                plain_total += times * median_us(lambda: F.linear(x, weight), args.reps)
                packed_total += times * median_us(
                    lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), args.reps)
            print(f"{name:<9} {rows:>5} {plain_total / 1e3:>9.1f} {packed_total / 1e3:>10.1f} "
                  f"{packed_total / plain_total:>13.2f} {worst:>11.1e}", flush=True)


if __name__ == "__main__":
    main()
