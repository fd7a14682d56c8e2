"""Structure recovery by torch.fx tracing: what it finds, and what it refuses."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import restopo
from restopo.fx.rewire import RewireError, RewireWarning, recover, rewire
from restopo.fx.tracer import classify

from models import attnres_loop as loop
from models.rewired import randomise
from models.metallama import ModelArgs, Transformer
from models.nanogpt import GPT, GPTConfig


def metallama(n_layers=3, seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelArgs(n_layers=n_layers))


def metallama_pieces(m, idx):
    T = idx.shape[1]
    cos, sin = m.cos[:T], m.sin[:T]
    subs = []
    for layer in m.layers:
        subs.append(lambda h, ly=layer: ly.attention(ly.attention_norm(h), cos, sin))
        subs.append(lambda h, ly=layer: ly.feed_forward(ly.ffn_norm(h)))
    return m.tok_embeddings(idx), subs, lambda h: m.output(m.norm(h))


def tokens(T=10, seed=1):
    return torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(seed))


def test_recovers_nanogpt_sublayers_in_order():
    s = recover(GPT(GPTConfig(n_layer=2)))
    assert s.kinds == ("attn", "mlp", "attn", "mlp")
    assert s.width == 32 and s.vocab == 128
    assert s.names[1] == "transformer.h.0.ln_2 + transformer.h.0.mlp"


def test_context_read_by_every_sublayer_is_passed_along():
    m = metallama().double()
    s = recover(m)
    assert s.context_names == ("cos", "sin")
    idx = tokens()
    torch.testing.assert_close(rewire(m, "residual standard\n")(idx), m(idx), rtol=0, atol=1e-12)


def test_metallama_random_queries_equal_the_naive_loop():
    m = metallama().double()
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for a in restopo.aggregations(r):
            a.pseudo_query.copy_(torch.randn(32, generator=g, dtype=torch.float64))
    idx = tokens()
    v0, subs, head = metallama_pieces(m, idx)
    queries = [a.pseudo_query for a in restopo.aggregations(r)]
    gains = [a.key_norm.weight for a in restopo.aggregations(r)]
    want = loop.run(v0, subs, head, loop.layer_blocks(3, 2), loop.attend, queries, gains)
    torch.testing.assert_close(r(idx), want, rtol=0, atol=1e-10)


def test_moving_the_rewired_model_moves_the_buffers_it_reads():
    """.double() replaces the model's rotary buffers; the traced pieces must follow."""
    m = metallama()
    r = rewire(m, "residual full_attnres\n").double()
    assert m.cos.dtype == torch.float64
    idx = tokens()
    v0, subs, head = metallama_pieces(m, idx)
    want = loop.run(v0, subs, head, loop.full_blocks(6), loop.mean)
    torch.testing.assert_close(r(idx), want, rtol=0, atol=1e-10)


class FlagGPT(GPT):
    """Branches on a bool argument: each value is traced as its own call pattern."""

    def forward(self, idx, targets=None, double_logits: bool = False):
        logits, loss = super().forward(idx, targets)
        if double_logits:
            logits = 2 * logits
        return logits, loss


def test_scalar_arguments_are_traced_per_value():
    torch.manual_seed(0)
    m = FlagGPT(GPTConfig()).double()
    r = rewire(m, "residual standard\n")
    idx = tokens()
    for flag in (False, True):
        torch.testing.assert_close(r(idx, idx, double_logits=flag)[0],
                                   m(idx, idx, double_logits=flag)[0], rtol=0, atol=1e-12)


class HiddenStatesGPT(GPT):
    """Returns every block's output as well: there is no such value once rewired."""

    def forward(self, idx):
        x = self.transformer.wte(idx)
        states = []
        for block in self.transformer.h:
            x = block(x)
            states.append(x)
        return self.lm_head(self.transformer.ln_f(x)), states


def test_reading_hidden_states_between_sublayers_is_refused():
    with pytest.raises(RewireError, match="reads the hidden state"):
        rewire(HiddenStatesGPT(GPTConfig()), "residual full_attnres\n")


class ParallelBlock(nn.Module):
    """GPT-J style: attention and MLP read the same norm and add together."""

    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.mlp.__class__ = type("MLP", (nn.Sequential,), {})

    def forward(self, x):
        y = self.ln(x)
        return x + self.attn(y, y, y, need_weights=False)[0] + self.mlp(y)


