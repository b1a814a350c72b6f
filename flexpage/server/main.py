"""``flexpage serve``: load the engine, print a banner, run uvicorn, drain on Ctrl-C.

Shutdown: the first SIGINT/SIGTERM starts draining: ``/v1/*`` answers 503 and ``/health``
503 while the requests in flight finish (bounded by ``drain_timeout``; whatever is left
then is aborted). The listening socket stays open meanwhile, so clients get a clear 503
rather than a refused connection. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flexpage.model.layer_recipes import RecipeChoice

__all__ = ["ServeSettings", "run_server"]

log = logging.getLogger("flexpage.server")


@dataclass
class ServeSettings:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    block_size: int = 8
    attention_block_size: int | None = None  # by dtype
    kv_cache_memory: str = "1GiB"
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    dtype: str = "auto"
    eager: bool = False
    compile_step: bool = True  # EngineConfig.compile_step
    model_impl: str = "auto"
    recipe: RecipeChoice = None  # see flexpage.model.layer_recipes; None: the model's own
    deterministic: bool = False  # EngineConfig.deterministic
    kv_budget_tokens: int | None = None  # EngineConfig.kv_budget_tokens
    kv_eviction: str = "key_norm"  # EngineConfig.kv_eviction
    host_kv_bytes: str = "0"  # EngineConfig.host_kv_bytes
    disk_kv_dir: str | None = None  # EngineConfig.disk_kv_dir
    disk_kv_bytes: str = "0"  # EngineConfig.disk_kv_bytes
    kv_tier_policy: str = "retention"  # EngineConfig.kv_tier_policy
    kv_layout: str = "paged"  # EngineConfig.kv_layout
    kv_resident_bytes: str | None = None  # EngineConfig.kv_resident_bytes
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype
    tensor_parallel_size: int = 1  # EngineConfig.tensor_parallel_size
    tensor_parallel_timeout: float = 120.0  # EngineConfig.tensor_parallel_timeout
    quantization: str = "auto"  # EngineConfig.quantization
    speculative_config: str | None = None  # EngineConfig.speculative_config (vLLM's JSON text)
    enable_prefix_caching: bool = True
    swap_space: str = "0"
    preemption_mode: str = "recompute"
    seed: int = 0
    max_request_body: str = "4MiB"
    drain_timeout: float = 30.0
    warmup: bool = True
    wait_for_kv_pool: bool = False  # ready only once every KV pool page is faulted in (grows with kv_cache_memory)
    tool_prompt: str | None = None  # a file with a {tools} slot (see flexpage.server.tools)
    log_level: str = "warning"


def run_server(settings: ServeSettings) -> int:
    """Blocking: serve until a signal; returns the exit code."""
    import uvicorn
    from rich.console import Console
    from rich.markup import escape

    from flexpage.config import EngineConfig, parse_size
    from flexpage.engine import LLMEngine
    from flexpage.model.loader import load_tokenizer
    from flexpage.server.api import ServerState, build_app
    from flexpage.server.engine_loop import EngineLoop
    from flexpage.server.metrics import ServerMetrics
    from flexpage.server.tools import read_tool_prompt

    console = Console(highlight=False)
    logging.basicConfig(level=getattr(logging, settings.log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    max_body = parse_size(settings.max_request_body)
    if max_body <= 0:
        raise ValueError(f"max_request_body: got {settings.max_request_body!r}, expected a positive size")
    tool_prompt = read_tool_prompt(settings.tool_prompt) if settings.tool_prompt is not None else None
    config = EngineConfig(
        model=settings.model, dtype=settings.dtype, block_size=settings.block_size,
        attention_block_size=settings.attention_block_size, num_blocks=settings.num_blocks,
        kv_cache_memory=settings.kv_cache_memory, swap_space=settings.swap_space,
        max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, enable_prefix_caching=settings.enable_prefix_caching,
        preemption_mode=settings.preemption_mode, compile=not settings.eager, model_impl=settings.model_impl,
        seed=settings.seed, recipe=settings.recipe, deterministic=settings.deterministic,
        compile_step=settings.compile_step, kv_budget_tokens=settings.kv_budget_tokens,
        kv_eviction=settings.kv_eviction, host_kv_bytes=settings.host_kv_bytes, disk_kv_dir=settings.disk_kv_dir,
        disk_kv_bytes=settings.disk_kv_bytes, kv_tier_policy=settings.kv_tier_policy,
        kv_layout=settings.kv_layout, kv_resident_bytes=settings.kv_resident_bytes,
        kv_cache_dtype=settings.kv_cache_dtype, tensor_parallel_size=settings.tensor_parallel_size, tensor_parallel_timeout=settings.tensor_parallel_timeout,
        quantization=settings.quantization, speculative_config=settings.speculative_config,
    )
    timings = {"load": 0.0, "warm-up": 0.0}  # and "KV pool" where it is waited for

    def build_engine() -> Any:  # runs in the engine thread (see EngineLoop.build)
        start = time.perf_counter()
        engine = LLMEngine(config)
        timings["load"] = time.perf_counter() - start
        if settings.warmup:
            timings["warm-up"] = engine.warm_up()
        if settings.wait_for_kv_pool:
            start = time.perf_counter()
            engine.runner.pool.wait_until_resident()
            timings["KV pool"] = time.perf_counter() - start
        return engine

    uv_server: list[Any] = []  # set below; the engine thread stops it if the engine fails

    def engine_failed(error: BaseException) -> None:
        for server in uv_server:
            server.should_exit = True
        console.print(f"[red]error:[/red] {escape(str(error))}; stopping the server")

    try:
        with console.status("loading the model" + (" and compiling attention kernels" if settings.warmup else "")):
            engine_loop = EngineLoop.build(build_engine, on_fatal=engine_failed)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted during start-up[/yellow]")
        return 130
    engine = engine_loop.engine
    served_name = settings.served_model_name or pathlib.Path(engine.model_path).name
    metrics = ServerMetrics(lambda: engine_loop.stats)
    engine_loop.metrics = metrics
    state = ServerState(
        engine_loop=engine_loop, tokenizer=load_tokenizer(engine.model_path), served_model_name=served_name,
        grammars=engine.grammars,
        max_model_len=engine.max_model_len, vocab_size=engine.vocab_size, api_key=settings.api_key or None,
        max_body_bytes=max_body, metrics=metrics, recipes=recipe_summary(engine.recipes), tool_prompt=tool_prompt,
    )
    app = build_app(state)
    engine_loop.start()
    _banner(console, settings, engine, served_name, timings)

    uv_config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                               access_log=False, lifespan="off", loop="asyncio", http="h11",
                               timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = _DrainingServer(uv_config, state, settings.drain_timeout, console)
    uv_server.append(server)
    try:
        server.run()
    finally:
        engine_loop.stop(timeout=10)
        engine.close()  # the disk tier's files
        state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
    if engine_loop.fatal is not None:
        return 1
    if not server.started:
        console.print(f"[red]error:[/red] could not serve on {settings.host}:{settings.port}")
        return 1
    console.print("[green]flexpage serve stopped[/green]")
    return 0


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


def cpu_summary() -> str:
    """The CPU and each path this process took (a fallback in red, with why), from the CPU
    description (:mod:`flexpage.backends.cpu.description`)."""
    from rich.markup import escape

    from flexpage.backends.cpu.description import describe

    description = describe()
    lines = [escape(description.summary())]
    for path in description.paths.paths():
        line = escape(f"{path.name}: {path.choice}" + (f" ({path.reason})" if path.reason else ""))
        lines.append(line if path.ok else f"[bold red]fallback: {line}[/bold red]")
    return "\n".join(lines)


def recipe_summary(recipes: Any) -> str:
    """Each distinct recipe with the layers that run it, e.g. ``causal+sliding_window(4096) (layers 0-24/2)``."""
    layers: dict[Any, list[int]] = {}
    for layer, recipe in enumerate(recipes):
        layers.setdefault(recipe, []).append(layer)
    if len(layers) == 1:
        return f"{next(iter(layers)).name} (all {len(recipes)} layers)"
    return "; ".join(f"{recipe.name} (layers {', '.join(map(str, ids))})" for recipe, ids in layers.items())


def _layers_summary(engine: Any) -> str:
    """How the layers run, and what the projections compute from (docs/quantization.md)."""
    compact = engine.runner.compact
    if compact is None:
        return "HF transformers modules"
    head = compact.lm_head
    if head.blocks is None:
        weights = "pre-packed for oneDNN" if head.packed else "the model's weights"
    else:
        source = "int8 blocks" if engine.config.quantization == "int8" else "the GGUF's Q4_1/Q8_0 blocks"
        weights = source + (" (packed bf16 beyond 4 rows)" if head.weight is not None else "")
    return f"flexpage compact forward (fused projections from {weights})"


def _banner(console: Any, settings: ServeSettings, engine: Any, served_name: str, timings: dict[str, float]) -> None:
    from rich.panel import Panel
    from rich.table import Table

    stats = engine.stats()
    host = settings.host if ":" not in settings.host else f"[{settings.host}]"
    url = f"http://{host}:{settings.port}"
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    table.add_row("URL", f"{url}/v1  (health {url}/health, metrics {url}/metrics)")
    table.add_row("model", f"{served_name}  ({engine.model_path})")
    table.add_row("dtype", str(engine.dtype).replace("torch.", ""))
    table.add_row("KV cache", f"{int(stats['kv_capacity_tokens']):,} tokens = {int(stats['kv_blocks_total'])} blocks "
                              f"x {engine.config.block_size}, {_kv_dtype_summary(engine)}")
    table.add_row("max model len", f"{engine.max_model_len:,} tokens; max {engine.config.max_num_seqs} sequences, "
                                   f"{engine.config.max_num_batched_tokens} batched tokens / step")
    table.add_row("KV layout", _layout_summary(engine))
    if engine.config.tensor_parallel_size > 1:
        table.add_row("tensor parallel", _parallel_summary(engine))
    table.add_row("prefix caching", "on" if engine.config.enable_prefix_caching
                  else "off" + (" (the virtual layout shares no blocks)" if engine.config.kv_layout == "virtual" else ""))
    budget = engine.config.kv_budget_tokens
    table.add_row("KV budget", f"{budget} tokens per sequence, {engine.eviction_policy.name} eviction"
                  if budget is not None and engine.eviction_policy.token_scores is not None
                  else f"none (requests may set kv_budget; {engine.eviction_policy.name} eviction)")
    tiers = engine.tier_stats()
    table.add_row("KV tiers", f"host {_gib(tiers['kv_host_blocks_total'] * engine.tier_storage.block_bytes)}"
                  + (f", disk {_gib(tiers['kv_disk_blocks_total'] * engine.tier_storage.block_bytes)} in "
                     f"{engine.config.disk_kv_dir}" if engine.config.disk_kv_dir else "")
                  + f"; {engine.block_manager.tiers.policy} policy (recompute cost +"
                    f"{engine.recompute_cost_slope * 1000:.2f}% per 10 tokens of context)"
                  if engine.tier_storage is not None else "none (cached blocks the pool evicts are lost)")
    table.add_row("attention", "torch.compile (FlexAttention kernels)" if engine.runner.compile
                  else "eager (no torch.compile)")
    table.add_row("CPU", cpu_summary())
    table.add_row("recipes", recipe_summary(engine.recipes) + ("" if engine.runner.recipes_from_model
                                                              else "  (--recipe)"))
    table.add_row("layers", _layers_summary(engine))
    table.add_row("step", "one compiled graph (3 variants: prefill, decode, mixed)" if engine.runner.compiled_step
                  else "layer by layer")
    keys = len([k for k in (settings.api_key or "").split(",") if k.strip()])
    table.add_row("API key", ("required" if keys == 1 else f"required ({keys} keys; each scopes its conversations)")
                  if keys else "none (open)")
    table.add_row("startup", f"load {timings['load']:.1f} s, warm-up {timings['warm-up']:.1f} s"
                  + _kv_pool_summary(engine, timings))
    console.print(Panel(table, title="[bold]flexpage serve[/bold]", subtitle="Ctrl-C drains and stops",
                        expand=False))


def _kv_pool_summary(engine: Any, timings: dict[str, float]) -> str:
    """How the KV pool's pages stand at start-up: waited for, or still being faulted in."""
    if "KV pool" in timings:
        return f", KV pool resident {timings['KV pool']:.1f} s"
    return "; KV pool pages faulting in while idle" if engine.runner.pool.populating else ""


