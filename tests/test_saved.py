"""restopo.load from every saved form (strict, overrides applied, eval mode), restopo.export,
and the generate / eval / export commands."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import restopo
from restopo.cli import main
from restopo.saved import LoadError, export, load
from restopo.train.checkpoint import save_checkpoint
from restopo.train.runspec import run_meta

SPEC = """\
model t { vocab: 256; width: 32; depth: 2; heads: 4; context: 16 }
residual block_attnres(blocks: 2)
train { data: "corpus.txt"; steps: 4; batch: 2 }
"""
OVERRIDES = ("model.width=24",)
TEXT = "def f(x):\n    return x + 1  # é ✓\n" * 60


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder with two checkpoints of a model whose weights are not the init's."""
    folder = tmp_path_factory.mktemp("saved")
    (folder / "corpus.txt").write_text(TEXT)
    (folder / "t.restopo").write_text(SPEC)
    spec = restopo.load_spec(str(folder / "t.restopo"), overrides=OVERRIDES)
    torch.manual_seed(0)
    model = restopo.compile(spec)
    meta = run_meta(spec, str(folder))
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        state = {"step": step, "data": {"generator": torch.Generator().get_state()},
                 "torch_cpu": torch.get_rng_state()}  # what a training run saves
        save_checkpoint(folder / "run" / "ckpt", step, model, None, state, meta)
    return folder, model


def idx():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))


def same(a, b):
    with torch.no_grad():
        return torch.equal(a(idx()), b(idx()))


def test_load_from_checkpoint_folders(run):
    folder, model = run
    ckpt = folder / "run" / "ckpt"
    for path in (folder / "run", ckpt, ckpt / "step_000002",
                 ckpt / "step_000002" / "model.safetensors"):
        got = load(path)
        assert not got.training and got.embed.weight.shape == (256, 24)  # overrides applied
        assert got.head.lm_head.weight is got.embed.weight  # tied, as trained
        assert same(got, model)
    older = load(ckpt / "step_000001")
    assert not same(older, model)


def test_export_and_pt_round_trip_strictly(run, tmp_path):
    folder, model = run
    m = load(folder / "run")
    for name in ("m.safetensors", "m.pt"):
        export(m, tmp_path / name)
        back = restopo.load(tmp_path / name)
        assert same(back, model) and back.restopo_overrides == OVERRIDES
    from safetensors.torch import load_file
    state = load_file(tmp_path / "m.safetensors")
    assert "head.lm_head.weight" in state  # every key: strict load_state_dict anywhere
    fresh = restopo.compile(SPEC, overrides=OVERRIDES)
    fresh.load_state_dict(state, strict=True)
    assert same(fresh, model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_loads_back_in_the_dtype_it_was_saved_in(tmp_path, sharded, dtype):
    """A checkpoint of a float64 (or bf16) model, in either layout, loaded as float32 from
    its run, ckpt/ or step folder (or its model.safetensors), while an export of it kept
    its dtype."""
    from restopo.train.checkpoint import save_sharded
    spec = restopo.load_spec(str(_tiny_spec(tmp_path)))
    torch.manual_seed(0)
    model = restopo.compile(spec, backend="eager").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) / 3)
    meta, root = run_meta(spec, str(tmp_path)), tmp_path / "run" / "ckpt"
    state = {"step": 1, "data": {"generator": torch.Generator().get_state()},
             "torch_cpu": torch.get_rng_state()}
    if sharded:
        step = save_sharded(root, 1, list(model.named_parameters()), None, state, meta,
                            rank=0, world=1, exchange=lambda o: [o])
    else:
        step = save_checkpoint(root, 1, model, None, state, meta)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    paths = [tmp_path / "run", root, step] + ([] if sharded else [step / "model.safetensors"])
    for path in paths:
        back = load(path, backend="eager")
        assert {p.dtype for p in back.parameters()} == {dtype}, path
        with torch.no_grad():
            assert torch.equal(back(tokens), model.eval()(tokens)), path


def _tiny_spec(folder):
    path = folder / "tiny.restopo"
    path.write_text("model t { vocab: 32; width: 16; depth: 1; heads: 2; context: 8 }\n"
                    "residual full_attnres\n")
    return path


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_an_export_loads_back_in_the_dtype_it_was_saved_in(tmp_path, name, dtype):
    """A float64 (or bf16) model exported and loaded again is that model, not its weights
    rounded to float32 (which load_state_dict would do silently)."""
    spec = "model t { vocab: 32; width: 16; depth: 1; heads: 2; context: 8 }\n" \
           "residual full_attnres\n"
    torch.manual_seed(0)
    model = restopo.compile(spec, backend="eager").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) / 3)
    export(model, tmp_path / name)
    back = load(tmp_path / name, backend="eager")
    assert {p.dtype for p in back.parameters()} == {dtype}
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(tokens), model.eval()(tokens))


def test_compile_pt_loads(tmp_path):
    (tmp_path / "t.restopo").write_text(SPEC)
    assert main(["compile", str(tmp_path / "t.restopo"), "-o", str(tmp_path / "c.pt")]) == 0
    blob = torch.load(tmp_path / "c.pt", weights_only=True)
    m = load(tmp_path / "c.pt")
    torch.testing.assert_close(m.embed.weight, blob["state_dict"]["embed.weight"],
                               rtol=0, atol=0)


