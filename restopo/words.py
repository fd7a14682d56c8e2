"""How restopo says things in words to people (no imports: usable everywhere)."""
from __future__ import annotations


def alts(choices) -> str:
    """'a', 'a or b', 'a, b or c': the choices as a sentence says them."""
    choices = list(choices)
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


def counted(k: int, what: str, plural: str | None = None) -> str:
    """'1 run', '3 runs', '1,200 tokens': `what` (singular) after the count, its plural
    `what` + 's' unless `plural` is given ('process', 'processes')."""
    return f"{k:,} {what if k == 1 else plural or what + 's'}"