def _kv_dtype_summary(engine: Any) -> str:
    """What one cached token costs: its dtype and bytes."""
    pool = engine.runner.pool
    kind = "int8 (per-channel scales calibrated at start)" if pool.quantized else str(pool.dtype).replace("torch.", "")
    return f"{kind}, {pool.bytes_per_token:,} bytes a token"


def _parallel_summary(engine: Any) -> str:
    size = engine.config.tensor_parallel_size
    started = "spawned on this host" if engine.executor.group.workers else "started by torchrun"
    return (f"{size} ranks ({started}, gloo), each with {engine.runner.pool.num_kv_heads} KV heads and 1/{size} of every "
            f"layer; a rank that dies, or hangs {engine.config.tensor_parallel_timeout:.0f} s, stops the server")


def _layout_summary(engine: Any) -> str:
    """The KV layout, and for the virtual one what the OS will do with its reservation."""
    pool = engine.runner.pool
    if pool.arena is None:
        return f"paged ({_gib(pool.storage.numel() * pool.storage.element_size())} claimed at start)"
    from flexpage.attention.virtual_arena import overcommit_mode, transparent_huge_pages

    return (f"virtual ({_gib(pool.arena.nbytes)} of address space reserved, pages mapped on first write; "
            f"vm.overcommit_memory={overcommit_mode()}, transparent huge pages {transparent_huge_pages()})")