class ParallelModel(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Embedding(128, d)
        self.blocks = nn.ModuleList(ParallelBlock(d) for _ in range(2))
        self.head = nn.Linear(d, 128)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_parallel_block_is_refused():
    with pytest.raises(RewireError, match="parallel sublayers"):
        rewire(ParallelModel(), "residual full_attnres\n")


def test_a_model_restopo_made_is_not_rewired_again():
    """Rewiring a rewired (or compiled) model failed deep in torch.fx ("Proxy object cannot
    be iterated"); it is refused in words, pointing at the original."""
    r = rewire(GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16)),
               "residual full_attnres\n")
    with pytest.raises(RewireError, match=r"rewired by restopo already.*rewired\.model"):
        rewire(r, "residual standard\n")
    import restopo
    built = restopo.compile("model t { vocab: 32; width: 16; depth: 2; heads: 2; context: 8 }"
                            "\nresidual standard\n")
    with pytest.raises(RewireError, match="built by restopo already.*restopo.compile"):
        rewire(built, "residual full_attnres\n")


def test_classify_by_class_name():
    assert classify(nn.LayerNorm(4)) == "norm" and classify(nn.RMSNorm(4)) == "norm"
    assert classify(nn.MultiheadAttention(4, 1)) == "attn"
    assert classify(GPT(GPTConfig()).transformer.h[0].mlp) == "mlp"
    assert classify(nn.Linear(2, 2)) is None


class PosModuleGPT(GPT):
    """An embedding that adds a learned position module reading x: part of v_0, not a
    sublayer."""

    def __init__(self, config):
        super().__init__(config)
        self.pos = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)
        x = x + self.pos(x)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x)), None


def test_adds_before_the_first_sublayer_belong_to_the_embedding():
    torch.manual_seed(0)
    m = PosModuleGPT(GPTConfig()).double()
    s = recover(m)
    assert s.kinds == ("attn", "mlp", "attn", "mlp")
    idx = tokens()
    torch.testing.assert_close(rewire(m, "residual standard\n")(idx)[0], m(idx)[0],
                               rtol=0, atol=1e-12)


class GuardedGPT(GPT):
    """Guards on the traced length written as `if ...: raise`, both ways round."""

    def forward(self, idx, targets=None):
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds the block size")
        if not t >= 1:
            raise ValueError("empty sequence")
        return super().forward(idx, targets)


def test_guards_that_raise_are_traced_through():
    torch.manual_seed(0)
    m = GuardedGPT(GPTConfig()).double()
    r = rewire(m, "residual standard\n")
    idx = tokens()
    torch.testing.assert_close(r(idx, idx)[1], m(idx, idx)[1], rtol=0, atol=1e-12)
    with pytest.raises(Exception, match="guard"):
        r(torch.zeros(1, 65, dtype=torch.long))


class AttentionBlock(nn.Module):
    """Named like an attention, but a whole block with its PreNorm: traced through."""

    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.moe = MoE(d)

    def forward(self, x):
        y = self.norm(x)
        mask = x.new_ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        x = x + self.attn(y, y, y, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class MoE(nn.Module):
    """Soft mixture of two expert MLPs: one sublayer, one leaf."""

    def __init__(self, d):
        super().__init__()
        self.gate = nn.Linear(d, 2)
        self.experts = nn.ModuleList(
            type("ExpertMLP", (nn.Sequential,), {})(nn.Linear(d, 2 * d), nn.GELU(),
                                                    nn.Linear(2 * d, d)) for _ in range(2))

    def forward(self, x):
        w = torch.softmax(self.gate(x), -1)
        return sum(w[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


class BlockModel(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Embedding(128, d)
        self.blocks = nn.ModuleList(AttentionBlock(d) for _ in range(2))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 128)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def test_blocks_named_like_sublayers_are_traced_through_and_moe_is_one_leaf():
    torch.manual_seed(0)
    m = BlockModel().double()
    s = recover(m)
    assert s.kinds == ("attn", "mlp", "attn", "mlp")
    assert s.names[1] == "blocks.0.norm2 + blocks.0.moe"
    idx = tokens()
    torch.testing.assert_close(rewire(m, "residual standard\n")(idx), m(idx), rtol=0, atol=1e-12)
    r = rewire(m, "residual full_attnres\n")
    assert r(idx).shape == (2, 10, 128)


def test_classify_norms_by_the_end_of_the_class_name():
    from models.nanogpt import PostNormBlock
    for name in ("LayerNorm", "LlamaRMSNorm", "BatchNorm1d", "T5LayerNorm"):
        assert classify(type(name, (nn.Module,), {})()) == "norm", name
    assert classify(PostNormBlock(GPTConfig())) is None


class FunctionalDropoutGPT(GPT):
    """Reads self.training in its own forward (functional dropout on the embedding)."""

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1))
        x = F.dropout(self.transformer.wte(idx) + self.transformer.wpe(pos), 0.5, self.training)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x)), None