def test_a_file_that_does_not_fit_is_refused(run, tmp_path):
    folder, _ = run
    m = load(folder / "run")
    export(m, tmp_path / "m.pt")
    blob = torch.load(tmp_path / "m.pt", weights_only=True)
    del blob["state_dict"]["aggregations.0.pseudo_query"]
    torch.save(blob, tmp_path / "bad.pt")
    with pytest.raises(LoadError, match=r"bad.pt: does not fit.*pseudo_query"):
        load(tmp_path / "bad.pt")
    (tmp_path / "x.safetensors").write_bytes(b"not safetensors")
    (tmp_path / "g.pt").write_bytes(bytes(range(256)) * 2)  # was 'holds objects other ...'
    for path, message in ((tmp_path / "nope", "no such file"),
                          (tmp_path / "g.pt", "g.pt: is not a torch file"),
                          (tmp_path / "x.safetensors", "not a safetensors file"),
                          (folder / "t.restopo", r"is a spec, not a trained model; train it"),
                          (tmp_path, "no complete checkpoint")):
        with pytest.raises(LoadError, match=message):
            load(path)


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_a_damaged_byte_in_an_export_is_refused(run, tmp_path, capsys, name):
    """Neither format checks its data: a byte changed in an export's weights loaded as a
    wrong weight (a nan or a wrong score, unsaid); now the checksum export writes says so.
    A file without one (written before it was) still loads."""
    folder, model = run
    path = tmp_path / name
    export(load(folder / "run"), path)
    data = bytearray(path.read_bytes())
    weight = model.state_dict()["aggregations.0.pseudo_query"].detach().numpy().tobytes()
    at = bytes(data).find(weight)
    assert at > 0 and bytes(data).find(weight, at + 1) < 0  # stored once, uncompressed
    data[at + 1] ^= 0x40
    damaged = tmp_path / f"damaged{path.suffix}"
    damaged.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=r"damaged\.\w+: its weights do not match the checksum"):
        load(damaged)
    assert main(["eval", str(damaged), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("restopo eval: error: ") and "export it again" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    if path.suffix == ".pt":  # a .pt written before the checksum was
        blob = torch.load(path, weights_only=True)
        del blob["restopo.weights_sha256"]
        torch.save(blob, tmp_path / "old.pt")
        assert same(load(tmp_path / "old.pt"), model)


@pytest.mark.parametrize("name, kind", [("m.safetensors", "safetensors"), ("m.pt", "torch")])
def test_an_export_cut_short_or_empty_says_so(run, tmp_path, capsys, name, kind):
    """An export cut short (a copy stopped, a full disk) was 'not a torch file restopo
    wrote ([Errno 22] Invalid argument)', an empty one '... (EOFError)': now each says what
    happened to the file and to write it again."""
    folder, _ = run
    path = tmp_path / name
    export(load(folder / "run"), path)
    data = path.read_bytes()
    for cut, said in ((len(data) // 2, f"begins as a {kind} file but is cut short or damaged"),
                      (0, "the file is empty")):
        short = tmp_path / f"short{path.suffix}"
        short.write_bytes(data[:cut])
        with pytest.raises(LoadError, match=f"short{path.suffix}: {said}"):
            load(short)
        assert main(["generate", str(short)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("restopo generate: error: ") and len(err.splitlines()) == 1
        # the advice works: an export over a file there is refused without --overwrite
        assert f"write it again (restopo export CKPT -o short{path.suffix} --overwrite)" in err
        assert main(["export", str(folder / "run"), "-o", str(short), "--overwrite"]) == 0
        load(short)
        capsys.readouterr()


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_refuses_a_rewired_model_it_could_not_load(tmp_path, suffix):
    """A rewired model's spec is wiring only: its export was written, then restopo.load
    refused it; now export says what to save instead, and writes nothing."""
    from models.nanogpt import GPT, GPTConfig
    gpt = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16))
    rewired = restopo.rewire(gpt, "residual full_attnres\n")
    with pytest.raises(LoadError, match=r"rewired .*torch.save\(model.state_dict\(\)"):
        export(rewired, tmp_path / f"r{suffix}")
    assert list(tmp_path.iterdir()) == []


def test_compile_of_a_saved_model_says_to_load_it(tmp_path):
    with pytest.raises(ValueError, match=r"restopo.load\('.*m.pt'\)"):
        restopo.compile(str(tmp_path / "m.pt"))


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "restopo", *map(str, args)], cwd=cwd,
                          capture_output=True, timeout=300)


def test_generate_command_streams_what_generate_returns(run):
    folder, _ = run
    r = cli("generate", "run", "--prompt", "def f(", "--max-new-tokens", "9",
            "--temperature", "0", cwd=folder)
    assert r.returncode == 0, r.stderr.decode()
    m = load(folder / "run")
    prompt = torch.tensor([list("def f(".encode())])
    new = restopo.generate(m, prompt, 9, temperature=0)[0, prompt.shape[1]:]
    want = bytes(new.tolist()).decode("utf-8", errors="replace") + "\n"
    assert r.stdout.decode("utf-8") == want
    # past the context (16) the window slides: the command still says what generate does
    r = cli("generate", "run", "--prompt", "x", "--max-new-tokens", "50", "--temperature",
            "0", cwd=folder)
    assert r.returncode == 0, r.stderr.decode()
    new = restopo.generate(m, torch.tensor([[ord("x")]]), 50, temperature=0)[0, 1:]
    assert r.stdout.decode("utf-8") == bytes(new.tolist()).decode("utf-8", "replace") + "\n"


def test_a_prompt_that_is_not_utf8_is_taken_as_its_bytes(run):
    """A byte-level model reads bytes; a prompt typed in another encoding (here Latin-1
    'caf\xe9') stopped with a raw codec error ('surrogates not allowed')."""
    folder, _ = run
    raw = b"caf\xe9 \xff"
    r = subprocess.run([sys.executable, "-m", "restopo", "generate", "run", "--prompt", raw,
                        "--max-new-tokens", "4", "--temperature", "0"], cwd=folder,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    new = restopo.generate(load(folder / "run"), torch.tensor([list(raw)]), 4,
                           temperature=0)[0, len(raw):]
    assert r.stdout.decode("utf-8") == bytes(new.tolist()).decode("utf-8", "replace") + "\n"


def test_generate_prints_to_a_stdout_that_is_not_utf8(run):
    """A character the output's encoding cannot hold is shown replaced ('?'), as invalid
    UTF-8 is; it stopped the command with "'ascii' codec can't encode character"."""
    folder, _ = run
    prompt = "def f(x):\n    return x + 1  # é"
    r = subprocess.run([sys.executable, "-m", "restopo", "generate", "run", "--prompt", prompt,
                        "--max-new-tokens", "12", "--temperature", "0"], cwd=folder,
                       env={**os.environ, "PYTHONIOENCODING": "ascii"}, capture_output=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    ids = list(prompt.encode())
    new = restopo.generate(load(folder / "run"), torch.tensor([ids]), 12,
                           temperature=0)[0, len(ids):]
    text = bytes(new.tolist()).decode("utf-8", "replace") + "\n"
    assert not text.isascii()  # the case this tests: some character ascii cannot hold
    assert r.stdout == text.encode("ascii", "replace")


def test_generate_command_compiled_says_what_generate_returns(run, capsys, monkeypatch):
    """--compile: the one-token steps through torch.compile, the same greedy tokens as the
    uncompiled decoder's, past the context too (the window slides), and a line on stderr
    that says the wait is the compile."""
    folder, _ = run
    monkeypatch.chdir(folder)
    assert main(["generate", "run", "--prompt", "x", "--max-new-tokens", "24",
                 "--temperature", "0", "--compile"]) == 0
    out, err = capsys.readouterr()
    new = restopo.generate(load(folder / "run"), torch.tensor([[ord("x")]]), 24,
                           temperature=0)[0, 1:]
    assert out == bytes(new.tolist()).decode("utf-8", "replace") + "\n"
    assert "compiling the one-token step" in err


def test_generate_command_writes_each_character_as_it_comes(run, monkeypatch):
    """Streaming: when the model makes a token, every character of the tokens before it is
    already flushed to the terminal."""
    import codecs
    import io

    import restopo.decode as decode

    class Terminal(io.StringIO):
        flushed = ""  # what a reader of the pipe has seen

        def flush(self):
            self.flushed = self.getvalue()

    out, seen, real = Terminal(), [], decode.stream

    def watched(*args, **kw):
        for token in real(*args, **kw):
            seen.append((int(token[0]), out.flushed))
            yield token

    folder, _ = run
    monkeypatch.setattr(decode, "stream", watched)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.chdir(folder)
    assert main(["generate", "run", "--prompt", "def f(", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    assert len(seen) == 12
    decoder, said = codecs.getincrementaldecoder("utf-8")(errors="replace"), ""
    for token, flushed in seen:
        assert flushed == said
        said += decoder.decode(bytes([token]))
    assert out.flushed == said + decoder.decode(b"", final=True) + "\n"


def test_eval_matches_a_hand_loop(run, capsys):
    folder, _ = run
    assert main(["eval", str(folder / "run"), "--data", str(folder / "corpus.txt"),
                 "--format", "json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)
    data = list((folder / "corpus.txt").read_bytes())
    m = load(folder / "run")
    # reference: token t predicted from the (up to 16) tokens of its window, in float64
    m = m.double()
    nll, count, start = 0.0, 0, 0
    with torch.no_grad():
        while start < len(data) - 1:
            window = torch.tensor([data[start:start + 17]])
            logits = m(window[:, :-1])
            nll += F.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
            count += window.shape[1] - 1
            start += 16
    assert got["tokens"] == count == len(data) - 1 and got["split"] == "all"
    assert math.isclose(got["loss"], nll / count, rel_tol=1e-5)
    assert math.isclose(got["bits_per_token"], nll / count / math.log(2), rel_tol=1e-5)
    assert math.isclose(got["perplexity"], math.exp(nll / count), rel_tol=1e-5)
    # the run's own data, held-out split by default; text with the units
    assert main(["eval", str(folder / "run"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "(val split" in out and "bits per byte" in out and "perplexity" in out
    # the count with its thousands marked, as every other count restopo prints (it was not)
    assert main(["eval", str(folder / "run"), "--data", str(folder / "corpus.txt"),
                 "--no-progress"]) == 0
    assert len(data) > 1001 and f"(all split, {len(data) - 1:,} tokens)" in \
        capsys.readouterr().out
    # two bytes score one token, said in the singular (it was '1 tokens')
    (folder / "two.txt").write_bytes(b"hi")
    assert main(["eval", str(folder / "run"), "--data", str(folder / "two.txt"),
                 "--no-progress"]) == 0
    assert "(all split, 1 token)" in capsys.readouterr().out


def _ids_run(folder, tmp_path, data):
    """A run folder whose model was trained on token ids `data` (one checkpoint)."""
    spec = restopo.load_spec(str(folder / "t.restopo"), overrides=OVERRIDES + (
        f'train.data="{data}"',))
    state = {"step": 1, "data": {"generator": torch.Generator().get_state()},
             "torch_cpu": torch.get_rng_state()}
    save_checkpoint(tmp_path / "ids_run" / "ckpt", 1, restopo.compile(spec), None, state,
                    run_meta(spec, "."))
    return tmp_path / "ids_run"


def test_eval_of_token_ids_scores_their_held_out_split_by_default(run, tmp_path, capsys):
    """--data with token ids (a folder of train.bin and val.bin, or a .BIN in capitals)
    scores val by default, as the help says: only the user's own text is scored whole (a
    token-id folder was scored train + val, the model's training data in the score)."""
    import numpy as np
    folder, _ = run
    ids = np.arange(600, dtype=np.uint16) % 256
    (tmp_path / "ids").mkdir()
    ids.tofile(tmp_path / "ids" / "train.bin")
    ids[:100].tofile(tmp_path / "ids" / "val.bin")
    ids.tofile(tmp_path / "IDS.BIN")
    ids_run = _ids_run(folder, tmp_path, tmp_path / "IDS.BIN")
    for data, val_tokens in ((tmp_path / "ids", 100), (tmp_path / "IDS.BIN", 30)):
        assert main(["eval", str(ids_run), "--data", str(data), "--format", "json",
                     "--no-progress"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["split"] == "val" and got["tokens"] == val_tokens - 1, (data, got)
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "a.txt").write_text(TEXT)
    assert main(["eval", str(folder / "run"), "--data", str(tmp_path / "own"), "--format",
                 "json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["split"] == "all" and got["tokens"] == len(TEXT.encode()) - 1


def test_eval_of_all_token_ids_reads_no_window_across_train_bin_and_val_bin(run, tmp_path,
                                                                            capsys,
                                                                            monkeypatch):
    """--split all of a folder of train.bin and val.bin scored them as one sequence: windows
    ran from the end of train.bin into the start of val.bin, two files that never meet. Here
    train ids are below 128 and val ids above, so a crossing window shows."""
    import numpy as np

    import restopo.train.score as score_module
    folder, _ = run
    (tmp_path / "ids").mkdir()
    train = np.arange(203, dtype=np.uint16) % 128  # not a whole number of windows: a tail
    val = 128 + np.arange(77, dtype=np.uint16) % 128
    train.tofile(tmp_path / "ids" / "train.bin")
    val.tofile(tmp_path / "ids" / "val.bin")
    ids_run = _ids_run(folder, tmp_path, tmp_path / "ids")
    rows, nll = [], score_module._nll
    monkeypatch.setattr(score_module, "_nll", lambda m, r: rows.append(r) or nll(m, r))
    assert main(["eval", str(ids_run), "--split", "all", "--batch-size", "3", "--format",
                 "json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["split"] == "all" and got["tokens"] == len(train) - 1 + len(val) - 1
    windows = [w for r in rows for w in r.tolist()]
    assert all(max(w) < 128 or min(w) >= 128 for w in windows), "a window crossed the files"
    targets = sorted(t for w in windows for t in w[1:])  # each target once, as the help says
    assert targets == sorted(train[1:].tolist() + val[1:].tolist())


def test_eval_refuses_data_of_another_kind_than_the_model_was_trained_on(run, tmp_path,
                                                                           capsys):
    """A model trained on byte text scored on token ids below its vocab (or one trained on
    token ids scored on text) was scored without a word: the numbers meant nothing."""
    import numpy as np
    folder, _ = run
    (np.arange(600, dtype=np.uint16) % 256).tofile(tmp_path / "ids.bin")
    assert main(["eval", str(folder / "run"), "--data", str(tmp_path / "ids.bin"),
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert (f"--data {tmp_path / 'ids.bin'} is token ids (.bin), but this model was trained "
            f"on byte-level text (") in err and "corpus.txt); an id means" in err
    assert err.count("(") == err.count(")") == 2, err  # no kind said twice, in two brackets
    ids_run = _ids_run(folder, tmp_path, tmp_path / "ids.bin")
    assert main(["eval", str(ids_run), "--data", str(folder / "corpus.txt"),
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert (f"--data {folder / 'corpus.txt'} is byte-level text, but this model was trained "
            f"on token ids (.bin) ({tmp_path / 'ids.bin'}); an id means") in err
    assert main(["eval", str(ids_run), "--data", str(tmp_path / "ids.bin"), "--format",
                 "json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["split"] == "val"


def test_export_command_and_mistakes(run, tmp_path, capsys):
    folder, model = run
    assert main(["export", str(folder / "run"), "-o", str(tmp_path / "e.safetensors")]) == 0
    assert same(load(tmp_path / "e.safetensors"), model)
    assert main(["export", str(folder / "run"), "-o", str(tmp_path / "e.txt")]) == 2
    assert main(["export", str(tmp_path / "missing"), "-o", str(tmp_path / "e.pt")]) == 1
    err = capsys.readouterr().err
    assert "must end in .safetensors, .pt or .py" in err and "no such file" in err
    assert not (tmp_path / "e.pt").exists()
    for command in ("generate", "eval", "export"):
        assert main([command, "--help"]) == 0
        assert f"restopo {command} " in capsys.readouterr().out


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_an_export_reads_its_run_s_relative_data_from_any_folder(run, tmp_path, capsys,
                                                                  monkeypatch, suffix):
    """The spec's train.data, corpus.txt, is relative to the run's spec folder; an export
    records that folder, so `restopo eval` of it (no --data) scores the run's held-out
    split from anywhere (it read corpus.txt from the current folder: none, or other text)."""
    folder, _ = run
    out = tmp_path / f"e{suffix}"
    assert main(["export", str(folder / "run"), "-o", str(out)]) == 0
    monkeypatch.chdir(tmp_path)
    assert main(["eval", str(out), "--format", "json", "--no-progress"]) == 0
    from_export = json.loads(capsys.readouterr().out)
    assert main(["eval", str(folder / "run"), "--format", "json", "--no-progress"]) == 0
    from_run = json.loads(capsys.readouterr().out)
    assert from_run.pop("checkpoint") != from_export.pop("checkpoint")
    assert from_run == from_export and from_export["split"] == "val"


def test_compile_pt_reads_relative_data_from_its_spec_folder(run, tmp_path, monkeypatch):
    """restopo compile -o model.pt writes what restopo export does: the spec's data folder
    too, so the model's spec reads its relative train.data from there."""
    from restopo.train.runspec import data_base
    folder, _ = run
    out = tmp_path / "m.pt"
    assert main(["compile", str(folder / "t.restopo"), "-o", str(out)]) == 0
    monkeypatch.chdir(tmp_path)
    assert data_base(load(out).restopo_spec) == str(folder.resolve())


@pytest.fixture
def damaged_run(run, tmp_path):
    """A copy of the run whose newest checkpoint (step 2) has a truncated weights file."""
    import shutil
    folder, model = run
    shutil.copytree(folder / "run", tmp_path / "run")
    weights = tmp_path / "run" / "ckpt" / "step_000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return tmp_path / "run"


def test_load_never_passes_over_a_damaged_checkpoint_silently(damaged_run):
    with pytest.warns(UserWarning, match="step_000002 is damaged"):
        model = load(damaged_run)
    assert model.restopo_source.name == "step_000001"
    heard = []
    load(damaged_run, say=heard.append)  # a caller's own channel instead of the warning
    assert len(heard) == 1 and "step_000002" in heard[0]


@pytest.mark.parametrize("command, extra", [
    ("eval", ["--no-progress"]), ("export", ["-o", "OUT/e.safetensors"]),
    ("generate", ["--prompt", "d", "--max-new-tokens", "2"])])
def test_commands_say_which_checkpoint_they_used(damaged_run, tmp_path, capsys, command,
                                                 extra):
    extra = [x.replace("OUT", str(tmp_path)) for x in extra]
    assert main([command, str(damaged_run), *extra]) == 0
    captured = capsys.readouterr()
    said = [ln for ln in captured.err.splitlines() if ln.startswith(f"restopo {command}: note")]
    assert "step_000002 is damaged" in said[0]
    assert said[-1].endswith(str(damaged_run / "ckpt" / "step_000001"))
    if command == "eval":  # the score says whose it is
        assert captured.out.startswith(str(damaged_run / "ckpt" / "step_000001"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["eval", "generate", "diagnose", "train"])
def test_device_cuda_without_cuda_is_a_usage_error(run, capsys, command):
    folder, _ = run
    target = folder / "t.restopo" if command == "train" else folder / "run"
    assert main([command, str(target), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "torch sees no CUDA device here; use --device cpu" in err and "Traceback" not in err


def test_diagnose_reads_an_export(run, tmp_path, capsys, monkeypatch):
    """The README's promise: an export is one file for diagnose too (it had said 'no
    complete checkpoint' for any file), its data read where its run read it (the help said
    relative to the current folder)."""
    folder, _ = run
    out = tmp_path / "e.safetensors"
    assert main(["export", str(folder / "run"), "-o", str(out)]) == 0
    monkeypatch.chdir(tmp_path)  # not the run's folder: the export says where its data is
    assert main(["diagnose", str(out), "--batches", "1", "--batch-size", "2"]) == 0
    figures = tmp_path / "e-diagnose"
    assert (figures / "depth_attention.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((figures / "diagnose.json").read_text())["checkpoint"] == str(out)
    capsys.readouterr()
    assert main(["diagnose", "--help"]) == 0  # as its help says (it said: from this folder)
    assert "data is read where the run read it" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command, extra", [
    ("eval", ["--no-progress"]), ("diagnose", []), ("export", ["-o", "OUT/e.safetensors"]),
    ("generate", ["--prompt", "d", "--max-new-tokens", "2"])])
def test_a_spec_given_for_a_model_says_to_train_it_first(run, tmp_path, capsys, command,
                                                         extra):
    """A command line's user is told what to run (it said 'a .restopo spec is compiled with
    restopo.compile', the Python API)."""
    folder, _ = run
    spec = folder / "t.restopo"
    extra = [x.replace("OUT", str(tmp_path)) for x in extra]
    assert main([command, str(spec), *extra]) == 1
    err = capsys.readouterr().err
    assert err == (f"restopo {command}: error: {spec} is a spec, not a trained model; train "
                   f"it first (restopo train {spec}) and give its run folder or a "
                   f"checkpoint\n")


@pytest.mark.parametrize("command, extra", [
    ("eval", ["--no-progress"]), ("diagnose", []), ("export", ["-o", "OUT/e.safetensors"]),
    ("generate", ["--prompt", "d", "--max-new-tokens", "2"])])
def test_a_sweep_folder_given_for_one_run_names_its_runs(run, tmp_path, capsys, command,
                                                         extra):
    """A sweep's --out holds runs, not a checkpoint: the error says so and names runs to give
    (it said only 'no complete checkpoint in ...')."""
    import shutil
    folder, _ = run
    sweep = tmp_path / "sw4"
    for name in ("a-s0", "b-s0", "c-s0"):
        shutil.copytree(folder / "run", sweep / name)
        (sweep / name / "run.json").write_text(json.dumps({"arm": name[0], "seed": 0}))
    shutil.rmtree(sweep / "a-s0" / "ckpt" / "step_000001")  # a run with no checkpoint yet
    shutil.rmtree(sweep / "a-s0" / "ckpt" / "step_000002")
    extra = [x.replace("OUT", str(tmp_path)) for x in extra]
    assert main([command, str(sweep), *extra]) == 1
    err = capsys.readouterr().err
    assert err == (f"restopo {command}: error: {str(sweep)!r} is a sweep's folder (a folder of "
                   f"runs), not one run; give one of its runs, e.g. {str(sweep / 'b-s0')!r} "
                   f"or {str(sweep / 'c-s0')!r}\n")
    # runs trained with train --out runs/NAME make runs/ a folder of runs, not a sweep's
    for name in ("a-s0", "b-s0", "c-s0"):
        (sweep / name / "run.json").unlink()
    assert main([command, str(sweep), *extra]) == 1
    err = capsys.readouterr().err
    assert f"{str(sweep)!r} is a folder of runs, not one run; give one of its runs" in err
    assert "sweep" not in err.replace(str(sweep), "")


@pytest.mark.parametrize("flags, said", [
    (["--prompt", "abc", "--prompt-ids", "65 66"], "not allowed with argument"),
    (["--temperature", "nan"], "--temperature: expected a finite number"),
    (["--temperature", "inf"], "--temperature: expected a finite number"),
    (["--top-p", "nan"], "--top-p: expected a finite number"),
    # out of range: a usage error naming the flag (was decode's 'top_k must be', exit 1)
    (["--top-k", "0"], "argument --top-k: must be at least 1, got 0"),
    (["--top-p", "1.5"], "argument --top-p: must be above 0 and at most 1, got 1.5"),
    (["--temperature", "-1"], "argument --temperature: must be 0 (greedy) or more"),
    (["--max-new-tokens", "-3"], "argument --max-new-tokens: must be at least 0, got -3")])
def test_generate_flags_that_cannot_both_hold_or_are_not_numbers(run, capsys, flags, said):
    folder, _ = run
    assert main(["generate", str(folder / "run"), *flags]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("data", ["", "  "])
def test_a_blank_eval_data_names_the_flag(run, capsys, data):
    """eval --data '' said 'train.data is empty', a setting the command was not reading."""
    folder, _ = run
    assert main(["eval", str(folder / "run"), "--data", data]) == 2
    err = capsys.readouterr().err
    assert "argument --data: must not be empty; give builtin:stdlib" in err
    assert "train.data" not in err


def test_eval_of_a_split_too_short_to_score_says_which_and_what_to_do(tmp_path, capsys):
    """A .bin whose held-out tail is one token was 'need at least 2 tokens to score; got 1',
    naming neither the split nor --split all, which scores it."""
    ids = np.arange(30, dtype=np.uint16)
    ids.tofile(tmp_path / "ids.bin")  # 5% held out: a tail of 1 token
    (tmp_path / "t.restopo").write_text(SPEC.replace('"corpus.txt"', '"ids.bin"'))
    export(restopo.compile(str(tmp_path / "t.restopo")), tmp_path / "m.pt")
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "m.pt"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("restopo eval: error: the val split of token ids ")
    assert "too short to score (1 token;" in err and "--split all" in err
    assert main(["eval", str(tmp_path / "m.pt"), "--no-progress", "--split", "all"]) == 0
    assert f"(all split, {len(ids) - 1} tokens)" in capsys.readouterr().out


def test_a_file_restopo_wrote_that_holds_no_model_says_what_to_give(run, tmp_path, capsys):
    """A standalone module restopo wrote (export -o .py) was 'not a model restopo saved',
    and a run's metrics.jsonl or loss.png no more than that: each now says what it is and
    what to give instead."""
    folder, model = run
    module = tmp_path / "tiny_model.py"
    assert main(["export", str(folder / "run"), "-o", str(module)]) == 0
    with pytest.raises(LoadError, match=r"tiny_model.py is a standalone module, not weights; "
                                        r"give the .pt or .safetensors .*tiny_model.build\(\)"):
        load(module)
    for name in ("metrics.jsonl", "loss.png"):
        (folder / "run" / name).write_text("{}")
        with pytest.raises(LoadError, match=f"is a file of the run folder {folder / 'run'}, "
                                            f"not a model; give the folder itself"):
            load(folder / "run" / name)
        (folder / "run" / name).unlink()
    capsys.readouterr()
    assert main(["generate", str(module)]) == 1
    assert len(capsys.readouterr().err.splitlines()) == 1
    assert same(load(folder / "run"), model)  # the folder it names loads


@pytest.mark.parametrize("name", ["latest", "step_000002/state.pt", "step_000002/meta.json",
                                  "step_000002/optimizer.pt"])
def test_a_file_of_a_checkpoint_points_at_its_folder(run, capsys, name):
    """A checkpoint's state.pt was 'not a restopo model file (no 'spec' and 'state_dict');
    write one with restopo compile', its meta.json or ckpt/latest 'not a model restopo
    saved': now each names the folder to give instead."""
    folder, model = run
    path = folder / "run" / "ckpt" / name
    assert path.is_file()
    with pytest.raises(LoadError, match=f"is a file of the checkpoint folder {path.parent}, "
                                        f"not a model; give the folder itself"):
        load(path)
    assert same(load(path.parent), model)  # the folder it names loads
    assert main(["generate", str(path)]) == 1
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_a_file_of_ones_own_named_latest_is_not_called_a_checkpoints(tmp_path):
    """Any file named latest was 'a file of the checkpoint folder F, not a model; give the
    folder itself', in a folder that holds no checkpoint; only ckpt/latest is now."""
    (tmp_path / "latest").write_text("my notes\n")
    with pytest.raises(LoadError) as info:
        load(tmp_path / "latest")
    assert "checkpoint" not in str(info.value)
    assert str(info.value).startswith(f"{tmp_path / 'latest'}: not a model restopo saved")


def test_an_export_is_opened_once(run, tmp_path, monkeypatch):
    """load read a .safetensors export's header twice: once for its spec, then again with
    the tensors (safetensors.torch.load_file opens the file anew)."""
    import safetensors
    import safetensors.torch
    folder, model = run
    export(load(folder / "run"), tmp_path / "m.safetensors")
    opened = []

    def counting(path, *args, **kwargs):
        opened.append(path)
        return real(path, *args, **kwargs)

    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", counting)
    monkeypatch.setattr(safetensors.torch, "safe_open", counting)
    assert same(load(tmp_path / "m.safetensors"), model)
    assert opened == [str(tmp_path / "m.safetensors")]


def test_generate_reads_text_for_a_model_trained_on_text_whatever_its_vocab(tmp_path, capsys):
    """generate took a vocab of 256 for 'reads bytes': a model trained on text with vocab 300
    refused --prompt and printed ids, and one trained on token ids of vocab 256 read
    --prompt as bytes and printed its ids as text. What the run trained on decides now."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    for data, vocab in (("corpus.txt", 300), ("ids.bin", 256)):
        spec = tmp_path / f"{vocab}.restopo"  # a relative data: read beside the spec
        spec.write_text(SPEC.replace("corpus.txt", data).replace("256", str(vocab)))
        torch.manual_seed(3)
        export(restopo.compile(str(spec)), tmp_path / f"{vocab}.pt")
    capsys.readouterr()
    text_model = str(tmp_path / "300.pt")
    assert main(["generate", text_model, "--prompt", "def f(", "--max-new-tokens", "40",
                 "--temperature", "1", "--seed", "1"]) == 0
    prompt = torch.tensor([list(b"def f(")])
    new = restopo.generate(load(text_model), prompt, 40, temperature=1, seed=1)[0, 6:].tolist()
    assert max(new) > 255  # ids that are no byte: each shows as U+FFFD
    pieces, run_of_bytes = [], b""
    for t in new:
        if t > 255:
            pieces += [run_of_bytes.decode("utf-8", "replace"), "\ufffd"]
            run_of_bytes = b""
        else:
            run_of_bytes += bytes([t])
    assert capsys.readouterr().out == "".join(pieces) + run_of_bytes.decode("utf-8",
                                                                              "replace") + "\n"
    ids_model = str(tmp_path / "256.pt")
    assert main(["generate", ids_model, "--prompt", "def"]) == 1
    assert "it was trained on token ids (.bin): give the prompt as token ids with " \
        "--prompt-ids" in capsys.readouterr().err
    assert main(["generate", ids_model, "--prompt-ids", "5 6", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    new = restopo.generate(load(ids_model), torch.tensor([[5, 6]]), 4, temperature=0)
    assert capsys.readouterr().out.split() == [str(t) for t in new[0, 2:].tolist()]


def test_an_export_beside_a_meta_json_is_no_file_of_a_checkpoint(run, tmp_path):
    """Any file but a .safetensors in a folder holding a meta.json was refused as a file of
    a checkpoint folder: a model.pt exported beside the user's own meta.json too."""
    folder, model = run
    (tmp_path / "meta.json").write_text("{}")
    export(model, tmp_path / "model.pt")
    assert same(load(tmp_path / "model.pt"), model)


@pytest.mark.parametrize("command, extra, runs", [
    ("eval", ["--no-progress"], "restopo.train.score.score"),
    ("generate", ["--prompt", "d", "--max-new-tokens", "2"], "restopo.decode.stream"),
    ("diagnose", ["--batches", "1", "--batch-size", "2", "-o", "OUT"],
     "restopo.train.diagnose.diagnose")])
@pytest.mark.parametrize("omp", [None, "3"])
def test_a_model_runs_on_one_thread_unless_omp_num_threads_says(run, tmp_path, monkeypatch,
                                                                command, extra, runs, omp):
    """eval and generate ran on torch's default threads, every core, as train and diagnose
    do not: on two cores others shared the tiny model's forward ran 5 to 60 times slower
    (a 20 s run took 74 s to eval). Each takes one thread, or what $OMP_NUM_THREADS says."""
    import importlib
    folder, _ = run
    module, name = runs.rsplit(".", 1)
    called, seen = getattr(importlib.import_module(module), name), []

    def spy(*args, **kw):
        seen.append(torch.get_num_threads())
        return called(*args, **kw)

    monkeypatch.setattr(f"{module}.{name}", spy)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)  # what torch read when it started
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        extra = [x.replace("OUT", str(tmp_path / "d")) for x in extra]
        assert main([command, str(folder / "run"), *extra]) == 0
        assert seen == [1 if omp is None else 3] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_diagnose_of_a_checkpoint_s_weights_file_writes_nothing_into_the_checkpoint(
        run, tmp_path, capsys):
    """A checkpoint's model.safetensors loads as an export does, and diagnose put its figures
    beside it, in step_NNNNNN/model-diagnose/: inside a folder restopo writes only when saving
    and deletes when pruning. The file now stands for its checkpoint, as its folder would."""
    import shutil
    folder, _ = run
    shutil.copytree(folder / "run", tmp_path / "run")
    step = tmp_path / "run" / "ckpt" / "step_000002"
    files = sorted(p.name for p in step.iterdir())
    assert main(["diagnose", str(step / "model.safetensors"), "--batches", "1",
                 "--batch-size", "2"]) == 0
    assert sorted(p.name for p in step.iterdir()) == files
    written = json.loads((tmp_path / "run" / "diagnose" / "diagnose.json").read_text())
    assert (written["checkpoint"], written["step"]) == (str(step), 2)
    assert f"wrote {tmp_path / 'run' / 'diagnose'}:" in capsys.readouterr().out


@pytest.mark.parametrize("command, extra", [
    ("eval", ["--no-progress"]), ("diagnose", []), ("export", ["-o", "OUT/e.safetensors"]),
    ("generate", ["--prompt", "d", "--max-new-tokens", "2"])])
def test_a_pruned_step_names_the_steps_its_run_still_holds(run, tmp_path, capsys, command,
                                                          extra):
    """A step folder a run has pruned since (train.keep), as the help's
    `restopo diagnose runs/tiny/ckpt/step_000200` is once the run goes on, was only 'no such
    file or folder' (diagnose: 'does not exist'); each command now names the steps there."""
    import shutil
    folder, _ = run
    shutil.copytree(folder / "run", tmp_path / "run")
    ckpt = tmp_path / "run" / "ckpt"
    shutil.rmtree(ckpt / "step_000001")
    extra = [x.replace("OUT", str(tmp_path)) for x in extra]
    assert main([command, str(ckpt / "step_000001"), *extra]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"restopo {command}: error: ")
    assert err.endswith(f"; give one {ckpt} holds: step_000002 (a run keeps its newest "
                        f"train.keep checkpoints, 3 unless set)\n"), err


@pytest.mark.parametrize("given", ["run", "run/ckpt", "run/ckpt/step_000002", "."])
def test_a_standalone_module_names_the_run_and_step_it_came_from(run, tmp_path, given,
                                                                 monkeypatch):
    """`restopo export RUN/ckpt/step_N -o x.py` wrote 'from step_N' in its docstring (from
    'ckpt' for the checkpoint folder, from '.' for a run given as .): only the base name of
    the path given. It now names the run and the step its weights are from."""
    folder, _ = run
    monkeypatch.chdir(folder / "run")
    module = tmp_path / "tiny_model.py"
    assert main(["export", str(folder / given) if given != "." else ".", "-o",
                 str(module)]) == 0
    doc = module.read_text().split("\n", 1)[0]
    assert doc.startswith('"""tiny_model: written by `restopo export` from run run, step 2;')


@pytest.mark.parametrize("given", ["nowhere", "run/ckpt/step_000009"])
def test_every_command_says_a_missing_checkpoint_in_the_same_words(run, capsys, given):
    """A run or checkpoint that is not there was 'no such file or folder' to eval, generate,
    export and restopo.load, but "checkpoint '...' does not exist" to diagnose; each now
    says it in one helper's words (a pruned step with the steps its run still holds)."""
    folder, _ = run
    path = folder / given
    with pytest.raises(LoadError) as loaded:
        load(path)
    said = str(loaded.value).partition("; ")[0]
    assert said == f"{path}: no such file or folder"
    for argv in (["generate", str(path)], ["eval", str(path)], ["diagnose", str(path)],
                 ["export", str(path), "-o", str(folder / "x.pt")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"restopo {argv[0]}: error: {said}; "), err
        if "step_" in given:
            assert "give one" in err and "step_000002" in err