class _DrainingServer:
    """uvicorn.Server whose first exit signal drains in-flight requests instead of cutting them."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # build the subclass lazily (uvicorn import)
        import uvicorn

        class DrainingServer(uvicorn.Server):
            def __init__(self, config: Any, state: Any, drain_timeout: float, console: Any) -> None:
                super().__init__(config)
                self.state = state
                self.drain_timeout = drain_timeout
                self.console = console
                self._loop: asyncio.AbstractEventLoop | None = None
                self._drain_task: asyncio.Task | None = None

            async def serve(self, sockets: Any = None) -> None:
                self._loop = asyncio.get_running_loop()
                await super().serve(sockets)

            def handle_exit(self, sig: int, frame: Any) -> None:
                # Not calling super(): uvicorn would re-raise the signal after shutdown, and the
                # process would then die of it instead of exiting 0.
                if self.state.draining or self._loop is None or not self.started:
                    self.force_exit = self.state.draining
                    self.should_exit = True
                    return
                self.state.draining = True
                self._loop.call_soon_threadsafe(self._start_drain, sig)

            def _start_drain(self, sig: int) -> None:
                self._drain_task = asyncio.ensure_future(self._drain(sig))

            async def _drain(self, sig: int) -> None:
                name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
                inflight = self.state.inflight
                self.console.print(f"[yellow]{name}: draining {inflight} in-flight request(s) "
                                   f"(up to {self.drain_timeout:g} s; signal again to stop now)[/yellow]")
                deadline = time.monotonic() + self.drain_timeout
                while self.state.inflight > 0 and time.monotonic() < deadline and not self.should_exit:
                    await asyncio.sleep(0.05)
                if self.state.inflight > 0:
                    self.console.print(f"[red]aborting {self.state.inflight} request(s) still running[/red]")
                    self.state.engine_loop.abort_all()
                    deadline = time.monotonic() + 5
                    while self.state.inflight > 0 and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                self.should_exit = True

        return DrainingServer(*args, **kwargs)


def env_api_key() -> str | None:
    return os.environ.get("FLEXPAGE_API_KEY") or None