def test_train_and_eval_are_traced_apart():
    torch.manual_seed(0)
    m = FunctionalDropoutGPT(GPTConfig()).double()
    r = rewire(m, "residual standard\n").train()
    idx = tokens()
    assert not torch.equal(r(idx)[0], r(idx)[0])  # dropout on
    r.eval()
    torch.testing.assert_close(r(idx)[0], m(idx)[0], rtol=0, atol=1e-12)


class FunctionalDropoutBlock(nn.Module):
    """Dropout on the branch written in the block itself: the sublayer reads self.training."""

    def __init__(self, config):
        super().__init__()
        from models.nanogpt import MLP, CausalSelfAttention, LayerNorm
        self.ln_1, self.attn = LayerNorm(config.n_embd, True), CausalSelfAttention(config)
        self.ln_2, self.mlp = LayerNorm(config.n_embd, True), MLP(config)

    def forward(self, x):
        x = x + F.dropout(self.attn(self.ln_1(x)), 0.5, self.training)
        return x + F.dropout(self.mlp(self.ln_2(x)), 0.5, self.training)


class BranchDropoutGPT(GPT):
    block = FunctionalDropoutBlock


def test_sublayers_that_read_training_are_traced_per_mode():
    torch.manual_seed(0)
    m = BranchDropoutGPT(GPTConfig()).double()  # built in train mode
    r = rewire(m, "residual full_attnres\n").train()
    idx, _ = tokens(), None
    assert not torch.equal(r(idx)[0], r(idx)[0])
    r.eval()
    torch.testing.assert_close(r(idx)[0], r(idx)[0], rtol=0, atol=0)
    torch.testing.assert_close(rewire(m.eval(), "residual standard\n")(idx)[0], m(idx)[0],
                               rtol=0, atol=1e-12)


class AuxMoE(nn.Module):
    """An MoE MLP that returns (output, load-balancing loss), as Switch/Mixtral-style ones do."""

    def __init__(self, config):
        super().__init__()
        from models.nanogpt import MLP
        self.gate = nn.Linear(config.n_embd, 2)
        self.experts = nn.ModuleList(MLP(config) for _ in range(2))

    def forward(self, x):
        w = torch.softmax(self.gate(x), -1)
        aux = (w.mean((0, 1)) ** 2).sum()
        return sum(w[..., i:i + 1] * e(x) for i, e in enumerate(self.experts)), aux


class AuxDroppedBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        from models.nanogpt import CausalSelfAttention, LayerNorm
        self.ln_1, self.attn = LayerNorm(config.n_embd, True), CausalSelfAttention(config)
        self.ln_2, self.mlp = LayerNorm(config.n_embd, True), AuxMoE(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        y, _ = self.mlp(self.ln_2(x))  # the aux loss is not used
        return x + y


class AuxDroppedGPT(GPT):
    block = AuxDroppedBlock


def test_a_tuple_output_item_never_read_is_no_read_of_the_sublayer():
    """`y, _ = self.mlp(...)` traces a getitem of the unused aux loss too: it was refused as
    reading the hidden state between sublayers; the unread item is dropped."""
    torch.manual_seed(0)
    m = AuxDroppedGPT(GPTConfig(n_layer=2)).double()
    idx = tokens()
    torch.testing.assert_close(rewire(m, "residual standard\n")(idx, idx)[1], m(idx, idx)[1],
                               rtol=0, atol=1e-12)
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    queries, gains = randomise(r)
    tr = m.transformer
    v0 = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
    subs = [f for b in tr.h for f in (lambda h, b=b: b.attn(b.ln_1(h)),
                                      lambda h, b=b: b.mlp(b.ln_2(h))[0])]
    head = lambda h: m.lm_head(tr.ln_f(h))  # noqa: E731
    want = loop.run(v0, subs, head, loop.layer_blocks(2, 2), loop.attend, queries, gains)
    torch.testing.assert_close(r(idx, idx)[0], want, rtol=0, atol=1e-10)


class AuxReadBlock(AuxDroppedBlock):
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        y, aux = self.mlp(self.ln_2(x))
        return x + y, aux


class AuxReadGPT(GPT):
    block = AuxReadBlock

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        aux_total = 0
        for block in self.transformer.h:
            x, aux = block(x)
            aux_total = aux_total + aux
        return self.lm_head(self.transformer.ln_f(x)), aux_total


class AuxKeptMoE(AuxMoE):
    """What the refusal says to do: keep the aux loss on the module."""

    def forward(self, x):
        y, self.aux_loss = super().forward(x)
        return y


class AuxKeptBlock(AuxDroppedBlock):
    def __init__(self, config):
        super().__init__(config)
        self.mlp = AuxKeptMoE(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class AuxKeptGPT(GPT):
    block = AuxKeptBlock


def test_a_second_output_read_outside_its_sublayer_is_refused_naming_it():
    """An MoE's aux loss summed by the model was refused as `getitem_1` reading the hidden
    state `transformer_h_0_mlp`: fx's names, and no word of what to do."""
    with pytest.raises(RewireError, match=r"AuxReadGPT: `transformer\.h\.0\.mlp\(\.\.\.\)"
                       r"\[1\]` is read outside the sublayer `transformer\.h\.0\.ln_2 \+ "
                       r"transformer\.h\.0\.mlp`.*self\.aux_loss = "):
        rewire(AuxReadGPT(GPTConfig(n_layer=2)), "residual standard\n")
    m = AuxKeptGPT(GPTConfig(n_layer=2))
    rewire(m, "residual full_attnres\n")(tokens())
    assert all(b.mlp.aux_loss.requires_grad for b in m.transformer.h)


class ListGPT(GPT):
    """Its blocks in a plain Python list (not registered), or in an nn.ModuleDict."""

    def __init__(self, config, holder=list):
        super().__init__(config)
        blocks = {f"b{i}": self.block(config) for i in range(config.n_layer)}
        self.blocks = list(blocks.values()) if holder is list else holder(blocks)

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in (self.blocks if isinstance(self.blocks, list) else self.blocks.values()):
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def test_blocks_in_a_plain_list_are_refused_naming_where_they_are():
    """torch.fx's 'module is not installed as a submodule' named neither the module nor the
    fix."""
    with pytest.raises(RewireError, match=r"ListGPT: `blocks\[0\]` \(a Block in a plain list\) "
                       r"is not a registered submodule.*nn\.ModuleList"):
        rewire(ListGPT(GPTConfig()), "residual standard\n")
    torch.manual_seed(0)
    m = ListGPT(GPTConfig(), holder=nn.ModuleDict).double()
    torch.testing.assert_close(rewire(m, "residual standard\n")(tokens()), m(tokens()),
                               rtol=0, atol=1e-12)


class CheckpointedGPT(GPT):
    """Activation checkpointing of every block, as training scripts switch it on."""

    checkpointing = True

    def forward(self, idx, targets=None):
        from torch.utils.checkpoint import checkpoint
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.lm_head(self.transformer.ln_f(x))


def forward_calls(monkeypatch, cls) -> list:
    """Counts the forward calls of every `cls` module (recomputations in backward too)."""
    calls, forward = [], cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    return calls


class ConfigCheckpointedGPT(GPT):
    """The switch on its config, as nanoGPT forks keep it."""

    def forward(self, idx, targets=None):
        from torch.utils.checkpoint import checkpoint
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = (checkpoint(block, x, use_reentrant=False) if self.config.checkpointing
                 else block(x))
        return self.lm_head(self.transformer.ln_f(x))


@pytest.mark.parametrize("switch", ["module", "config"])
@pytest.mark.parametrize("on_at_rewire", [True, False])
def test_a_model_that_checkpoints_its_blocks_is_rewired_recomputing(monkeypatch, on_at_rewire,
                                                                     switch):
    """The trace calls checkpointed blocks plainly: the rewired model kept every activation
    for backward where the original recomputed them. Then it recomputed as the model did at
    rewire, for good: its switch turned after rewiring was not followed, as a Hugging Face
    model's is. Its sublayers now recompute while the model checkpoints them."""
    from models.nanogpt import MLP
    torch.manual_seed(0)
    m = (CheckpointedGPT if switch == "module" else ConfigCheckpointedGPT)(GPTConfig()).double()
    holder = m if switch == "module" else m.config
    holder.checkpointing = on_at_rewire
    r = rewire(m, "residual full_attnres\n")
    randomise(r)
    calls = forward_calls(monkeypatch, MLP)

    def grads(on):
        holder.checkpointing = on
        calls.clear()
        m.zero_grad()
        r(tokens()).sum().backward()
        assert len(calls) == 2 * (1 + on)  # two MLPs, each run again in backward or not
        return [p.grad.clone() for p in m.parameters()]
    got = [grads(on) for on in (not on_at_rewire, on_at_rewire, not on_at_rewire)]
    for a, b in zip(*got[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


class RenamedSwitchGPT(GPT):
    """Checkpointing switched by attributes not named for it, read where checkpoint is
    called: `grad_ckpt` on the model, `remat` on its config, checkpoint imported as `ckpt`."""

    grad_ckpt = False

    def __init__(self, config):
        super().__init__(config)
        config.remat = False

    def forward(self, idx, targets=None):
        from torch.utils.checkpoint import checkpoint as ckpt
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            on = self.grad_ckpt or self.config.remat
            x = ckpt(block, x, use_reentrant=False) if on else block(x)
        return self.lm_head(self.transformer.ln_f(x))


@pytest.mark.parametrize("switch", ["grad_ckpt", "remat"])
def test_a_checkpointing_switch_of_any_name_is_followed(monkeypatch, switch):
    """Switches were found by name (`checkpoint` in it): one named grad_ckpt or remat was
    traced as it was at rewire and never read again, so turned on after rewiring the rewired
    model kept every activation where the model recomputed. It is now found where the code
    calling torch.utils.checkpoint reads it."""
    from models.nanogpt import MLP
    torch.manual_seed(0)
    m = RenamedSwitchGPT(GPTConfig()).double()
    holder = m if switch == "grad_ckpt" else m.config
    r = rewire(m, "residual standard\n")
    calls = forward_calls(monkeypatch, MLP)
    for on in (True, False, True):
        setattr(holder, switch, on)
        calls.clear()
        r(tokens()).sum().backward()
        assert len(calls) == 2 * (1 + on)  # two MLPs, each run again in backward or not


FLAG = False


class GlobalSwitchGPT(GPT):
    """Checkpointing switched by a module-level global, which rewire cannot follow."""

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if FLAG
                 else block(x))
        return self.lm_head(self.transformer.ln_f(x))


def test_checkpointing_on_a_condition_rewire_cannot_follow_is_warned_of():
    """A forward calling torch.utils.checkpoint on a global's say-so was rewired without a
    word, and never recomputed once the global was set; rewire now says so."""
    with pytest.warns(RewireWarning,
                      match=r"GlobalSwitchGPT\.forward calls torch\.utils\.checkpoint on a "
                            r"condition rewire cannot follow"):
        rewire(GlobalSwitchGPT(GPTConfig()), "residual standard\n")
    import warnings
    with warnings.catch_warnings():  # switched by an attribute, or the mode: nothing to say
        warnings.simplefilter("error", RewireWarning)
        for cls in (RenamedSwitchGPT, TrainCheckpointedGPT):
            rewire(cls(GPTConfig()).eval(), "residual standard\n")


class SequentialCheckpointedGPT(GPT):
    """torch.utils.checkpoint.checkpoint_sequential over the blocks, in two segments: it
    checkpoints the first and runs the last plainly."""

    def forward(self, idx, targets=None):
        from torch.utils.checkpoint import checkpoint_sequential
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        x = checkpoint_sequential(self.transformer.h, 2, x, use_reentrant=False)
        return self.lm_head(self.transformer.ln_f(x))


def test_checkpoint_sequentials_last_segment_is_not_recomputed(monkeypatch):
    """A module called from anywhere in torch.utils.checkpoint's file counted as checkpointed,
    so the last segment of checkpoint_sequential, which it runs plainly, was recomputed in
    the rewired model and not in the original."""
    from models.nanogpt import MLP
    m = SequentialCheckpointedGPT(GPTConfig())
    r = rewire(m, "residual standard\n")
    calls = forward_calls(monkeypatch, MLP)
    counts = []
    for model in (m, r):
        calls.clear()
        model(tokens()).sum().backward()
        counts.append(len(calls))
    assert counts == [3, 3]  # two MLPs, the first segment's run again in backward


class ArgCheckpointedGPT(GPT):
    """Checkpointing chosen by an argument of each call."""

    def forward(self, idx, targets=None, checkpoint_blocks: bool = False):
        from torch.utils.checkpoint import checkpoint
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = checkpoint(block, x, use_reentrant=False) if checkpoint_blocks else block(x)
        return self.lm_head(self.transformer.ln_f(x))


def test_checkpointing_chosen_by_an_argument_follows_each_call(monkeypatch):
    """What was checkpointed was kept per mode and switches, the union over call patterns: once
    called with checkpoint_blocks=True, the rewired model recomputed in every call after."""
    from models.nanogpt import MLP
    m = ArgCheckpointedGPT(GPTConfig())
    r = rewire(m, "residual standard\n")
    calls = forward_calls(monkeypatch, MLP)
    for on in (False, True, False):
        counts = []
        for model in (m, r):
            calls.clear()
            model(tokens(), checkpoint_blocks=on).sum().backward()
            counts.append(len(calls))
        assert counts == [2 * (1 + on)] * 2, (on, counts)


class ModeSettingGPT(GPT):
    """Runs its first block under a mode set in the forward: autocast, or no grad (frozen)."""

    def __init__(self, config, mode):
        super().__init__(config)
        self.mode = mode

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        first, *rest = self.transformer.h
        with (torch.autocast("cpu", dtype=torch.bfloat16) if self.mode == "autocast"
              else torch.no_grad()):
            x = first(x)
        for block in rest:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x.float()))


@pytest.mark.parametrize("mode, said", [
    ("autocast", "with torch.autocast on"),
    ("no_grad", r"with gradients off \(torch\.no_grad or torch\.inference_mode\)")])
def test_a_mode_set_in_the_forward_is_refused(mode, said):
    """torch.fx does not record a `with torch.autocast()` or `torch.no_grad()` in a forward:
    the rewired model ran the block in float32 (refused as 'does more than x = x +
    f(norm(x))'), or trained the block the model kept frozen, without a word."""
    m = ModeSettingGPT(GPTConfig(), mode)
    with pytest.raises(RewireError, match=rf"^ModeSettingGPT: `transformer\.h\.0` is called "
                       rf"{said}, set by ModeSettingGPT\.forward .*torch\.fx does not record"):
        rewire(m, "residual standard\n")


class TrainCheckpointedGPT(CheckpointedGPT):
    """Checkpoints only in training, as most training code does."""

    def forward(self, idx, targets=None):
        from torch.utils.checkpoint import checkpoint
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = checkpoint(block, x, use_reentrant=False) if self.training else block(x)
        return self.lm_head(self.transformer.ln_f(x))


def test_checkpointing_in_training_only_is_seen_when_rewired_in_eval_mode(monkeypatch):
    """Only the model's current mode was traced, so a model rewired in eval mode that
    checkpoints when training did not recompute once trained."""
    from models.nanogpt import MLP
    m = TrainCheckpointedGPT(GPTConfig()).eval()
    r = rewire(m, "residual full_attnres\n")
    assert not any(x.training for x in m.modules())  # traced in both modes, left in its own
    r.train()
    calls = forward_calls(monkeypatch, MLP)
    r(tokens()).sum().backward()
    assert len(calls) == 2 * 2
    calls.clear()
    r.eval()  # nor recomputed where the model does not checkpoint
    r(tokens()).sum().backward()
    assert len(calls) == 2


class MaskedAttention(nn.Module):
    """Causal attention that also takes an optional padding mask [B, T] (1 keep, 0 pad)."""

    def __init__(self, config):
        super().__init__()
        self.qkv, self.n_head = nn.Linear(config.n_embd, 3 * config.n_embd), config.n_head
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, attention_mask=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, :].bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MaskedBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        from models.nanogpt import MLP, LayerNorm
        self.ln_1, self.attn = LayerNorm(config.n_embd, True), MaskedAttention(config)
        self.ln_2, self.mlp = LayerNorm(config.n_embd, True), MLP(config)

    def forward(self, x, attention_mask=None):
        x = x + self.attn(self.ln_1(x), attention_mask)
        return x + self.mlp(self.ln_2(x))


