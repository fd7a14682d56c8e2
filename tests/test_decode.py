"""KV-cached generation (restopo.decode) against re-running the full forward at each step."""
import copy

import pytest
import torch

import restopo
from restopo.decode import Decoder, sample

TOPOLOGIES = [
    "standard",
    "full_attnres",
    "block_attnres(blocks: 3)",          # 8 sublayers: 3 does not divide them
    "block_attnres(blocks: 4)",          # divides them
    "rezero",
    "denseformer",
    "highway",
    "full_attnres(window: 3)",
    "block_attnres(blocks: 2, query: input_dependent, heads: 2)",
    "hyper_connections(streams: 2, dynamic: true)",  # the n streams per token
    "mhc(streams: 4, sinkhorn: 5)",
    "mhc_lite(streams: 3)",
]


def model_for(topology: str, seed: int = 0, dtype=torch.float64):
    spec = (f"model m {{ vocab: 61; width: 16; depth: 4; heads: 2; context: 24 }}\n"
            f"residual {topology}\n")
    torch.manual_seed(seed)
    model = restopo.compile(spec, backend="eager").to(dtype)
    with torch.no_grad():  # away from the initialisation, where every topology agrees
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def tokens(B=2, T=5, seed=1):
    return torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(seed))


def uncached_greedy(model, idx, n):
    """The reference: the whole sequence through the model's forward at every step."""
    logits = []
    with torch.no_grad():
        for _ in range(n):
            last = model(idx)[:, -1]
            logits.append(last)
            idx = torch.cat([idx, last.argmax(-1, keepdim=True)], dim=1)
    return idx, logits


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("fixed", [False, True], ids=["sliced", "fixed"])
def test_cached_greedy_equals_uncached(topology, fixed):
    model = model_for(topology)
    idx, n = tokens(), 12
    want, want_logits = uncached_greedy(model, idx, n)
    decoder = Decoder(model, idx.shape[0], idx.shape[1] + n, fixed=fixed)
    got, logits = idx, decoder(idx)
    for k in range(n):
        torch.testing.assert_close(logits, want_logits[k], rtol=1e-10, atol=1e-10)
        got = torch.cat([got, logits.argmax(-1, keepdim=True)], dim=1)
        if k + 1 < n:
            logits = decoder(got[:, -1:])
    assert torch.equal(got, want)


@pytest.mark.parametrize("topology", ["standard", "block_attnres(blocks: 3)"])
def test_float32_generate_equals_uncached(topology):
    model = model_for(topology, dtype=torch.float32)
    idx = tokens(B=3, T=4)
    want, _ = uncached_greedy(model, idx, 15)
    assert torch.equal(model.generate(idx, 15, temperature=0), want)
    assert torch.equal(restopo.generate(model, idx, 15, temperature=0), want)


def test_prompt_in_pieces_equals_one_prefill():
    """Feeding the prompt in chunks fills the same caches as one prefill."""
    model = model_for("block_attnres(blocks: 3)")
    idx = tokens(T=9)
    a, b = Decoder(model, 2, 12), Decoder(model, 2, 12)
    whole = a(idx)
    b(idx[:, :4])
    b(idx[:, 4:5])
    torch.testing.assert_close(b(idx[:, 5:]), whole, rtol=1e-12, atol=1e-12)


def test_decoding_runs_the_two_phase_plan():
    """The decode graph is the model's own lowering: a block's phase 1 runs once for all of
    its sublayers, also for a one-token step."""
    model = model_for("block_attnres(blocks: 2)")
    decoder = Decoder(model, 2, 8)
    code = decoder.graph.code
    assert code.count("getattr(self.phases") == 2 and "phase1 = " in code
    assert all(p is q for p, q in zip(decoder.graph.aggregations, model.aggregations))


