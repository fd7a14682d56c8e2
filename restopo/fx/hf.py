"""Hugging Face causal LMs, taken apart by their family's known layer structure.

Their forward cannot be followed by symbolic tracing (input checks, cache objects, mask
builders), but each family's layout is fixed:

  Llama family (Llama, Mistral, Qwen2, Qwen3)
    model.embed_tokens -> for each layer in model.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), mask, rotary cos/sin, ...)[0]
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    -> model.norm -> lm_head -> loss_function
  GPT-2
    transformer.drop(wte(ids) + wpe(positions)) -> for each block in transformer.h:
        h = h + block.attn(block.ln_1(h), mask, ...)[0]
        h = h + block.mlp(block.ln_2(h))
    -> transformer.ln_f -> lm_head -> loss_function

The FrontAndBack classes below replay the model's own preparation (position ids, rotary
tables, the causal mask through transformers' own mask builders, the KV cache) and its head
(logits_to_keep, lm_head, the HF loss), so the rewired model takes the same arguments and
returns the same output class. The sequence KV cache works unchanged: depth aggregation
never mixes positions, and each attention still updates its own cache layer. rewire's
self-check holds the recovered pieces against the model's own forward, so a family member
that departs from its layout is refused, not silently changed.
"""
from __future__ import annotations

import abc
import dataclasses
import inspect

import torch
from torch import nn

from .structure import SUPPORTED, FrontAndBack, Recomputing, RewireError, Structure

# Llama-family class name -> how its layers choose an attention mask
LLAMA_FAMILY = {
    "LlamaForCausalLM": "full",
    "MistralForCausalLM": "sliding_window",  # every layer sliding when config.sliding_window
    "Qwen2ForCausalLM": "layer_types",       # config.layer_types[i]
    "Qwen3ForCausalLM": "layer_types",
}
FAMILIES = (*LLAMA_FAMILY, "GPT2LMHeadModel")


def is_hf(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__
               if c is not nn.Module)


def recover(model: nn.Module) -> Structure:
    name = type(model).__name__
    if name in LLAMA_FAMILY:
        return _llama(model, LLAMA_FAMILY[name])
    if name == "GPT2LMHeadModel":
        return _gpt2(model)
    raise RewireError(
        f"{name} is a Hugging Face model of a family rewire does not know (it cannot be "
        f"traced symbolically, and its layer structure is not registered). {SUPPORTED}")


def _require(model: nn.Module, paths: list[str]) -> None:
    missing = []
    for path in paths:
        try:
            model.get_submodule(path)
        except AttributeError:
            missing.append(path)
    if missing:
        raise RewireError(f"{type(model).__name__} lacks its family's layout "
                          f"({', '.join(missing[:4])} missing). {SUPPORTED}")


def _cache_arg(fn) -> str:
    """transformers 5 renamed past_key_values to cache; take whichever this version uses."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def _structure(model, subs, names, ends, context_names, layers) -> Structure:
    kinds = tuple(["attn", "mlp"] * (len(subs) // 2))
    cfg = model.config
    switched = Switched(model, subs, [_switch(model, layers[i // 2]) for i in range(len(subs))])
    return Structure(kinds=kinds, width=cfg.hidden_size,
                     sublayers=[Recomputing(switched, k) for k in range(len(subs))],
                     names=tuple(names), ends=ends, signature=ends.signature,
                     family=type(model).__name__, vocab=cfg.vocab_size,
                     context_names=context_names)


class Switched:
    """The sublayers, each recomputed while its decoder layer's gradient checkpointing is on
    in training, as that layer is (the source of Recomputing)."""

    def __init__(self, model: nn.Module, sublayers: list[nn.Module], switches: list):
        self.model, self.sublayers, self.switches = model, sublayers, switches

    def sublayer(self, k: int) -> nn.Module:
        return self.sublayers[k]

    def recomputes(self, k: int) -> bool:
        switch = self.switches[k]
        return switch is not None and switch.gradient_checkpointing and self.model.training


def _switches(model: nn.Module) -> tuple[nn.Module, ...]:
    """The modules whose gradient_checkpointing flag Hugging Face reads (each decoder layer
    in transformers 5, the model that runs them before), found once: the model's own
    is_activation_checkpointing walks every module at each call (asked by every sublayer,
    tens of ms of Python a forward at 32 layers)."""
    return tuple(m for m in model.modules() if hasattr(m, "gradient_checkpointing"))


def _switch(model: nn.Module, layer: nn.Module) -> nn.Module | None:
    """The flag that decides whether `layer` is checkpointed: its own, else the model's."""
    if hasattr(layer, "gradient_checkpointing"):
        return layer
    return next(iter(_switches(model)), None)


# ------------------------------------------------------------------ Llama family

