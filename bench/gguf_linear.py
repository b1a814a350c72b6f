"""Projections from GGUF blocks vs oneDNN's packed float32 (and bf16), per row count: is
``flexpage::block_linear`` as fast at every row count (so a projection need not keep both)?

    python -m bench.gguf_linear [--rows 1 2 3 4 6 8 16] [--reps 15] [--rounds 3]
    python -m bench.gguf_linear --gguf FILE [--rows 1 2 4] [--dtype bfloat16]

One forward's projections of the default model (SmolLM2-135M-Instruct's GGUF: 30 layers of
Q4_1 q|k|v, o, gate|up and down, fused as the engine fuses them, and the Q8_0 embedding as
the LM head): the blocks as the kernel reads them against the same weights expanded to
float32 and packed for oneDNN. Each round times
both back to back (median of ``--reps`` forwards each); the table shows the median over
rounds, their ratio, and each path's largest error against a float64 product of the same
float32 weights. Where the engine's default dtype is bfloat16 (``default_dtype``), the same
weights packed for oneDNN in bfloat16 are timed too, against bf16 rows computed from the blocks
(the bf16 panels where the CPU has AVX512-BF16: what such a CPU without AMX runs by default).
With ``--gguf FILE`` (any Llama-shaped GGUF of Q4_0/Q4_1/Q8_0 layers, e.g. bench.llama1b's
1B Q4_0) it times the block kernel alone on one forward's projections and LM head, all of
them from memory, against the read floor: the blocks' bytes over the read bandwidth measured
in the same run (bench.anchors' measure). Prints a table; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from bench.packed_linear import median_us
from flexpage.model import gguf_linear
from flexpage.model.dtypes import default_dtype
from flexpage.model.gguf_file import gguf_tensors
from flexpage.model.loader import _default_gguf_path

#: GGUF tensor kinds fused into one projection, in the engine's order
FUSED = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def load_projections() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(kernel blocks, packed float32 weight, float32 weight) of every fused projection and the LM head."""
    by_layer: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    fused: list[tuple[str, torch.Tensor]] = []
    for tensor in gguf_tensors(_default_gguf_path()):
        parts, kind = tensor.name.split("."), tensor.type_name
        if kind not in gguf_linear.GGUF_BLOCK_BYTES:
            continue
        raw = torch.from_numpy(tensor.data.copy()).reshape(tensor.shape[0], -1)
        if kind == "Q4_1" and parts[0] == "blk":
            by_layer[parts[1]][parts[2]] = raw
        elif kind == "Q8_0" and tensor.name == "token_embd.weight":
            fused.append((kind, raw))
    fused += [("Q4_1", torch.cat([layer[name] for name in names])) for layer in by_layer.values() for names in FUSED]
    projections = []
    for kind, raw in fused:
        weight = gguf_linear.expand(kind, raw)
        projections.append((gguf_linear.repack(kind, raw), torch.ops.mkldnn._reorder_linear_weight(weight, 64), weight))
    return projections


