"""Hugging Face Llama-family causal LMs, taken apart by their known layer structure.

Their forward cannot be followed by symbolic tracing (input checks, cache objects, mask
builders), but the family's layout is fixed:

    model.embed_tokens -> for each layer in model.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), mask, rotary cos/sin, ...)[0]
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    -> model.norm -> lm_head -> loss_function

The front below replays the model's own preparation (position ids, `model.rotary_emb`,
the causal mask through transformers' own mask builders, the KV cache), and the back its
head (logits_to_keep, lm_head, the HF loss), so the rewired model takes the same arguments
and returns a CausalLMOutputWithPast. The sequence KV cache works unchanged: depth
aggregation never mixes positions, and each attention still updates its own cache layer.
rewire's self-check holds the recovered pieces against the model's own forward, so a
family member that departs from this layout is refused, not silently changed.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from .structure import SUPPORTED, Ends, RewireError, Structure

# class name -> how its layers choose an attention mask
FAMILIES = {
    "LlamaForCausalLM": "full",
    "MistralForCausalLM": "sliding_window",  # every layer sliding when config.sliding_window
    "Qwen2ForCausalLM": "layer_types",       # config.layer_types[i]
    "Qwen3ForCausalLM": "layer_types",
}


def is_hf(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__
               if c is not nn.Module)


def _mask_types(model: nn.Module, rule: str) -> list[str]:
    cfg, n = model.config, len(model.model.layers)
    if rule == "layer_types" and getattr(cfg, "layer_types", None):
        return list(cfg.layer_types[:n])
    if rule == "sliding_window" and getattr(cfg, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _check_layout(model: nn.Module) -> None:
    name = type(model).__name__
    base = getattr(model, "model", None)
    need = [("model", base), ("lm_head", getattr(model, "lm_head", None))]
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        need.append((f"model.{attr}", getattr(base, attr, None)))
    missing = [n for n, v in need if v is None]
    for i, layer in enumerate(getattr(base, "layers", []) or []):
        for attr in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            if getattr(layer, attr, None) is None:
                missing.append(f"model.layers.{i}.{attr}")
    if missing:
        raise RewireError(f"{name} lacks the Llama-family layout ({', '.join(missing[:4])} "
                          f"missing). {SUPPORTED}")


class AttentionSublayer(nn.Module):
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


class MLPSublayer(nn.Module):
    """v = mlp(post_attention_layernorm(h)); the context is not read."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, layer.mlp

    def forward(self, h, *context):
        return self.mlp(self.post_attention_layernorm(h))


def recover(model: nn.Module) -> Structure:
    name = type(model).__name__
    if name not in FAMILIES:
        raise RewireError(
            f"{name} is a Hugging Face model of a family rewire does not know (it cannot be "
            f"traced symbolically, and its layer structure is not registered). {SUPPORTED}")
    _check_layout(model)
    base = model.model
    layer_sig = inspect.signature(type(base.layers[0]).forward).parameters
    cache_arg = "cache" if "cache" in layer_sig else "past_key_values"
    types = _mask_types(model, FAMILIES[name])
    subs, names, kinds = [], [], []
    for i, (layer, t) in enumerate(zip(base.layers, types)):
        subs += [AttentionSublayer(layer, t, cache_arg), MLPSublayer(layer)]
        names += [f"model.layers.{i}.input_layernorm + model.layers.{i}.self_attn",
                  f"model.layers.{i}.post_attention_layernorm + model.layers.{i}.mlp"]
        kinds += ["attn", "mlp"]
    signature = inspect.signature(model.forward)
    ends = _ends(model, signature, cache_arg, set(types))
    return Structure(kinds=tuple(kinds), width=model.config.hidden_size, sublayers=subs,
                     names=tuple(names), ends=lambda key: ends, signature=signature,
                     family=name, vocab=model.config.vocab_size,
                     context_names=("cos", "sin", "position_ids", "masks", "cache",
                                    "use_cache"))


def _ends(model: nn.Module, signature: inspect.Signature, cache_arg: str,
          mask_types: set[str]) -> Ends:
    from transformers import masking_utils
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base, cfg = model.model, model.config
    names = list(signature.parameters)
    out_fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    out_cache = "cache" if "cache" in out_fields else "past_key_values"
    builders = {"full_attention": masking_utils.create_causal_mask,
                "sliding_attention": masking_utils.create_sliding_window_causal_mask}

    def arg(values, key):
        a = dict(zip(names, values))
        if key in a:
            return a[key]
        return a.get("kwargs", {}).get(key)

    def prepare(*values):
        a = dict(zip(names, values))
        kw = dict(a.get("kwargs") or {})
        for old in ("past_key_values", "cache"):  # either spelling of the cache argument
            if old != cache_arg and old in kw:
                a[cache_arg] = kw.pop(old)
        a["kwargs"] = kw
        if (a.get("input_ids") is None) == (a.get("inputs_embeds") is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        use_cache = a.get("use_cache")
        if use_cache is None:
            use_cache = getattr(cfg, "use_cache", False)
        a["use_cache"] = use_cache
        if use_cache and a.get(cache_arg) is None:
            from transformers import DynamicCache
            a[cache_arg] = DynamicCache(config=cfg)
        return tuple(a.get(n) for n in names)

    def front(*values):
        emb = arg(values, "inputs_embeds")
        return base.embed_tokens(arg(values, "input_ids")) if emb is None else emb

    def context(v0, *values):
        cache = arg(values, cache_arg)
        position_ids = arg(values, "position_ids")
        if position_ids is None:
            seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(v0.shape[1], device=v0.device) + seen).unsqueeze(0)
        mask = arg(values, "attention_mask")
        if isinstance(mask, dict):  # prepared by generate
            masks = mask
        else:
            masks = {t: builders[t](config=cfg, inputs_embeds=v0, attention_mask=mask,
                                    position_ids=position_ids, **{cache_arg: cache})
                     for t in mask_types}
        cos, sin = base.rotary_emb(v0, position_ids)
        return cos, sin, position_ids, masks, cache, arg(values, "use_cache")

    def extra(*values):
        return (arg(values, "labels"), arg(values, "logits_to_keep"), arg(values, cache_arg),
                arg(values, "kwargs") or {})

    def back(h, labels, logits_to_keep, cache, kwargs):
        hs = base.norm(h)
        keep = 0 if logits_to_keep is None else logits_to_keep
        if isinstance(keep, int):
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
                                       vocab_size=cfg.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{out_cache: cache})

    return Ends(front=front, context=context, extra=extra, back=back, prepare=prepare)