class LlamaAttention(nn.Module):
    """v = self_attn(input_layernorm(h), ...)[0], called as the decoder layer calls it."""

    def __init__(self, layer: nn.Module, mask_type: str, cache_arg: str):
        super().__init__()
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn
        self.mask_type, self.cache_arg = mask_type, cache_arg

    def forward(self, h, cos, sin, position_ids, masks, cache, use_cache):
        out, _ = self.self_attn(hidden_states=self.input_layernorm(h),
                                attention_mask=masks[self.mask_type], position_ids=position_ids,
                                use_cache=use_cache, position_embeddings=(cos, sin),
                                **{self.cache_arg: cache})
        return out


class NormMLP(nn.Module):
    """v = mlp(norm(h)); the context is not read."""

    def __init__(self, norm: nn.Module, mlp: nn.Module):
        super().__init__()
        self.norm, self.mlp = norm, mlp

    def forward(self, h, *context):
        return self.mlp(self.norm(h))


def _llama(model: nn.Module, rule: str) -> Structure:
    _require(model, ["model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb",
                     "lm_head"])
    layers = model.model.layers
    for i in range(len(layers)):
        _require(model, [f"model.layers.{i}.{a}" for a in
                         ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")])
    cfg, n = model.config, len(layers)
    if rule == "layer_types" and getattr(cfg, "layer_types", None):
        types = list(cfg.layer_types[:n])
    elif rule == "sliding_window" and getattr(cfg, "sliding_window", None) is not None:
        types = ["sliding_attention"] * n
    else:
        types = ["full_attention"] * n
    cache_arg = _cache_arg(type(layers[0]).forward)
    subs, names = [], []
    for i, (layer, t) in enumerate(zip(layers, types)):
        subs += [LlamaAttention(layer, t, cache_arg),
                 NormMLP(layer.post_attention_layernorm, layer.mlp)]
        names += [f"model.layers.{i}.input_layernorm + model.layers.{i}.self_attn",
                  f"model.layers.{i}.post_attention_layernorm + model.layers.{i}.mlp"]
    return _structure(model, subs, names, LlamaFrontAndBack(model, cache_arg, set(types)),
                      ("cos", "sin", "position_ids", "masks", "cache", "use_cache"), layers)


class CausalLMFrontAndBack(abc.ABC):
    """Front and back of an HF causal LM around its residual stream. A plain object with
    methods (not closures), so that copy.deepcopy of a rewired model copies it along with
    the model it calls. Subclasses give `front` and `context`."""

    output_class = "CausalLMOutputWithPast"
    cache_needs_use_cache = False  # GPT-2 returns its cache only when use_cache is set

    def __init__(self, model: nn.Module, cache_arg: str):
        self.model, self.cache_arg = model, cache_arg
        self.switches = _switches(model)
        self.signature = inspect.signature(model.forward)
        self.names = list(self.signature.parameters)

    def __call__(self, key) -> FrontAndBack:  # every call pattern runs the same code
        return FrontAndBack(front=self.front, context=self.context, extra=self.extra,
                            back=self.back, prepare=self.prepare)

    def arg(self, values, key):
        a = dict(zip(self.names, values))
        if key in a:
            return a[key]
        return (a.get("kwargs") or {}).get(key)

    def prepare(self, *values):
        """Fill in what the model's forward would: use_cache, a fresh cache, position ids."""
        a = dict(zip(self.names, values))
        kw = dict(a.get("kwargs") or {})
        for old in ("past_key_values", "cache"):  # either spelling of the cache argument
            if old != self.cache_arg and old in kw:
                a[self.cache_arg] = kw.pop(old)
        a["kwargs"] = kw
        ids, embeds = a.get("input_ids"), a.get("inputs_embeds")
        if (ids is None) == (embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if a.get("encoder_hidden_states") is not None:
            raise ValueError("a rewired model has no cross-attention; encoder_hidden_states "
                             "is not supported")
        use_cache = a.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.model.config, "use_cache", False)
        if (use_cache and self.model.training and torch.is_grad_enabled()
                and any(m.gradient_checkpointing for m in self.switches)):
            use_cache = False  # as the model's layers do: a recomputed attention would
            # append its keys to the cache again
        a["use_cache"] = use_cache
        cache = a.get(self.cache_arg)
        if use_cache and cache is None:
            from transformers import DynamicCache
            cache = a[self.cache_arg] = DynamicCache(config=self.model.config)
        if a.get("position_ids") is None:
            x = ids if ids is not None else embeds
            seen = cache.get_seq_length() if cache is not None else 0
            a["position_ids"] = (torch.arange(x.shape[1], device=x.device) + seen).unsqueeze(0)
        return tuple(a.get(n) for n in self.names)

    def masks(self, v0, values, types):
        from transformers import masking_utils
        mask = self.arg(values, "attention_mask")
        if isinstance(mask, dict):  # prepared by generate
            return mask
        if mask is not None and mask.ndim < 4:
            mask = mask.view(v0.shape[0], -1)
        builders = {"full_attention": masking_utils.create_causal_mask,
                    "sliding_attention": masking_utils.create_sliding_window_causal_mask}
        return {t: builders[t](config=self.model.config, inputs_embeds=v0, attention_mask=mask,
                               position_ids=self.arg(values, "position_ids"),
                               **{self.cache_arg: self.arg(values, self.cache_arg)})
                for t in sorted(types)}

    def extra(self, *values):
        return (self.arg(values, "labels"), self.arg(values, "logits_to_keep"),
                self.arg(values, self.cache_arg), self.arg(values, "use_cache"),
                self.arg(values, "kwargs") or {})

    @abc.abstractmethod
    def final_norm(self, h):
        """The family's final norm of h_{L+1}; each family's subclass says where it lives."""

    def back(self, h, labels, logits_to_keep, cache, use_cache, kwargs):
        from transformers import modeling_outputs
        model = self.model
        hs = self.final_norm(h)
        keep = 0 if logits_to_keep is None else logits_to_keep
        if isinstance(keep, int):  # 0 keeps every position
            hs = hs[:, slice(-keep, None), :]
        elif keep.ndim == 2:
            hs = hs[keep] if keep.dtype == torch.bool else torch.take_along_dim(
                hs, keep[..., None], dim=1)
        else:
            hs = hs[:, keep, :]
        logits = model.lm_head(hs)
        loss = None
        if labels is not None:
            loss = model.loss_function(logits=logits, labels=labels,
                                       vocab_size=model.config.vocab_size, **kwargs)
        output = getattr(modeling_outputs, self.output_class)
        fields = {f.name for f in dataclasses.fields(output)}
        out_cache = "cache" if "cache" in fields else "past_key_values"
        if self.cache_needs_use_cache and not use_cache:
            cache = None
        return output(loss=loss, logits=logits, **{out_cache: cache})


class LlamaFrontAndBack(CausalLMFrontAndBack):
    def __init__(self, model: nn.Module, cache_arg: str, mask_types: set[str]):
        super().__init__(model, cache_arg)
        self.mask_types = mask_types

    def front(self, *values):
        emb = self.arg(values, "inputs_embeds")
        return self.model.model.embed_tokens(self.arg(values, "input_ids")) if emb is None else emb

    def context(self, v0, *values):
        position_ids = self.arg(values, "position_ids")
        cos, sin = self.model.model.rotary_emb(v0, position_ids)
        return (cos, sin, position_ids, self.masks(v0, values, self.mask_types),
                self.arg(values, self.cache_arg), self.arg(values, "use_cache"))

    def final_norm(self, h):
        return self.model.model.norm(h)


# ------------------------------------------------------------------ GPT-2

class GPT2Attention(nn.Module):
    """v = attn(ln_1(h), ...)[0], called as GPT2Block calls it."""

    def __init__(self, block: nn.Module, cache_arg: str):
        super().__init__()
        self.ln_1, self.attn, self.cache_arg = block.ln_1, block.attn, cache_arg

    def forward(self, h, position_ids, mask, cache, use_cache):
        out, _ = self.attn(self.ln_1(h), attention_mask=mask, use_cache=use_cache,
                           position_ids=position_ids, **{self.cache_arg: cache})
        return out


def _gpt2(model: nn.Module) -> Structure:
    if getattr(model.config, "add_cross_attention", False):
        raise RewireError("GPT2LMHeadModel with cross-attention has three sublayers per "
                          f"block; rewire takes attention and MLP only. {SUPPORTED}")
    _require(model, ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h",
                     "transformer.ln_f", "lm_head"])
    blocks = model.transformer.h
    cache_arg = _cache_arg(type(blocks[0]).forward)
    subs, names = [], []
    for i, block in enumerate(blocks):
        _require(model, [f"transformer.h.{i}.{a}" for a in ("ln_1", "attn", "ln_2", "mlp")])
        subs += [GPT2Attention(block, cache_arg), NormMLP(block.ln_2, block.mlp)]
        names += [f"transformer.h.{i}.ln_1 + transformer.h.{i}.attn",
                  f"transformer.h.{i}.ln_2 + transformer.h.{i}.mlp"]
    return _structure(model, subs, names, GPT2FrontAndBack(model, cache_arg),
                      ("position_ids", "mask", "cache", "use_cache"), blocks)


class GPT2FrontAndBack(CausalLMFrontAndBack):
    output_class = "CausalLMOutputWithCrossAttentions"
    cache_needs_use_cache = True

    def front(self, *values):
        t = self.model.transformer
        emb = self.arg(values, "inputs_embeds")
        ids = self.arg(values, "input_ids")
        if emb is None:
            emb = t.wte(ids.view(-1, ids.shape[-1]))
        h = emb + t.wpe(self.arg(values, "position_ids")).to(emb.device)
        token_types = self.arg(values, "token_type_ids")
        if token_types is not None:
            h = h + t.wte(token_types.view(-1, token_types.shape[-1]))
        return t.drop(h)

    def context(self, v0, *values):
        mask = self.masks(v0, values, {"full_attention"})["full_attention"]
        return (self.arg(values, "position_ids"), mask, self.arg(values, self.cache_arg),
                self.arg(values, "use_cache"))

    def final_norm(self, h):
        return self.model.transformer.ln_f(h)
