"""Paged prefill attention against contiguous SDPA, and against the size of the KV pool.

Run from the repository root (the venv active)::

    python -m bench.prefill                  # every row, bf16 and fp32: ~3 min warm, ~8 min cold
    python -m bench.prefill --dtypes bfloat16 --reps 5
    python -m bench.prefill --engine         # also LLM.generate on the default model, both pool sizes

The question: does a prefill through flexpage's paged kernel cost what the same attention
costs on contiguous tensors, whatever the size of the pool it reads from? Each row is one
step of prefill chunks (``new`` tokens per sequence after ``cached`` tokens already in the
pool), laid out as the engine lays it out (16-token pages in aligned runs read as the
dtype's key block, at random places in the pool), run through the compiled ``FlexRunner``
with a small and a large pool (same live blocks) and through
``F.scaled_dot_product_attention`` on contiguous ``[B, H, L, D]`` tensors (``is_causal``
without a cached prefix, a bottom-right causal mask with one), interleaved repetition by
repetition. Every flexpage output is checked against SDPA in float32 first. The table
prints medians and ratios; ``bench/results/prefill.json`` holds every sample summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

DEFAULT_OUT = os.path.join("bench", "results", "prefill.json")
PAGE_SIZE = 16
MiB = 1 << 20


@dataclass(frozen=True)
class PrefillCase:
    name: str
    seqs: int
    new: int  # new tokens per sequence this step
    cached: int  # tokens per sequence already in the pool
    heads: int
    kv_heads: int
    head_dim: int = 64


CASES = (
    PrefillCase("4x256 MHA", 4, 256, 0, 8, 8),
    PrefillCase("4x256 GQA", 4, 256, 0, 9, 3),  # SmolLM2-135M's heads
    PrefillCase("4x512 MHA", 4, 512, 0, 8, 8),
    PrefillCase("1x1024 GQA", 1, 1024, 0, 9, 3),
    PrefillCase("1x1024 after 1024 GQA", 1, 1024, 1024, 9, 3),
    PrefillCase("1x256 after 3840 GQA", 1, 256, 3840, 9, 3),  # a chunked prefill against a long prefix
)


def summarize(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    med = statistics.median(ms)
    return {"median_ms": med, "min_ms": ms[0], "p25_ms": q[0], "p75_ms": q[2], "iqr_rel": (q[2] - q[0]) / med, "n": len(ms)}


def time_interleaved(fns: dict[str, Callable[[], Any]], reps: int, warmup: int) -> dict[str, dict[str, float]]:
    """Each repetition calls every function once, the order alternating, so noise hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - t0)
    return {name: summarize(s) for name, s in samples.items()}