def test_sampling_is_seeded_and_filtered():
    model = model_for("full_attnres", dtype=torch.float32)
    idx = tokens()
    a = model.generate(idx, 10, temperature=1.0, seed=3)
    assert torch.equal(a, model.generate(idx, 10, temperature=1.0, seed=3))
    assert not torch.equal(a, model.generate(idx, 10, temperature=1.0, seed=4))
    greedy = model.generate(idx, 10, temperature=0)
    assert torch.equal(model.generate(idx, 10, temperature=0.7, top_k=1, seed=0), greedy)
    assert torch.equal(model.generate(idx, 10, temperature=0.7, top_p=1e-6, seed=0), greedy)
    # a tiny temperature is greedy in the limit (it overflowed to a softmax of nans)
    assert torch.equal(model.generate(idx, 10, temperature=1e-40, seed=0), greedy)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be 0 .greedy. or a finite"):
            model.generate(idx, 2, temperature=bad)


@pytest.mark.parametrize("topology", ["full_attnres(gate: sigmoid)",
                                      "hyper_connections(streams: 2, dynamic: true)",
                                      "mhc(streams: 4, sinkhorn: 5)"])
def test_seeded_sampling_draws_what_an_uncached_loop_draws(topology):
    """Sampling (top_k and top_p too) past the context: the same draws as re-running the
    whole window at each token with the same generator and the window rule of
    test_generating_past_the_context_slides_the_window."""
    model = model_for(topology)
    idx = tokens(B=3, T=20)
    got = model.generate(idx, 30, temperature=0.9, top_k=20, top_p=0.95, seed=5)
    g, window, want = torch.Generator().manual_seed(5), idx, []
    with torch.no_grad():
        for _ in range(30):
            token = sample(model(window)[:, -1], 0.9, 20, 0.95, g)[:, None]
            want.append(token)
            window = torch.cat([window, token], dim=1)
            if window.shape[1] > 24:
                window = window[:, -12:]
    assert torch.equal(got, torch.cat([idx, *want], dim=1))


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, 1.0, top_p=0.75, generator=g)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: tokens 0 and 1 only
    draws = {int(sample(logits, 1.0, top_k=3, generator=g)) for _ in range(300)}
    assert draws == {0, 1, 2}


@pytest.mark.parametrize("topology", ["standard", "block_attnres(blocks: 2)"])
@pytest.mark.parametrize("prompt", [5, 30])
def test_generating_past_the_context_slides_the_window(topology, prompt):
    """Past context 24 the cache restarts from the last 12 tokens: a hand-written uncached
    loop with that rule gives the same tokens (a prompt of 30 keeps its last 24)."""
    model = model_for(topology)
    idx = tokens(T=prompt)
    got = model.generate(idx, 40, temperature=0)
    window, want = idx[:, -24:], []
    with torch.no_grad():
        for _ in range(40):
            token = model(window)[:, -1].argmax(-1, keepdim=True)
            want.append(token)
            window = torch.cat([window, token], dim=1)
            if window.shape[1] > 24:
                window = window[:, -12:]
    assert torch.equal(got, torch.cat([idx, *want], dim=1))


def test_bad_arguments_say_what_to_do():
    model = model_for("standard", dtype=torch.float32)
    idx = tokens()
    with pytest.raises(ValueError, match="up to 24 tokens"):
        Decoder(model, 2, 24)(torch.cat([idx] * 5, dim=1))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(idx, 2, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(idx, 2, top_p=0)
    assert torch.equal(model.generate(idx, 0), idx)
    from models.nanogpt import GPT, GPTConfig
    gpt = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16))
    rewired = restopo.rewire(gpt, "residual full_attnres\n")
    with pytest.raises(ValueError, match="rewired Hugging Face"):
        Decoder(rewired, 1, 4)
    with pytest.raises(ValueError, match="rewired Hugging Face"):  # before the window
        restopo.generate(rewired, torch.zeros(1, 3, dtype=torch.long), 4)