class MaskedGPT(GPT):
    """Hugging Face-style keyword arguments: an optional mask, positions and use_cache."""

    block = MaskedBlock
    mask_always = False

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1))
        if attention_mask is None and self.mask_always:
            attention_mask = torch.ones_like(input_ids)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(position_ids)
        for block in self.transformer.h:
            x = block(x, attention_mask)
        logits = self.lm_head(self.transformer.ln_f(x))
        return (logits, None) if use_cache else logits


def test_an_optional_mask_that_changes_the_sublayers_is_refused_naming_it():
    """A mask given where the default call has None runs other sublayer code; the refusal
    named only the other arguments ('called with position_ids=None, use_cache=False')."""
    torch.manual_seed(0)
    m = MaskedGPT(GPTConfig()).double()
    r = rewire(m, "residual standard\n")
    idx, mask = tokens(), torch.ones(2, 10)
    mask[0, :3] = 0
    pos = torch.arange(10)[None] + 3
    torch.testing.assert_close(r(idx, position_ids=pos), m(idx, position_ids=pos),
                               rtol=0, atol=1e-12)
    with pytest.raises(RewireError, match=r"MaskedGPT: called with attention_mask given \(the "
                       r"default call has attention_mask=None\), the sublayer `transformer\.h\.0"
                       r"\.ln_1 \+ transformer\.h\.0\.attn` runs other code.*MaskedGPT\.forward"):
        r(idx, attention_mask=mask)
    m.mask_always = True  # what the refusal says to do
    r = rewire(m, "residual standard\n")
    for kw in ({}, {"attention_mask": mask}, {"use_cache": True}):
        torch.testing.assert_close(r(idx, **kw), m(idx, **kw), rtol=0, atol=1e-12)


