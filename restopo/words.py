"""How restopo says things in words to people (no imports: usable everywhere)."""
from __future__ import annotations


def counted(k: int, what: str, plural: str | None = None) -> str:
    """'1 run', '3 runs', '1,200 tokens': `what` (singular) after the count, its plural
    `what` + 's' unless `plural` is given ('process', 'processes')."""
    return f"{k:,} {what if k == 1 else plural or what + 's'}"
