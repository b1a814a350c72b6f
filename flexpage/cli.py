"""The ``flexpage`` command: ``generate`` (offline batch), ``serve`` (OpenAI-compatible HTTP),
``top`` (watch a server) and ``env`` (a report to paste into a bug report).

Subcommands import their heavy modules only when they run, so ``flexpage --help`` is instant.
"""

from __future__ import annotations

import time
from typing import Optional

import typer

MODEL_IMPL_HELP = ("auto | flexpage | transformers: the compact forward (Llama, Mistral, Qwen2/3) or HF's modules "
                   "around the paged attention; auto = compact where the model has one.")
DETERMINISTIC_HELP = ("Bit-identical greedy tokens and logprobs for a request whatever else is batched with it, "
                      "however its prompt is chunked, with or without a prefix-cache hit (slower: docs/deterministic.md).")
RECIPE_HELP = ("Attention recipe instead of the model's own: 'package.module:attr' or 'path/file.py[:attr]' "
               "(a Recipe, or a function of no arguments returning one) for every layer, or KIND=RECIPE for the "
               "layers of one kind (full_attention, sliding_attention; repeat the option for both).")

KERNEL_FALLBACK_HELP = ("warn | error: where a flexpage kernel cannot be built or used (the GGUF block kernel, "
                        "the Inductor patches), fall back to the slower path and say so, or fail. Sets "
                        "FLEXPAGE_KERNEL_FALLBACK for every process of the run [default: $FLEXPAGE_KERNEL_FALLBACK "
                        "or warn].")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Paged FlexAttention LLM engine and server.")


@app.callback()
def _root() -> None:
    """Paged FlexAttention LLM engine and server."""


def _set_kernel_fallback(policy: Optional[str]) -> None:
    """``--kernel-fallback``: checked, then set in the environment (spawned ranks inherit it)."""
    import os

    from flexpage.backends.cpu.fallback import FALLBACK_ENV, FALLBACK_POLICIES, fallback_policy

    try:
        if policy is not None and policy.strip().lower() not in FALLBACK_POLICIES:
            raise ValueError(f"got {policy!r}, expected one of {', '.join(FALLBACK_POLICIES)}")
        if policy is not None:
            os.environ[FALLBACK_ENV] = policy.strip().lower()
        fallback_policy()  # the environment's value, if the option was not given
    except ValueError as error:
        typer.echo(f"error: --kernel-fallback: {error}", err=True)
        raise typer.Exit(2) from error