class PagedPrefill:
    """One case's K/V placed in a pool of ``pool_bytes`` (K and V together) as the engine places it."""

    def __init__(self, case: PrefillCase, k, v, q, dtype, pool_bytes: int, seed: int) -> None:  # noqa: ANN001
        import torch

        from flexpage.attention.kv_pool import KVPool, write_kv
        from flexpage.attention.paging import build_paged_batch
        from flexpage.attention.recipe import CAUSAL
        from flexpage.config import default_attention_block_size

        run = default_attention_block_size(dtype) // PAGE_SIZE  # pages per kernel key block
        token_bytes = 2 * case.kv_heads * case.head_dim * dtype.itemsize
        num_pages = pool_bytes // (token_bytes * PAGE_SIZE) // run * run
        total = case.cached + case.new
        runs_per_seq = -(-total // (PAGE_SIZE * run))
        gen = torch.Generator().manual_seed(seed)
        # each sequence gets aligned runs at random places (run 0 holds the null page 0)
        free_runs = torch.randperm(num_pages // run - 1, generator=gen)[: case.seqs * runs_per_seq] + 1
        pages = (free_runs.view(case.seqs, runs_per_seq, 1) * run + torch.arange(run)).view(case.seqs, -1)
        table = pages[:, : -(-total // PAGE_SIZE)].int()
        self.pool = KVPool(num_layers=1, num_blocks=num_pages, block_size=PAGE_SIZE, num_kv_heads=case.kv_heads,
                           head_dim=case.head_dim, dtype=dtype)
        self.k_pool, self.v_pool = self.pool.layer(0)
        seq_lens = torch.full((case.seqs,), total, dtype=torch.int32)
        positions = torch.arange(total)
        slots = (table.long()[:, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE).reshape(-1)
        write_kv(self.k_pool, self.v_pool, slots, k.transpose(1, 2).reshape(-1, case.kv_heads, case.head_dim),
                 v.transpose(1, 2).reshape(-1, case.kv_heads, case.head_dim))
        self.batch = build_paged_batch(table, seq_lens, torch.full((case.seqs,), case.new, dtype=torch.int32),
                                       page_size=PAGE_SIZE, num_pages=num_pages, recipe=CAUSAL, pages_per_block=run)
        self.q_flat = q.transpose(1, 2).reshape(case.seqs * case.new, case.heads, case.head_dim).contiguous()
        self.pool_bytes = num_pages * PAGE_SIZE * token_bytes

    def __call__(self, runner):  # noqa: ANN001, ANN204
        return runner(self.q_flat, self.k_pool, self.v_pool, self.batch)


def rel_err(out, ref) -> float:  # noqa: ANN001
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def run_case(case: PrefillCase, dtype_name: str, pools: tuple[int, int], reps: int, warmup: int) -> dict:
    import torch
    import torch.nn.functional as F

    from flexpage.attention.flex import FlexRunner, raised_compile_limits
    from flexpage.attention.recipe import CAUSAL

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(7)
    total = case.cached + case.new
    k = torch.randn(case.seqs, case.kv_heads, total, case.head_dim, generator=gen).to(dtype)
    v = torch.randn(case.seqs, case.kv_heads, total, case.head_dim, generator=gen).to(dtype)
    q = torch.randn(case.seqs, case.heads, case.new, case.head_dim, generator=gen).to(dtype)
    mask = None
    if case.cached:  # bottom-right aligned causal: query i sits at position cached + i
        mask = torch.arange(total)[None, :] <= (case.cached + torch.arange(case.new))[:, None]

    def sdpa():  # noqa: ANN202
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                               is_causal=mask is None, enable_gqa=True)
    runner = FlexRunner(CAUSAL)
    small, large = (PagedPrefill(case, k, v, q, dtype, size, seed=11) for size in pools)
    fns: dict[str, Callable[[], Any]] = {"flex_small_pool": lambda: small(runner), "flex_large_pool": lambda: large(runner),
                                          "sdpa": sdpa}
    with torch.inference_mode(), raised_compile_limits():
        first_call_ms = {}
        for name, paged in (("flex_small_pool", small), ("flex_large_pool", large)):
            t0 = time.perf_counter()
            out = paged(runner)
            first_call_ms[name] = (time.perf_counter() - t0) * 1e3
            out = out.view(case.seqs, case.new, case.heads, case.head_dim).transpose(1, 2)
            err = rel_err(out, reference)
            if not err < {"float32": 1e-4, "bfloat16": 3e-2}[dtype_name]:
                raise SystemExit(f"CORRECTNESS FAILURE: {case.name} {dtype_name} {name}: relative error {err:.3g}")
        timings = time_interleaved(fns, reps, warmup)
    flex, flex_large, base = (timings[n]["median_ms"] for n in ("flex_small_pool", "flex_large_pool", "sdpa"))
    return {
        **asdict(case), "dtype": dtype_name, "pool_bytes": {"small": small.pool_bytes, "large": large.pool_bytes},
        "first_call_ms": first_call_ms, "timings": timings, "flex_ms": flex, "flex_large_pool_ms": flex_large,
        "sdpa_ms": base, "flex_over_sdpa": flex / base, "large_over_small_pool": flex_large / flex,
        "noise": max(t["iqr_rel"] for t in timings.values()),
    }


def run_engine(pools_mib: tuple[int, int], reps: int) -> dict:
    """The issue's end-to-end view: a 4 x 256-token prefill (max_tokens=1) through ``LLM.generate``
    on the default model, with a small and a large ``kv_cache_memory``, alternating engines."""
    import torch

    from flexpage import LLM, SamplingParams

    gen = torch.Generator().manual_seed(3)
    engines = {size: LLM(kv_cache_memory=f"{size}MiB") for size in pools_mib}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = engines[pools_mib[0]].get_tokenizer().vocab_size

    def prompts() -> list[dict]:  # fresh ids every call: no prefix-cache hits
        return [{"prompt_token_ids": torch.randint(100, vocab, (256,), generator=gen).tolist()} for _ in range(4)]

    for llm in engines.values():  # compile and warm both
        for _ in range(2):
            llm.generate(prompts(), params)
    samples: dict[int, list[float]] = {size: [] for size in pools_mib}
    for rep in range(reps):
        for size in pools_mib if rep % 2 == 0 else pools_mib[::-1]:
            batch = prompts()
            t0 = time.perf_counter()
            engines[size].generate(batch, params)
            samples[size].append(time.perf_counter() - t0)
    timings = {f"{size}MiB": summarize(s) for size, s in samples.items()}
    small, large = (timings[f"{size}MiB"]["median_ms"] for size in pools_mib)
    return {"case": "LLM.generate 4x256 prefill + 1 token", "timings": timings, "large_over_small_pool": large / small}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    p.add_argument("--cases", nargs="*", default=None, help="case names to run (default: all)")
    p.add_argument("--reps", type=int, default=9, help="timed repetitions per method")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per method after the first")
    p.add_argument("--small-pool-mib", type=int, default=64)
    p.add_argument("--large-pool-mib", type=int, default=4096)
    p.add_argument("--engine", action="store_true", help="also time a 4x256 prefill through LLM.generate on the "
                   "default model with both pool sizes (~1 min more)")
    p.add_argument("--out", default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    pools = (args.small_pool_mib * MiB, args.large_pool_mib * MiB)
    cpu_flags = set()
    if os.path.exists("/proc/cpuinfo"):
        cpu_flags = next((set(line.split(":", 1)[1].split()) for line in open("/proc/cpuinfo") if line.startswith("flags")),
                         set())
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "amx_bf16": "amx_bf16" in cpu_flags,
           "avx512_bf16": "avx512_bf16" in cpu_flags, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    print(f"torch {env['torch']}, {env['threads']} threads, AMX bf16: {env['amx_bf16']}, "
          f"AVX512-BF16: {env['avx512_bf16']}; pools {args.small_pool_mib} MiB and {args.large_pool_mib} MiB "
          "(K+V, one layer)", flush=True)
    header = f"{'case':<24} {'dtype':<9} {'flex ms':>8} {'sdpa ms':>8} {'flex/sdpa':>9} {'large pool':>10} {'noise':>6}"
    print(header, flush=True)
    rows = []
    for dtype_name in args.dtypes:
        for case in cases:
            row = run_case(case, dtype_name, pools, args.reps, args.warmup)
            rows.append(row)
            print(f"{case.name:<24} {dtype_name:<9} {row['flex_ms']:8.2f} {row['sdpa_ms']:8.2f} "
                  f"{row['flex_over_sdpa']:9.2f} {row['large_over_small_pool']:9.2f}x {row['noise']:6.0%}", flush=True)
    engine = None
    if args.engine:
        engine = run_engine((args.small_pool_mib, args.large_pool_mib), args.reps)
        t = engine["timings"]
        print(f"{engine['case']}: " + ", ".join(f"{k} pool {v['median_ms']:.1f} ms" for k, v in t.items())
              + f" (large/small {engine['large_over_small_pool']:.2f}x)", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"environment": env, "args": vars(args), "rows": rows, "engine": engine}, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
