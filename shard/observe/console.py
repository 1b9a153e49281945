"""The terminal: the two consoles every command prints on, and how sizes read there."""

from rich.console import Console
from rich.markup import escape

# Messages hold user text (paths, mesh specs, TOML tables): stdout takes no markup unless a call asks
# for it (user text then goes through escape()), stderr's markup is escaped, and neither has :emoji: codes.
console = Console(highlight=False, emoji=False, markup=False)
err_console = Console(stderr=True, highlight=False, emoji=False)


def warn(message: str) -> None:
    """A warning on stderr, in yellow (the text is not markup)."""
    err_console.print(f"[yellow]{escape(message)}[/yellow]", soft_wrap=True)


def note(message: str) -> None:
    """A side note on stderr, dimmed."""
    err_console.print(f"[dim]{escape(message)}[/dim]", soft_wrap=True)


def table_console(min_width: int = 0) -> Console:
    """A console for a table on stdout: on a terminal its width (at least `min_width`); piped or redirected,
    wide enough that no name or shape is cut (rich would otherwise assume 80 columns)."""
    width = max(console.width, min_width) if console.is_terminal else 10_000
    return Console(highlight=False, emoji=False, markup=False, width=width)


def human_bytes(n: float) -> str:
    """Bytes in binary units: 512 B, 3.20 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def param_count(n: int) -> str:
    """A parameter count as people say it: 0.10M, 124.44M, 13.08B."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def params_phrase(model, word: str = "params") -> str:
    """A model's own parameter count (as transformers counts it) and, apart, the padded vocab rows its
    stored tables add: "0.33M params + 8,192 vocab padding"."""
    padding = model.vocab_padding_params()
    return f"{param_count(model.num_params())} {word}" + (f" + {padding:,} vocab padding" if padding else "")


def short_bytes(n: float) -> str:
    """Bytes in at most five characters: 512B, 3.2K, 41G (binary units)."""
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" or n >= 10 else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)
