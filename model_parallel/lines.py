"""How a library's failure and a size read in one of Tandem's one-line messages: `one_line`, `human`.

Imports nothing heavy: the config (read before torch loads, for --help) uses it too."""
from __future__ import annotations


def one_line(error: BaseException | str, limit: int = 300, named: bool = False, first: bool = False) -> str:
    """A library's message fit for our one-line errors: whitespace (newlines too) collapsed, length bounded;
    `named`: after the exception's type, for a failure nobody foresaw (its message alone may say little);
    `first`: its first line only (where the rest is a C++ stack or generic advice: torch.distributed, YAML)."""
    text = str(error).strip()
    text = " ".join((text.splitlines()[:1] if first else [text])[0].split()) if text else ""
    text = text or type(error).__name__
    if named and isinstance(error, BaseException):
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def human(nbytes: float) -> str:
    """Bytes as the start-up lines, the budgets and the Hub fetches print them: 2.00 GiB, 100.00 MiB, 512 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"
