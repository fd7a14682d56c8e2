"""Bytecode reading for a branch on a traced value: is it a guard that only raises?

`assert t <= block_size` or `if t > block_size: raise ...` branches on a value torch.fx
cannot know while tracing. Such a branch decides nothing but whether to raise, so the
tracer may take the path that does not raise (see `SublayerTracer.to_bool`).
"""
from __future__ import annotations

import dis

_ENDS_BLOCK = ("JUMP", "RETURN", "FOR_ITER", "RERAISE")


def guard_outcome(frame) -> bool | None:
    """For a conditional jump whose fall-through path raises: the truth value that skips
    the raise. None when the branch is not such a guard."""
    insts = list(dis.get_instructions(frame.f_code))
    at = next((k for k, ins in enumerate(insts) if ins.offset == frame.f_lasti), None)
    if at is None or "JUMP" not in insts[at].opname:
        return None
    op = insts[at].opname
    if "IF_TRUE" in op:
        jumps_on = True
    elif "IF_FALSE" in op:
        jumps_on = False
    else:
        return None
    for ins in insts[at + 1:]:  # the fall-through path: taken when the jump is not
        if ins.opname == "RAISE_VARARGS":
            return jumps_on
        if any(word in ins.opname for word in _ENDS_BLOCK):
            return None
    return None