def gguf_forward_blocks(path: str) -> list[tuple[torch.Tensor, int]]:
    """(kernel blocks, in_features) of every fused projection of a GGUF's layers and of its LM
    head (the embedding where the head is tied), as the engine reads them."""
    by_layer: dict[str, dict[str, tuple[str, torch.Tensor]]] = defaultdict(dict)
    head = None
    for tensor in gguf_tensors(path):
        if tensor.type_name not in gguf_linear.KERNEL_KIND:
            continue
        raw = (tensor.type_name, torch.from_numpy(tensor.data.copy()).reshape(tensor.shape[0], -1))
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            by_layer[parts[1]][parts[2]] = raw
        elif tensor.name == "output.weight" or (tensor.name == "token_embd.weight" and head is None):
            head = raw
    assert head is not None, f"{path} has no LM head or embedding in a block format"
    fused = [head]
    for layer in by_layer.values():
        for names in FUSED:
            kinds = {layer[name][0] for name in names}
            assert len(kinds) == 1, f"{names} mix {kinds}: the engine would not fuse them"
            fused.append((kinds.pop(), torch.cat([layer[name][1] for name in names])))
    blocks = [(gguf_linear.KERNEL_KIND[kind], gguf_linear.repack(kind, raw)) for kind, raw in fused]
    return [(b, b.shape[1] // gguf_linear.BLOCK_BYTES[kind] * 32) for kind, b in blocks]


def time_gguf(path: str, rows_list: list[int], dtype: torch.dtype, reps: int, rounds: int) -> None:
    from bench.anchors import read_bandwidth_gbs

    blocks = gguf_forward_blocks(path)
    total = sum(b.numel() for b, _ in blocks)
    bandwidth = read_bandwidth_gbs()
    floor_ms = total / bandwidth / 1e6
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}; {path}: {len(blocks)} projections,"
          f" {total / 1e6:.0f} MB of blocks; read bandwidth {bandwidth:.1f} GB/s, floor {floor_ms:.1f} ms")
    print(f"{'rows':>4} {'ms':>8} {'GB/s':>7} {'x floor':>8}")
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, dtype=dtype) for _, k in blocks}

        def forward() -> None:
            for b, k in blocks:
                gguf_linear.block_linear(inputs[k], b)

        ms = statistics.median(median_us(forward, reps) for _ in range(rounds)) / 1e3
        print(f"{rows:>4} {ms:>8.1f} {total / ms / 1e6:>7.1f} {ms / floor_ms:>8.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gguf", help="time the block kernel on this GGUF's projections against the read floor")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="with --gguf: the inputs' dtype (default: the engine's default dtype here)")
    args = parser.parse_args()
    if not gguf_linear.available():
        raise SystemExit("the block kernel is not available on this machine (needs x86 AVX2/FMA/F16C and a compiler)")
    if args.gguf:
        dtype = getattr(torch, args.dtype) if args.dtype else default_dtype()
        return time_gguf(args.gguf, args.rows, dtype, args.reps, args.rounds)
    torch.manual_seed(0)
    projections = load_projections()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(projections)} projections, "
          f"{sum(b.numel() for b, _, _ in projections) / 1e6:.0f} MB of blocks, "
          f"{sum(w.numel() * 4 for _, _, w in projections) / 1e6:.0f} MB of float32")
    bf16 = ([torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64) for _, _, w in projections]
            if default_dtype() == torch.bfloat16 else None)
    print(f"{'rows':>4} {'blocks ms':>10} {'packed ms':>10} {'blocks/packed':>14} {'blocks err':>11} {'packed err':>11}"
          + (f" {'bf16 ms':>8} {'bf16 blocks ms':>15} {'bf16 blocks/bf16':>17}" if bf16 else ""))
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for _, _, w in projections}}
        bf16_inputs = {k: x.bfloat16() for k, x in inputs.items()}

        def from_blocks() -> None:
            for blocks, _, weight in projections:
                gguf_linear.block_linear(inputs[weight.shape[1]], blocks)

        def from_packed() -> None:
            for _, packed, weight in projections:
                torch.ops.mkldnn._linear_pointwise(inputs[weight.shape[1]], packed, None, "none", [], "")

        def from_bf16() -> None:
            for packed, (_, _, weight) in zip(bf16, projections):
                torch.ops.mkldnn._linear_pointwise(bf16_inputs[weight.shape[1]], packed, None, "none", [], "")

        def from_bf16_blocks() -> None:
            for blocks, _, weight in projections:
                gguf_linear.block_linear(bf16_inputs[weight.shape[1]], blocks)

        timed = [from_blocks, from_packed] + ([from_bf16, from_bf16_blocks] if bf16 else [])
        rounds = [[median_us(fn, args.reps) for fn in timed] for _ in range(args.rounds)]
        blocks_us, packed_us, *bf16_us = (statistics.median(t) for t in zip(*rounds))
        bf16_columns = (f" {bf16_us[0] / 1e3:>8.1f} {bf16_us[1] / 1e3:>15.1f} {bf16_us[1] / bf16_us[0]:>17.2f}"
                        if bf16_us else "")
        errors = [0.0, 0.0]
        for blocks, packed, weight in projections[:4]:
            x = inputs[weight.shape[1]]
            reference = x.double() @ weight.double().T
            results = (gguf_linear.block_linear(x, blocks),
                       torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            errors = [max(e, (r.double() - reference).abs().max().item()) for e, r in zip(errors, results)]
        print(f"{rows:>4} {blocks_us / 1e3:>10.1f} {packed_us / 1e3:>10.1f} {blocks_us / packed_us:>14.2f} "
              f"{errors[0]:>11.1e} {errors[1]:>11.1e}" + bf16_columns, flush=True)

if __name__ == "__main__":
    main()