class DenseFirstBlock(nn.Module):
    """An MLP-only first block (its blocks are not all of one class)."""

    def __init__(self, config):
        super().__init__()
        from models.nanogpt import MLP, LayerNorm
        self.ln, self.mlp = LayerNorm(config.n_embd, True), MLP(config)

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class DenseFirstGPT(GPT):
    def __init__(self, config):
        super().__init__(config)
        self.transformer.h[0] = DenseFirstBlock(config)

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def test_a_model_whose_first_sublayer_is_an_mlp_is_told_what_rewires_it():
    """A spec failed with a SpecError at its own `residual standard` line ('the sublayer
    pattern must begin with an attention sublayer'), as if the spec were wrong; the refusal
    names the model's sublayer, and the callable it points to rewires the model."""
    torch.manual_seed(0)
    m = DenseFirstGPT(GPTConfig(n_layer=3)).double()
    with pytest.raises(RewireError, match=r"DenseFirstGPT: its first sublayer `transformer\.h"
                       r"\.0\.ln \+ transformer\.h\.0\.mlp` is an MLP.*callable"):
        rewire(m, "residual standard\n")
    r = rewire(m, restopo.topology.full_attnres)
    assert r.kinds == ("mlp", "attn", "mlp", "attn", "mlp")
    queries, gains = randomise(r)
    tr, idx = m.transformer, tokens()
    subs = [lambda h, b=tr.h[0]: b.mlp(b.ln(h))]
    subs += [f for b in tr.h[1:] for f in (lambda h, b=b: b.attn(b.ln_1(h)),
                                           lambda h, b=b: b.mlp(b.ln_2(h)))]
    v0 = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]))
    want = loop.run(v0, subs, lambda h: m.lm_head(tr.ln_f(h)), loop.full_blocks(5),
                    loop.attend, queries, gains)
    torch.testing.assert_close(r(idx), want, rtol=0, atol=1e-10)


