"""Generation with a KV cache for models built by restopo.compile (or restopo.load).

Depth attention mixes a token's own sublayer outputs, never other positions', so decoding
needs no residual cache across positions: only each attention sublayer's keys and values
(restopo.nn.sublayers.KVCache). A `Decoder` is the model lowered once more from its IR
(restopo.fx.lower, the fx visitor of restopo.ir.walk), sharing every weight and aggregation
module, with three pieces swapped: each attention sublayer reads and fills its cache, the
rotary context is taken at the step's positions, and the head reads the last position only.
So the prompt is prefilled through the model's own forward graph, and each new token runs
the same walk: its aggregations over its own sources, a block's two-phase plan (phase 1
batched over the block's sublayers) included, whatever topology the IR describes.

    out = restopo.generate(model, idx, max_new_tokens=64, temperature=0)   # greedy
    out = model.generate(idx, 64, temperature=0.8, top_k=40, seed=1)        # the same

Past the model's context the window slides: when the cache is full, the decoder starts
again from the last context/2 tokens (prefilled at positions 0..), so every token is
conditioned on between context/2 and context tokens before it; a prompt longer than the
context keeps its last `context` tokens. (Re-reading the whole window at every token, as an
uncached loop that crops would, costs a full forward per token.)
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Iterator

import torch
from torch import nn

from .fx.lower import lower, lowered, parts_of
from .nn.aggregate import FIXED_FOR
from .nn.parts import Parts
from .nn.sublayers import MLP, Attention, KVCache, Rotary, token_ids_in
from .words import counted


class Step:
    """What the current decoding step reads: the positions of its tokens ([T] long) and
    how many cache positions are filled after it (None: all, masked; fixed shapes)."""

    def __init__(self, device):
        self.one = torch.zeros(1, dtype=torch.long, device=device)  # a one-token step's
        self.positions = self.one
        self.end: int | None = None


class CachedAttention(nn.Module):
    """An attention sublayer that stores its keys and values in `cache`. It shows the
    sublayer's `norm` and takes `normed=` as the sublayer does, so the lowering fuses that
    PreNorm into the phase-2 merge before it in decoding too (restopo.fx.lower)."""

    def __init__(self, attention: Attention, cache: KVCache):
        super().__init__()
        self.attention, self.cache = attention, cache

    @property
    def norm(self) -> nn.Module:
        return self.attention.norm

    def forward(self, h, cos, sin, *, normed: bool = False):
        return self.attention(h, cos, sin, cache=self.cache, normed=normed)


class StepRotary(nn.Module):
    """The rotary context at the step's positions (the cached tokens came before)."""

    def __init__(self, rotary: Rotary, step: Step):
        super().__init__()
        self.rotary, self.step = rotary, step

    def forward(self, idx, v0):
        return self.rotary.at(self.step.positions, v0.dtype)


class LastPosition(nn.Module):
    """The head on the last position only: [B, T, d] -> logits [B, 1, vocab]."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, h):
        return self.head(h[:, -1:])


class Lookup(nn.Module):
    """The embedding's lookup without its check of the ids (TokenEmbedding): a decoding
    step's ids are tokens the model drew, after a prompt `stream` checks once, and reading
    them back at every step would stall it (a Python call on the CPU, a wait on CUDA)."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, idx):
        return nn.functional.embedding(idx, self.embed.weight)