@pytest.mark.parametrize("call, error, said", [
    (lambda m, idx: m.generate(idx.tolist(), 2), TypeError, "tensor of token ids"),
    (lambda m, idx: m.generate(idx.float(), 2), TypeError, "integer token ids"),
    (lambda m, idx: m.generate(idx + 61, 2), ValueError, "token id [1-9][0-9]+, .*0..60"),
    (lambda m, idx: m.generate(idx - 3, 2), ValueError, "token id -.*0..60"),
    (lambda m, idx: m.generate(idx, 2.5), TypeError, "max_new_tokens must be a whole"),
    (lambda m, idx: restopo.generate(m, idx, 2, top_k=2.5), TypeError, "top_k must be"),
    (lambda m, idx: restopo.generate(m, idx, 2, seed="1"), TypeError, "seed must be"),
])
def test_a_wrong_kind_of_argument_is_named(call, error, said):
    """User mistakes in generate's arguments are said in its own words, not as a torch
    error from deep in the decoder (or an out-of-range id's 'index out of range in self')."""
    model = model_for("standard", dtype=torch.float32)
    with pytest.raises(error, match=said):
        call(model, tokens())
    assert model.generate(tokens(), torch.tensor(2)).shape == (2, 7)  # an integer tensor is
    import numpy as np  # a whole number, as numpy's ints are
    assert model.generate(tokens(), np.int64(1), top_k=np.int32(3)).shape == (2, 6)


def test_decoding_checks_the_prompt_once_not_every_step(monkeypatch):
    """A model's forward reads its ids back to check them (restopo.nn.sublayers); a
    decoding step's are tokens the model drew, and reading them at every step would stall
    the decoder (a Python call per step on the CPU, a wait for the GPU on CUDA). The prompt
    is still checked, once."""
    from restopo.nn import sublayers

    model = model_for("standard", dtype=torch.float32)
    checked = []
    monkeypatch.setattr(sublayers, "check_token_ids", lambda idx, vocab: checked.append(idx))
    assert model(tokens()).shape == (2, 5, 61) and len(checked) == 1  # the forward checks
    assert model.generate(tokens(), 6).shape == (2, 11)
    assert len(checked) == 1
    with pytest.raises(ValueError, match="token id 61, outside the model's vocabulary"):
        model.generate(torch.tensor([[3, 61]]), 2)


@pytest.mark.long
@pytest.mark.parametrize("topology", ["standard", "full_attnres", "block_attnres(blocks: 3)"])
def test_compiled_decoding_equals_uncached(topology):
    model = model_for(topology, dtype=torch.float32)
    idx = tokens()
    want, _ = uncached_greedy(model, idx, 8)
    assert torch.equal(restopo.generate(model, idx, 8, temperature=0, compile=True), want)


@pytest.mark.parametrize("topology", ["full_attnres", "block_attnres(blocks: 2)"])
def test_views_of_a_model_leave_no_hooks_on_its_modules(topology):
    """A decoder, a direct() view and the standalone writer lower the model's own
    aggregation modules again; none may leave a hook on them (each generate() call would
    add one more to every later forward), and the model still shares its logits."""
    from restopo.api import direct
    from restopo.commands.standalone import module_source

    model = model_for(topology)
    idx = tokens()

    def hooks():
        return [len(m._forward_pre_hooks) for m in model.modules()]

    before = hooks()
    assert sum(before) > 0  # the model's own readers share logits through hooks
    with torch.no_grad():
        want = model(idx)
    for _ in range(3):
        restopo.generate(model, idx, max_new_tokens=2, temperature=0)
        direct(model)
        module_source(model, "m", "test")
    assert hooks() == before
    shared = model.restopo_shared
    seen = []
    real = shared._make
    shared._make = lambda *a, **k: seen.append(1) or real(*a, **k)
    torch.testing.assert_close(model(idx), want)  # with autograd: the shared path
    assert seen, "the model's readers still share their sources' logits"