class DictOutputGPT(GPT):
    """Returns a dict, as many training codebases' models do."""

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"loss": loss, "logits": logits}


def test_a_model_that_returns_a_dict_is_rewired():
    """The self-check compared the first tensor of a tuple or .logits only: a dict output was
    refused as 'the recovered head does not give the model's output (dict vs dict)'."""
    torch.manual_seed(0)
    m = DictOutputGPT(GPTConfig()).double()
    idx = tokens()
    want, got = m(idx, idx), rewire(m, "residual standard\n")(idx, idx)
    for k in ("loss", "logits"):
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12)
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    queries, gains = randomise(r)
    v0, subs, head = loop.nanogpt_pieces(m, idx)
    want = loop.run(v0, subs, head, loop.layer_blocks(2, 2), loop.attend, queries, gains)
    torch.testing.assert_close(r(idx)["logits"], want, rtol=0, atol=1e-10)


def norm(x, eps=None):
    """modded-nanogpt's norm: a function, no module, no weight."""
    return F.rms_norm(x, (x.size(-1),), eps=eps)


class FunctionalNormBlock(nn.Module):
    eps = None

    def __init__(self, config):
        super().__init__()
        from models.nanogpt import MLP, CausalSelfAttention
        self.attn, self.mlp = CausalSelfAttention(config), MLP(config)

    def forward(self, x):
        x = x + self.attn(norm(x, self.eps))
        return x + self.mlp(norm(x, self.eps))


class FunctionalNormGPT(GPT):
    block = FunctionalNormBlock
    eps = None

    def __init__(self, config):
        super().__init__(config)
        del self.transformer.ln_f  # no norm module left

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(norm(x, self.eps))


def test_norms_written_as_functions_are_norms():
    """`x + self.attn(norm(x))` with norm = F.rms_norm was refused as reading the stream
    'directly in `rms_norm`, not through a norm'; and norm_eps= had nothing to set, silently."""
    torch.manual_seed(0)
    m = FunctionalNormGPT(GPTConfig(n_layer=2)).double()
    idx = tokens()
    torch.testing.assert_close(rewire(m, "residual standard\n")(idx), m(idx), rtol=0, atol=1e-12)
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    queries, gains = randomise(r)
    v0 = m.transformer.wte(idx) + m.transformer.wpe(torch.arange(idx.shape[1]))
    subs = [f for b in m.transformer.h for f in (lambda h, b=b: b.attn(norm(h)),
                                                 lambda h, b=b: b.mlp(norm(h)))]
    want = loop.run(v0, subs, lambda h: m.lm_head(norm(h)), loop.layer_blocks(2, 2),
                    loop.attend, queries, gains)
    torch.testing.assert_close(r(idx), want, rtol=0, atol=1e-10)
    with pytest.raises(RewireError, match=r"FunctionalNormGPT has no norm modules.*pass eps= "):
        rewire(m, "residual full_attnres\n", norm_eps=1e-24)