class Decoder:
    """A cached view of `model` for `batch` sequences of up to `length` tokens.

    decoder(idx [B, T]) runs the T tokens after those already seen and returns the logits
    of the last one, [B, vocab]; the ids are not checked against the vocabulary here
    (`stream` checks its prompt). compile=True runs the one-token steps through
    torch.compile with fixed shapes (`fixed`, the default then): the step's position is
    updated in place and each cache is attended over its full length, masked.
    """

    def __init__(self, model: nn.Module, batch: int, length: int, *, compile: bool = False,
                 fixed: bool | None = None):
        gm = lowered(model)
        parts = parts_of(gm)
        require_own_sublayers(parts)
        rotary = parts.context
        if length > rotary.context:
            raise ValueError(f"prompt plus new tokens is {counted(length, 'token')}, longer "
                             f"than the model's context {rotary.context:,}; generate fewer "
                             f"tokens or shorten the prompt")
        weight = parts.embed.weight
        self.step = Step(weight.device)
        self.batch, self.length, self.pos = batch, length, 0
        self.caches: list[KVCache] = []
        subs = []
        for sub in parts.sublayers:
            if isinstance(sub, Attention):
                cache = KVCache(batch, sub.heads, weight.shape[1] // sub.heads, length,
                                dtype=weight.dtype, device=weight.device, step=self.step)
                self.caches.append(cache)
                sub = CachedAttention(sub, cache)
            subs.append(sub)
        self.graph = lower(gm.restopo_ir,
                           Parts(embed=Lookup(parts.embed), sublayers=subs, kinds=parts.kinds,
                                 head=LastPosition(parts.head),
                                 context=StepRotary(rotary, self.step),
                                 context_names=parts.context_names),
                           backend=gm.backend, two_phase=len(gm.phases) > 0,
                           aggregations=gm.aggregations, share=False)
        self.fixed = compile if fixed is None else fixed
        self.run = compiled_step(self.graph, weight.device) if compile else self.graph

    def reset(self) -> None:
        """Start a new sequence (the caches are overwritten as it goes: positions past the
        current one are never attended to). A sequence's weights are fixed, as its caches'
        keys and values were made with them: change the model's parameters between
        sequences, and its aggregation points check them again at the next one's first step
        (restopo.nn.aggregate.derived)."""
        self.pos = 0

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        if self.pos == 0:
            self.sequence = object()
        held, FIXED_FOR[0] = FIXED_FOR[0], self.sequence
        try:
            # Inference mode, not just no_grad: no version counters or view tracking on the
            # step's tensors, a few microseconds less per op, and a one-token step is many
            # small ops. The logits come back as a normal tensor (an inference tensor cannot
            # be changed in place outside inference mode: a user's `logits /= t` would fail).
            with torch.inference_mode():
                logits = self._run(idx)
        finally:
            FIXED_FOR[0] = held
        return logits.clone()

    def _run(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if B != self.batch or self.pos + T > self.length:
            raise ValueError(f"this decoder holds {counted(self.batch, 'sequence')} of up to "
                             f"{counted(self.length, 'token')}; got {B} x {T} after {self.pos}")
        one_step = self.fixed and T == 1 and self.pos > 0
        if one_step:  # fixed shapes: the same position tensor, updated in place (a new
            self.step.one.fill_(self.pos)  # object would make torch.compile recompile)
            self.step.positions, self.step.end = self.step.one, None
        else:
            self.step.positions = torch.arange(self.pos, self.pos + T, device=idx.device)
            self.step.end = self.pos + T
        logits = (self.run if one_step else self.graph)(idx)[:, -1]
        self.pos += T
        return logits


def compiled_step(graph: nn.Module, device: torch.device):
    """The one-token step under torch.compile, with fixed shapes. A step does little work
    per call (at batch 1 it streams the weights once), so what is paid around the kernels
    counts, and it grows with the number of modules and kernels, which depth attention
    adds (bench/decode.py, compiled, batch 1):
    - guards: the decoder's graph and modules are its own and never change while it lives,
      so only the tensor guards are kept (every tensor's dtype, device and shape: a model
      moved or cast after the decoder was made still recompiles);
    - on CPU the wrapper that calls the kernels is C++ (`cpp_wrapper`), not Python."""
    options = {}
    keep = getattr(torch.compiler, "keep_tensor_guards_unsafe", None)  # torch 2.7 on
    if keep is not None:
        options["guard_filter_fn"] = functools.partial(keep, keep_parameters=True)
    if torch.device(device).type == "cpu":
        options["cpp_wrapper"] = True
    return torch.compile(graph, dynamic=False, options=options)


def require_own_sublayers(parts: Parts) -> None:
    """Cached decoding knows restopo's own sublayers (attention with rotary, MLP)."""
    ok = isinstance(parts.context, Rotary) and all(
        isinstance(s, (Attention, MLP)) for s in parts.sublayers)
    if not ok:
        raise ValueError("cached generation works on models built by restopo.compile or "
                         "restopo.load (restopo's own attention and MLP, whose caches it "
                         "keeps); a rewired model keeps your sublayers: generate with your "
                         "model's own loop (a rewired Hugging Face model: "
                         "rewired.generate(...))")


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token [B] from logits [B, vocab]: argmax at temperature 0, else a draw from
    softmax(logits / temperature) kept to the top_k tokens and the top_p probability mass."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float()
    # shifted to a maximum of 0 first: a tiny temperature then sends the others to -inf
    # (towards greedy) rather than overflowing every logit to inf (a softmax of nans)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _whole(value) -> bool:
    """An int (numpy's and 0-d integer tensors too, by __index__), not a bool or a float."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)


def _check_sampling(max_new_tokens, temperature, top_k, top_p, seed=None) -> None:
    for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("seed", seed)):
        if value is not None and not _whole(value):
            raise TypeError(f"{name} must be a whole number (int); got {value!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be 0 or more; got {max_new_tokens}")
    if not temperature >= 0 or temperature == float("inf"):  # nan fails every comparison
        raise ValueError(f"temperature must be 0 (greedy) or a finite number above it; got "
                         f"{temperature}")
    if seed is not None and not -2 ** 63 <= seed < 2 ** 64:
        raise ValueError(f"seed must be a 64-bit number (-2^63 to 2^64 - 1); got {seed}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1; got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1]; got {top_p}")


def stream(model: nn.Module, idx: torch.Tensor, max_new_tokens: int,
           temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           seed: int | None = None, *, compile: bool = False) -> Iterator[torch.Tensor]:
    """The new tokens one step at a time, each [B] (see `generate`)."""
    _check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a tensor of token ids [batch, T] (torch.tensor(ids)); "
                        f"got {type(idx).__name__}")
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"idx must be token ids [batch, T] with T >= 1; got shape "
                         f"{tuple(idx.shape)}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise TypeError(f"idx must hold integer token ids (torch.long); got {idx.dtype}")
    if max_new_tokens == 0:
        return
    context = context_length(model)
    token_ids_in(idx, parts_of(lowered(model)).embed.weight.shape[0])
    decoder = Decoder(model, idx.shape[0], min(idx.shape[1] + max_new_tokens, context),
                      compile=compile)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=idx.device).manual_seed(seed)
    window = idx[:, -context:]  # the tokens the cache holds (or will, after a slide)
    logits = decoder(window)  # the prompt, through the model's forward graph
    for n in range(max_new_tokens):
        token = sample(logits, temperature, top_k, top_p, generator)
        yield token
        if n + 1 < max_new_tokens:
            window = torch.cat([window, token[:, None]], dim=1)
            if decoder.pos < decoder.length:
                logits = decoder(token[:, None])
            else:  # the cache is full: slide the window (see the module's docstring)
                window = window[:, -slide_keep(context):]
                decoder.reset()
                logits = decoder(window)


def slide_keep(context: int) -> int:
    """Tokens kept when the window slides past the context."""
    return max(1, context // 2)


def context_length(model: nn.Module) -> int:
    """The longest sequence the model's rotary positions cover (a model cached decoding
    does not know is refused here, before anything else reads its parts)."""
    parts = parts_of(lowered(model))
    require_own_sublayers(parts)
    return parts.context.context


def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, *, compile: bool = False) -> torch.Tensor:
    """idx [B, T] followed by `max_new_tokens` sampled tokens: [B, T + max_new_tokens].

    temperature 0 is greedy; top_k / top_p keep the k likeliest tokens / the smallest set
    with that much probability; seed makes the draws repeatable. The prompt runs through
    the model's forward once, then each token through the per-sublayer KV caches.
    compile=True runs the one-token steps through torch.compile.
    """
    with torch.no_grad():
        new = list(stream(model, idx, max_new_tokens, temperature, top_k, top_p, seed,
                          compile=compile))
    return torch.cat([idx, *(t[:, None] for t in new)], dim=1)
