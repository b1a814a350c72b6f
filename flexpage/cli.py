"""The ``flexpage`` command: ``generate`` (offline batch) and ``serve`` (OpenAI-compatible HTTP).

Subcommands import their heavy modules only when they run, so ``flexpage --help`` is instant.
"""

from __future__ import annotations

import time
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Paged FlexAttention LLM engine and server.")


@app.callback()
def _root() -> None:
    """Paged FlexAttention LLM engine and server."""


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
    block_size: int = typer.Option(16),
    num_blocks: Optional[int] = typer.Option(None),
    kv_cache_memory: str = typer.Option("1GiB"),
    eager: bool = typer.Option(False, help="Run attention without torch.compile (debugging)."),
) -> None:
    """Generate completions for PROMPTS and print them with a summary."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flexpage import LLM, SamplingParams

    console = Console()
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, n=n)
    except ValueError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from error
    with console.status("loading model"):
        llm = LLM(model, dtype=dtype, block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                  compile=not eager)
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
