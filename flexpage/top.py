"""``flexpage top``: the KV cache of a running server, live in the terminal.

Polls ``GET /v1/kv`` (:mod:`flexpage.kv_view`) and draws: a map of the pool with one cell per
block (several blocks per cell when the pool is larger than the terminal; the cell shows the
busiest state among them), coloured by state; bars for the pool and the host and disk tiers;
hit rates; the conversations holding KV and the requests in flight.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

__all__ = ["STATE_STYLES", "fetch_view", "render", "run_top"]

#: block state -> (style, legend); busier states win when a cell covers several blocks
STATE_STYLES = {
    "s": ("bold yellow", "shared"),
    "u": ("green", "used"),
    "c": ("blue", "cached"),
    ".": ("grey30", "free"),
}
_RANK = {state: i for i, state in enumerate(STATE_STYLES)}


def pool_map(blocks: str, cells: int) -> Text:
    """The pool as at most ``cells`` coloured squares, ``width`` per line left to the caller."""
    per_cell = max(1, -(-len(blocks) // max(1, cells)))
    text = Text()
    for start in range(0, len(blocks), per_cell):
        state = min(blocks[start:start + per_cell], key=_RANK.__getitem__)
        text.append("■", style=STATE_STYLES[state][0])
    return text


def _bar(label: str, used: float, total: float, unit: str) -> Table:
    row = Table.grid(padding=(0, 1))
    row.add_column(width=6)
    row.add_column(width=40)
    row.add_column()
    row.add_row(label, ProgressBar(total=max(total, 1), completed=used, width=40),
                f"{used:,.0f} / {total:,.0f} {unit}" if total else "off")
    return row


def render(view: dict[str, Any], width: int = 100, map_rows: int = 12) -> Group:
    """One frame for ``view`` (a ``/v1/kv`` response)."""
    blocks = view["blocks"]
    legend = Text("  ".join(f"■ {name} {view['pool'][name]:,}" for name in ("shared", "used", "cached", "free")))
    for state, (style, name) in STATE_STYLES.items():
        legend.highlight_words([f"■ {name}"], style)
    cells = max(1, (width - 4) * map_rows)
    per_cell = max(1, -(-len(blocks) // cells))
    title = f"KV pool: {len(blocks):,} blocks of {view['block_size']} tokens" + (
        f" ({per_cell} per cell)" if per_cell > 1 else "")
    grid = pool_map(blocks, cells)
    grid.no_wrap = False
    mib = 1 << 20
    tiers = view["tiers"]
    rates = view["rates"]
    bars = Group(
        _bar("pool", len(blocks) - view["pool"]["free"], len(blocks), "blocks held"),
        _bar("host", tiers["host"]["blocks_used"], tiers["host"]["blocks_total"],
             f"blocks ({tiers['host']['bytes_used'] / mib:,.1f} MiB)"),
        _bar("disk", tiers["disk"]["blocks_used"], tiers["disk"]["blocks_total"], "blocks"),
        Text(f"prefix-cache hit rate {rates['prefix_cache_hit_rate']:.1%}   history reused "
             f"{rates['history_reuse_rate']:.1%}   restored host {rates['kv_restored_host_tokens']:,} / disk "
             f"{rates['kv_restored_disk_tokens']:,} tokens   recomputed {rates['conversation_recomputed_tokens']:,}"
             f"   dropped {rates['kv_dropped_tokens']:,}   policy {tiers['policy'] or '-'}"),
        Text(f"speculative decoding: {rates.get('spec_decode_num_draft_tokens', 0):,} tokens proposed, "
             f"{rates.get('spec_decode_num_accepted_tokens', 0):,} accepted"),
    )
    conversations = Table("conversation", "turns", "idle s", "pool", "host", "disk", "reused", "recomputed",
                          title="conversations", expand=False, title_justify="left")
    for c in view["conversations"][:10]:
        conversations.add_row(str(c["id"]), str(c["turns"]), f"{c['idle_s']:.1f}", str(c["pool_blocks"]),
                              str(c["host_blocks"]), str(c["disk_blocks"]), f"{c['reused_tokens']:,}",
                              f"{c['recomputed_tokens']:,}")
    requests = Table("request", "conversation", "status", "prompt", "cached", "output", "blocks",
                     title=f"requests ({len(view['requests'])})", expand=False, title_justify="left")
    for r in view["requests"][:10]:
        requests.add_row(r["id"][:14], str(r["conversation"] or "-"), r["status"], str(r["prompt_tokens"]),
                         str(r["cached_tokens"]), str(r["output_tokens"]), str(r["blocks"]))
    return Group(Panel(Group(grid, legend), title=title, width=width), bars, conversations, requests)


def fetch_view(url: str, api_key: str | None, timeout: float = 10.0) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url.rstrip("/") + "/v1/kv", headers=headers, timeout=timeout)
    if response.status_code != 200:
        raise RuntimeError(f"GET {url}/v1/kv: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()


def run_top(url: str, api_key: str | None, interval: float = 1.0, once: bool = False) -> None:
    """Draw ``url``'s KV cache until Ctrl-C (or one frame with ``once``)."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if once:
        console.print(render(fetch_view(url, api_key), width=min(console.width, 120)))
        return
    with Live(console=console, screen=True, auto_refresh=False) as live:
        while True:
            try:
                frame: Any = render(fetch_view(url, api_key), width=min(console.width, 160))
            except Exception as error:  # noqa: BLE001 - a server restarting is shown, not fatal
                frame = Text(f"{url}: {error}", style="red")
            live.update(frame, refresh=True)
            time.sleep(interval)
