"""What deterministic mode's row tile costs: one forward's worth of SmolLM2-135M's projections
run in calls of a fixed number of rows (``PackedLinear(row_tile=...)``) against one call each.

    python -m bench.row_tiles [--dtype bfloat16] [--tiles 16 32 64] [--reps 7]

Deterministic mode (docs/deterministic.md) multiplies every projection in calls of exactly
``DETERMINISTIC_ROW_TILE`` rows, zero-padded: a small tile wastes little on a decode step of a
few rows, a large one makes fewer calls in a prefill. Prints the median milliseconds per row
count (30 layers' projections plus the LM head over up to 48 sampled rows) and each tile's
ratio to untiled calls; nothing is written.
"""

from __future__ import annotations

import argparse

import torch

from bench.packed_linear import LAYERS, SHAPES, median_us
from flexpage.model.packed_linear import PackedLinear

ROWS = (1, 8, 48, 512)
#: the LM head runs over the sampled rows only: at most a decode batch's
SAMPLED = 48


def forward_ms(row_tile: int | None, rows: int, dtype: torch.dtype, reps: int) -> float:
    total = 0.0
    for shape, (out_features, in_features) in SHAPES.items():
        linear = PackedLinear((torch.randn(out_features, in_features) * 0.05).to(dtype), row_tile=row_tile)
        x = torch.randn(min(rows, SAMPLED) if shape == "lm_head" else rows, in_features).to(dtype)
        total += (1 if shape == "lm_head" else LAYERS) * median_us(lambda: linear(x), reps)
    return total / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiles", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; ms (tiled / untiled)")
    print(f"{'row tile':>9} " + " ".join(f"{f'{rows} rows':>18}" for rows in ROWS))
    untiled = {rows: forward_ms(None, rows, dtype, args.reps) for rows in ROWS}
    print(f"{'none':>9} " + " ".join(f"{untiled[rows]:>18.1f}" for rows in ROWS), flush=True)
    for tile in args.tiles:
        cells = []
        for rows in ROWS:
            ms = forward_ms(tile, rows, dtype, args.reps)
            cells.append(f"{ms:>9.1f} ({ms / untiled[rows]:.2f}x)")
        print(f"{tile:>9} " + " ".join(f"{cell:>18}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