def test_the_epsilon_of_a_norm_function_is_warned_of():
    """F.rms_norm without eps uses the dtype's machine epsilon, not negligible against the
    mean AttnRes starts as; a norm module's was warned of, a norm function's was not."""
    import warnings

    from restopo.fx.rewire import RewireWarning
    m = FunctionalNormGPT(GPTConfig(n_layer=2))
    eps = torch.finfo(torch.float32).eps
    with pytest.warns(RewireWarning, match=rf"epsilon up to {eps:g}: full_attnres.*its code "
                                           r"calls torch\.nn\.functional\.rms_norm with "
                                           r"eps=None \(the default: the dtype's machine "
                                           rf"epsilon, {eps:g}\): pass eps=1e-24 there"):
        rewire(m, "residual full_attnres\n")
    m.eps = 1e-24
    for block in m.transformer.h:
        block.eps = 1e-24
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewireWarning)
        r = rewire(m, "residual full_attnres\n")
    torch.testing.assert_close(r(tokens()), m(tokens()), rtol=1e-6, atol=1e-6)  # the mean start


class NoEpsRMSNorm(nn.Module):
    """A norm module calling F.rms_norm without eps: the dtype's machine epsilon."""

    def __init__(self, ndim, bias=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight)


@pytest.mark.parametrize("case", ["module_without_eps", "function_with_eps_only_last"])
def test_every_norm_epsilon_a_call_takes_by_default_is_warned_of(case, monkeypatch):
    """A norm module whose code called F.rms_norm without eps was not warned of (only an eps
    written there was read), and of a norm function's calls only the last was: a head's
    eps=1e-24 hid the blocks' default epsilon."""
    from restopo.fx.rewire import RewireWarning
    if case == "module_without_eps":
        import models.nanogpt
        monkeypatch.setattr(models.nanogpt, "LayerNorm", NoEpsRMSNorm)
        m = GPT(GPTConfig(n_layer=2))
    else:
        m = FunctionalNormGPT(GPTConfig(n_layer=2))
        m.eps = 1e-24  # the head's norm only
    eps = torch.finfo(torch.float32).eps
    with pytest.warns(RewireWarning, match=rf"epsilon up to {eps:g}: full_attnres"):
        rewire(m, "residual full_attnres\n")


@pytest.mark.parametrize("case", ["torch_rmsnorm", "module_without_eps"])
def test_a_norms_default_epsilon_is_warned_of_as_a_default(case, monkeypatch):
    """torch's nn.RMSNorm(d) keeps eps=None (the dtype's machine epsilon): it was not warned
    of, and norm_eps= refused it as an epsilon 'in their code', though it sets the attribute.
    A norm module calling F.rms_norm without eps was said to write its epsilon in its code.
    Each is now said as the default it is, and the warning names what sets it."""
    import warnings

    import models.nanogpt
    from restopo.fx.rewire import RewireWarning
    norm = (lambda d, bias=None: nn.RMSNorm(d)) if case == "torch_rmsnorm" else NoEpsRMSNorm
    monkeypatch.setattr(models.nanogpt, "LayerNorm", norm)
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2))
    eps = torch.finfo(torch.float32).eps
    said = (r"RMSNorm has eps=None \(the default: the dtype's machine epsilon, "
            rf"{eps:g}\): rewire\(\.\.\., norm_eps=1e-24\) sets it" if case == "torch_rmsnorm"
            else r"NoEpsRMSNorm\.forward calls torch\.nn\.functional\.rms_norm with eps=None "
                 rf"\(the default: the dtype's machine epsilon, {eps:g}\): pass eps=1e-24 there")
    with pytest.warns(RewireWarning, match=rf"epsilon up to {eps:g}: full_attnres.*{said}"):
        rewire(m, "residual full_attnres\n")
    if case == "torch_rmsnorm":
        with warnings.catch_warnings():
            warnings.simplefilter("error", RewireWarning)
            r = rewire(m, "residual full_attnres\n", norm_eps=1e-24)
        assert {x.eps for x in m.modules() if isinstance(x, nn.RMSNorm)} == {1e-24}
        idx = tokens()
        torch.testing.assert_close(r(idx), m(idx), rtol=1e-6, atol=1e-6)  # the mean start


def test_a_compiled_model_or_block_is_refused_saying_to_rewire_first():
    """torch.compile's wrapper failed in fx ('Module [OptimizedModule] is missing the required
    "forward" function', or 'symbolically trace a dynamo-optimized function' for a block)."""
    m = GPT(GPTConfig())
    with pytest.raises(RewireError, match=r"this GPT is compiled \(torch\.compile\).*rewire the "
                       r"model it wraps \(model\._orig_mod\)"):
        rewire(torch.compile(m), "residual standard\n")
    m.transformer.h[1] = torch.compile(m.transformer.h[1])
    with pytest.raises(RewireError, match=r"GPT: `transformer\.h\.1` is compiled"):
        rewire(m, "residual standard\n")