@pytest.mark.parametrize("topology", ["full_attnres", "block_attnres(blocks: 3)"])
def test_decoding_under_inference_mode_leaves_normal_tensors(topology):
    """The decoder runs under inference mode; nothing of it may leak out as an inference
    tensor: not the logits (a user changes them in place), and nothing the model keeps
    (the next training step, forward and backward, is the same as an undecoded twin's)."""
    model, twin = model_for(topology), model_for(topology)
    logits = Decoder(model, 2, 8)(tokens())
    assert not logits.is_inference()
    logits /= 2  # in place, outside inference mode
    steps = []
    for m in (model, twin):
        loss = m.train()(tokens()).square().mean()
        loss.backward()
        steps.append((loss, [p.grad for p in m.parameters()]))
    torch.testing.assert_close(steps[0], steps[1], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize("topology", ["full_attnres", "block_attnres(blocks: 3)"])
def test_a_new_sequence_reads_changed_parameters(topology, backend):
    """A decoder checks its aggregation points' kept parameters once a sequence (its caches
    hold keys and values made with them, restopo.nn.aggregate.FIXED_FOR): parameters
    changed in place between sequences are what the next sequence uses, as the full
    forward uses them; two decoders sharing a model take turns without mixing theirs."""
    spec = (f"model m {{ vocab: 61; width: 16; depth: 4; heads: 2; context: 24 }}\n"
            f"residual {topology}\n")
    torch.manual_seed(0)
    model = restopo.compile(spec, backend=backend).eval()
    idx = tokens()
    one, two = (Decoder(model, idx.shape[0], idx.shape[1] + 4) for _ in range(2))
    for step in range(3):
        with torch.no_grad():  # an optimizer's in-place update of the aggregation points
            for a in model.aggregations:
                a.pseudo_query.add_(0.3 * torch.randn_like(a.pseudo_query))
                a.key_norm.weight.mul_(1.2)
            for sub in model.sublayers:
                sub.norm.weight.add_(0.1)
        # the reference on a copy: the model's own no-grad forward would refresh what its
        # aggregation points keep, hiding a decoder that had not
        want = uncached_greedy(copy.deepcopy(model), idx, 3)[1]
        one.reset()
        got = [one(idx)]
        two.reset()
        other = two(idx)  # the other decoder's step between two of this one's
        got.append(one(got[-1].argmax(-1, keepdim=True)))
        torch.testing.assert_close(other, want[0], rtol=1e-5, atol=1e-5)
        got.append(one(got[-1].argmax(-1, keepdim=True)))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize("topology", ["full_attnres", "block_attnres(blocks: 3)"])
def test_a_model_copies_and_pickles_after_decoding(topology, backend):
    """What aggregation points keep for decoding and evaluation (bound kernel calls and
    closures, restopo.nn.aggregate.Kept) stays out of copies and pickles of the model, and
    restopo's attributes (the IR, the spec) stay in them (restopo.fx.lower.Lowered):
    copy.deepcopy and torch.save of the whole module work after decoding, a copy of the
    unpickled model too, and each decodes the same logits, and trains with the same
    gradients."""
    import io
    spec = (f"model m {{ vocab: 61; width: 16; depth: 4; heads: 2; context: 24 }}\n"
            f"residual {topology}\n")
    torch.manual_seed(0)
    model = restopo.compile(spec, backend=backend).eval()
    idx = tokens()
    first = Decoder(model, idx.shape[0], idx.shape[1] + 1)(idx)
    with torch.no_grad():
        model(idx)
    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    copies = (twin, loaded, copy.deepcopy(loaded))
    for other in copies:
        assert other.restopo_spec.text == model.restopo_spec.text
        # a group's fused first PreNorm (TwoPhase.fuse_first_norm) is the copy's own norm
        norms = [s.norm for s in other.sublayers]
        assert all(p.first_norm is None or any(p.first_norm is n for n in norms)
                   for p in other.phases)
        assert [p.first_norm is None for p in other.phases] == \
            [p.first_norm is None for p in model.phases]
        torch.testing.assert_close(Decoder(other, idx.shape[0], idx.shape[1] + 1)(idx), first,
                                   rtol=0, atol=0)
        # model.generate is kept too (a copy's fresh GraphModule class lost it)
        assert torch.equal(other.generate(idx, 3, temperature=0),
                           model.generate(idx, 3, temperature=0))
    for m in (model, *copies):
        m.train()(idx).logsumexp(-1).mean().backward()
    for other in copies:
        for (name, p), q in zip(model.named_parameters(), other.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