@app.command()
def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts."),
    model: Optional[str] = typer.Option(None, help="HF folder or .gguf; default SmolLM2-135M-Instruct."),
    max_tokens: int = typer.Option(64, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: Optional[int] = typer.Option(None),
    n: int = typer.Option(1, help="Samples per prompt."),
    chat: bool = typer.Option(False, help="Wrap each prompt as a user message with the chat template."),
    dtype: str = typer.Option("auto", help="auto | bfloat16 | float32."),
    block_size: int = typer.Option(8, help="Tokens per KV block."),
    attention_block_size: Optional[int] = typer.Option(None, help="Tokens per attention key block (blocks come in "
                                                                  "runs of it); default 256 for float32, 128 else."),
    num_blocks: Optional[int] = typer.Option(None),
    kv_cache_memory: str = typer.Option("1GiB"),
    eager: bool = typer.Option(False, help="Run attention without torch.compile (debugging)."),
    model_impl: str = typer.Option("auto", help=MODEL_IMPL_HELP),
    recipe: Optional[list[str]] = typer.Option(None, help=RECIPE_HELP),
    deterministic: bool = typer.Option(False, "--deterministic", help=DETERMINISTIC_HELP),
    kernel_fallback: Optional[str] = typer.Option(None, help=KERNEL_FALLBACK_HELP),
) -> None:
    """Generate completions for PROMPTS and print them with a summary."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flexpage import LLM, SamplingParams
    from flexpage.backends.cpu.fallback import KernelFallbackError
    from flexpage.model.layer_recipes import parse_recipe_option

    _set_kernel_fallback(kernel_fallback)
    console = Console()
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, n=n)
        recipe_choice = parse_recipe_option(recipe)
    except ValueError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from error
    try:
        with console.status("loading model"):
            llm = LLM(model, dtype=dtype, block_size=block_size, attention_block_size=attention_block_size,
                      num_blocks=num_blocks,
                      kv_cache_memory=kv_cache_memory, compile=not eager, model_impl=model_impl, recipe=recipe_choice,
                      deterministic=deterministic)
    except ValueError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from error
    except KernelFallbackError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from error
    start = time.perf_counter()
    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("generate", total=len(prompts))
        advance = lambda _out: progress.advance(task)  # noqa: E731
        if chat:
            tokenizer = llm.get_tokenizer()
            inputs = [{"prompt_token_ids": list(tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False))}
                for p in prompts]
        else:
            inputs = list(prompts)
        try:
            outputs = llm.generate(inputs, params, on_progress=advance)
        except ValueError as error:
            console.print(f"[red]error:[/red] {error}")
            raise typer.Exit(2) from error
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        for sample in out.outputs:
            console.rule(f"[bold]{prompt[:60]}[/bold]" + (f" (sample {sample.index})" if n > 1 else ""))
            console.print(sample.text, markup=False, highlight=False)
    stats = llm.engine.stats()
    generated = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    console.rule("summary")
    console.print(
        f"{len(prompts)} prompts, {generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tokens/s | "
        f"KV utilisation {stats['kv_utilization']:.1%} | prefix-cache hits {stats['prefix_cache_hits']} tokens "
        f"({stats['prefix_cache_hit_rate']:.0%}) | preemptions {stats['preemptions']}"
    )


@app.command()
def serve(
    model: Optional[str] = typer.Option(None, help="HF folder or .gguf; default SmolLM2-135M-Instruct."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."),
    port: int = typer.Option(8000, help="TCP port."),
    api_key: Optional[str] = typer.Option(None, envvar="FLEXPAGE_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on /v1/* "
                                               "(not on /health, /metrics)."),
    served_model_name: Optional[str] = typer.Option(None, help="Model id clients send; default: the model folder "
                                                               "name."),
    max_model_len: Optional[int] = typer.Option(None, help="Longest prompt + completion in tokens; default from the "
                                                           "model (at most 8192)."),
    block_size: int = typer.Option(8, help="Tokens per KV block."),
    attention_block_size: Optional[int] = typer.Option(None, help="Tokens per attention key block: KV blocks are "
                                                                  "handed out in aligned runs this long, read as one "
                                                                  "key block [default: 256 for float32, 128 else]."),
    kv_cache_memory: Optional[str] = typer.Option(None, help="KV pool size, e.g. 512MiB, 2GiB [default: 1GiB]."),
    num_blocks: Optional[int] = typer.Option(None, help="KV pool size in blocks (instead of --kv-cache-memory)."),
    max_num_seqs: int = typer.Option(64, help="Sequences batched at once."),
    max_num_batched_tokens: int = typer.Option(1024, help="Tokens computed per step (chunked-prefill budget)."),
    dtype: str = typer.Option("auto", help="auto | bfloat16 | float16 | float32."),
    eager: bool = typer.Option(False, help="Run attention without torch.compile (no compile wait; slow, debugging)."),
    no_compile_step: bool = typer.Option(False, "--no-compile-step", help="Run each step layer by layer instead of "
                                         "as one compiled graph (Llama-family models; comparison, debugging)."),
    model_impl: str = typer.Option("auto", help=MODEL_IMPL_HELP),
    recipe: Optional[list[str]] = typer.Option(None, help=RECIPE_HELP),
    deterministic: bool = typer.Option(False, "--deterministic", help=DETERMINISTIC_HELP),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Disable KV reuse across requests."),
    swap_space: str = typer.Option("0", help="Host memory for preemption by swapping, e.g. 1GiB."),
    preemption_mode: str = typer.Option("recompute", help="recompute | swap (needs --swap-space)."),
    kv_budget: Optional[int] = typer.Option(None, help="KV tokens each sequence keeps per layer (a multiple of "
                                                       "--block-size, >= 3 blocks); whole blocks past it are evicted. "
                                                       "Requests may set their own (kv_budget)."),
    kv_eviction: str = typer.Option("key_norm", help="Which blocks go over the budget: key_norm | paged_eviction | "
                                                     "streaming_llm | none | module:attr | file.py."),
    host_kv_bytes: str = typer.Option("0", help="Host memory for prefix-cache blocks the pool evicts (chat "
                                                "history across turns), e.g. 4GiB; 0: none."),
    disk_kv_dir: Optional[str] = typer.Option(None, help="Directory of a disk tier behind the host tier (its files "
                                                         "are deleted at start and exit)."),
    disk_kv_bytes: str = typer.Option("0", help="Disk tier size, e.g. 20GiB (with --disk-kv-dir)."),
    kv_tier_policy: str = typer.Option("retention", help="What the tiers drop first: retention (Pensieve: lowest "
                                                         "recompute cost / idle time) | lru."),
    kv_layout: str = typer.Option("paged", help="paged (a pool of blocks claimed up front; prefix sharing) | "
                                                "virtual (vAttention: each sequence's KV contiguous in reserved "
                                                "address space the OS backs on first write; no prefix caching)."),
    kv_resident_bytes: Optional[str] = typer.Option(None, help="With --kv-layout virtual: KV memory in use at once, "
                                                               "e.g. 2GiB [default: --kv-cache-memory]."),
    kv_cache_dtype: str = typer.Option("auto", help="What the KV cache stores: auto (the model's dtype) | int8 "
                                                    "(8-bit K/V, per-channel scales calibrated at start: twice the "
                                                    "tokens per byte; docs/kv-cache-dtype.md)."),
    quantization: str = typer.Option("auto", help="auto (a GGUF model's Q4_1/Q8_0 weights are computed from their "
                                                  "blocks: in float32 always, in bf16 where the CPU has AVX512-BF16) | "
                                                  "none (the model's weights only) | int8 (projections and LM head "
                                                  "quantised to int8 per output channel)."),
    tensor_parallel_size: int = typer.Option(1, help="Ranks that each hold 1/N of every layer and of the KV heads "
                                                     "(spawned on this host; or start ranks with torchrun -m "
                                                     "flexpage.worker, see docs/scaling.md)."),
    tensor_parallel_timeout: float = typer.Option(120.0, help="Seconds a rank waits for a peer before the server "
                                                              "fails (a hung rank)."),
    seed: int = typer.Option(0, help="Seed of the engine's shared RNG (unseeded requests)."),
    speculative_config: Optional[str] = typer.Option(None, help="Speculative decoding, vLLM's JSON: "
                                                                "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                                                                "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                                                                "(docs/speculative.md)."),
    max_request_body: str = typer.Option("4MiB", help="Largest request body accepted; larger ones get 413."),
    drain_timeout: float = typer.Option(30.0, help="Seconds Ctrl-C waits for in-flight requests before aborting them."),
    warmup: bool = typer.Option(True, help="Run one tiny request before listening (compiles kernels)."),
    wait_for_kv_pool: bool = typer.Option(False, help="Listen only once every page of the KV pool is in memory "
                                                      "(seconds per GiB on a VM that backs memory lazily); by "
                                                      "default the pool's pages come in while the engine is idle."),
    log_level: str = typer.Option("warning", help="critical | error | warning | info | debug."),
    kernel_fallback: Optional[str] = typer.Option(None, help=KERNEL_FALLBACK_HELP),
    tool_prompt: Optional[str] = typer.Option(None, help="A text file that shows a request's tools to the model, "
                                                         "its '{tools}' replaced by one JSON line per tool; used "
                                                         "for every model [default: the chat template's own tool "
                                                         "format, else flexpage.server.tools.TOOL_PROMPT]."),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    from rich.console import Console

    from flexpage.backends.cpu.fallback import KernelFallbackError
    from flexpage.model.layer_recipes import parse_recipe_option
    from flexpage.server.main import ServeSettings, run_server

    _set_kernel_fallback(kernel_fallback)
    if kv_cache_memory is not None and num_blocks is not None:
        Console(stderr=True).print("[red]error:[/red] give either --kv-cache-memory or --num-blocks, not both")
        raise typer.Exit(2)
    try:
        recipe_choice = parse_recipe_option(recipe)
    except ValueError as error:
        Console(stderr=True).print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from error
    settings = ServeSettings(
        model=model, host=host, port=port, api_key=api_key, served_model_name=served_model_name,
        max_model_len=max_model_len, block_size=block_size, attention_block_size=attention_block_size,
        kv_cache_memory=kv_cache_memory or "1GiB",
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, dtype=dtype, eager=eager,
        compile_step=not no_compile_step, model_impl=model_impl, recipe=recipe_choice, deterministic=deterministic,
        enable_prefix_caching=not no_prefix_caching, swap_space=swap_space, preemption_mode=preemption_mode,
        kv_budget_tokens=kv_budget, kv_eviction=kv_eviction, host_kv_bytes=host_kv_bytes, disk_kv_dir=disk_kv_dir,
        disk_kv_bytes=disk_kv_bytes, kv_tier_policy=kv_tier_policy, kv_layout=kv_layout,
        kv_resident_bytes=kv_resident_bytes, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size,
        quantization=quantization, tensor_parallel_timeout=tensor_parallel_timeout, seed=seed, speculative_config=speculative_config,
        max_request_body=max_request_body,
        drain_timeout=drain_timeout, warmup=warmup, wait_for_kv_pool=wait_for_kv_pool, tool_prompt=tool_prompt,
        log_level=log_level,
    )
    try:
        code = run_server(settings)
    except ValueError as error:
        Console(stderr=True).print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from error
    except KernelFallbackError as error:
        Console(stderr=True).print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from error
    raise typer.Exit(code)


@app.command()
def top(
    url: str = typer.Option("http://127.0.0.1:8000", help="The flexpage server to watch."),
    api_key: Optional[str] = typer.Option(None, envvar="FLEXPAGE_API_KEY", show_envvar=True,
                                          help="The server's API key (GET /v1/kv is behind it)."),
    interval: float = typer.Option(1.0, help="Seconds between refreshes."),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
) -> None:
    """Watch a server's KV cache live: the pool block by block, tiers, hit rates, conversations, requests."""
    from rich.console import Console

    from flexpage.top import run_top

    try:
        run_top(url, api_key, interval, once)
    except KeyboardInterrupt:
        pass
    except Exception as error:  # noqa: BLE001 - a clear line, not a traceback, for a wrong URL or key
        Console(stderr=True).print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from error


@app.command()
def env(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    build_kernels: bool = typer.Option(False, "--build-kernels", help="Build the GGUF block kernel now (~20 s the "
                                       "first time) and report whether it builds."),
) -> None:
    """Print versions, the CPU as flexpage sees it, the paths it takes and why, compile caches and
    the kernel build state: paste it into a bug report."""
    import json

    from flexpage.backends.cpu.env_report import collect, render
    from flexpage.backends.cpu.fallback import KernelFallbackError

    try:
        report = collect(build_kernels=build_kernels)
    except KernelFallbackError as error:  # FLEXPAGE_KERNEL_FALLBACK=error and a kernel failed
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from error
    typer.echo(json.dumps(report, indent=2, default=str) if as_json else render(report))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
