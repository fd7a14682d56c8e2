"""Initialisation that does not depend on how a model is laid out over processes.

A model is built from *units*: `embed`, `sublayers.{i}`, `aggregations.{i}` and `head`, the
names of their modules in the lowered model. `Init(seed)` builds each unit with torch's
generator seeded by (seed, unit name), so a unit's weights are the same whether it is built
alone, with its neighbours, or in a model of another topology: one process, any pipeline
layout and any data-parallel layout start from identical weights.

`Init(seed, meta=True)` builds every unit on the meta device (shapes only, no memory) and
remembers how to build it; `materialize(model, names)` then makes the named units real, in
place (the module objects stay, only their tensors are replaced, so references to them, e.g.
the two-phase groups', stay valid). A pipeline rank materialises only its chunks' units.

Tied tensors (the LM head reading the embedding matrix) are declared with `tie`: a unit that
holds the tied tensor materialises its source unit too, and the tie is restored afterwards.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


def unit_seed(seed: int, name: str) -> int:
    """The generator seed of unit `name` in a model initialised with `seed` (63 bits)."""
    digest = hashlib.sha256(f"restopo-init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class Init:
    """How a model's units are built (see the module docstring)."""

    seed: int
    meta: bool = False
    factories: dict[str, Callable[[], nn.Module]] = field(default_factory=dict)
    ties: dict[str, str] = field(default_factory=dict)  # "head.lm_head.weight": "embed.weight"

    def unit(self, name: str, factory: Callable[[], nn.Module]) -> nn.Module:
        """Build unit `name` with `factory` (on the meta device when `meta`)."""
        self.factories[name] = factory
        if self.meta:
            with torch.device("meta"):
                return factory()
        return self.real(name)

    def real(self, name: str) -> nn.Module:
        """Unit `name` with its weights, on the CPU, from its own seeded generator."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(unit_seed(self.seed, name))
            return self.factories[name]()

    def tie(self, target: str, source: str) -> None:
        self.ties[target] = source


def unit_of(param_name: str, units) -> str | None:
    """The unit (one of `units`) that parameter `param_name` belongs to."""
    for u in units:
        if param_name.startswith(u + "."):
            return u
    return None


def materialize(model: nn.Module, init: Init, names, device=None) -> set[str]:
    """Make the units `names` of a meta-built `model` real on `device` (CPU by default),
    each from its seeded factory, and restore the ties. Returns the units made real (the
    names plus the sources of ties they hold)."""
    names = set(names)
    for target, source in init.ties.items():
        if unit_of(target, names) is not None:
            names.add(unit_of(source, init.factories))
    for name in sorted(names):
        module = model.get_submodule(name)
        real = init.real(name)
        if device is not None:
            real = real.to(device)
        _transplant(module, real)
    retie(model, init, names)
    return names


def retie(model: nn.Module, init: Init, held) -> None:
    """Point both names of each tied tensor at the one this process holds: the source's
    when its unit is held, else the target's (e.g. after FSDP replaced it by its shard),
    so the model keeps one tensor under both names, as it was built."""
    for target, source in init.ties.items():
        if unit_of(source, held) is not None:
            keep, other = source, target
        elif unit_of(target, held) is not None:
            keep, other = target, source
        else:
            continue
        holder, _, attr = other.rpartition(".")
        setattr(model.get_submodule(holder), attr, model.get_parameter(keep))


def _transplant(module: nn.Module, real: nn.Module) -> None:
    """Give `module` the tensors of `real` (the same class, built by the same factory)."""
    mods = dict(real.named_modules())
    for path, m in module.named_modules():
        src = mods[path]
        for k in list(m._parameters):
            if m._parameters[k] is not None:
                m._parameters[k] = src._parameters[k]
        for k in list(m._buffers):
            if m._buffers[k] is not None:
                m._buffers[k] = src._buffers[k]


def reshard_units(module: nn.Module) -> None:
    """Free the gathered weights of every FSDP2 unit in `module`, keeping each process's
    shards. A forward with no backward after it (an evaluation) leaves the root unit's weights
    gathered: FSDP2 keeps the root whole after its forward, for the backward it expects.
    Left so, the memory is not divided until the next step, and `named_parameters()` gives
    the whole tensors instead of this process's shards (a checkpoint saved then held every
    whole tensor once per process, and resumed wrongly)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
