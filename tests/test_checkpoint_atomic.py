"""Checkpoints: round trip (tied weights, optimizer, RNG), atomicity, pruning, resolution."""
import pytest
import torch
from torch import nn

from restopo.train import checkpoint as ck
from restopo.train.checkpoint import CheckpointError


class Tied(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, 16, bias=False)
        self.head.weight = self.embed.weight  # tied: safetensors refuses naive shared saves

    def forward(self, idx):
        return self.head(self.mix(self.embed(idx)))


def _trained(seed=0):
    torch.manual_seed(seed)
    m = Tied()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(3):
        m(torch.randint(0, 16, (2, 5))).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _save(root, step, m, opt, **kw):
    state = {"step": step, "torch_cpu": torch.get_rng_state(),
             "data": {"generator": torch.Generator().manual_seed(step).get_state()}}
    return ck.save_checkpoint(root, step, m, opt, state, {"spec_text": "x"}, **kw)


def test_round_trip_keeps_ties_optimizer_and_state(tmp_path):
    m, opt = _trained()
    rng = torch.get_rng_state()
    path = _save(tmp_path, 7, m, opt)
    assert path.name == "step_000007" and (tmp_path / "latest").read_text().strip() == path.name
    m2 = Tied()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    state, meta = ck.load_checkpoint(ck.latest_checkpoint(tmp_path), m2, opt2)
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert m2.head.weight is m2.embed.weight  # still tied after loading
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)
    assert state["step"] == 7 and meta["step"] == 7 and meta["spec_text"] == "x"
    assert torch.equal(state["torch_cpu"], rng)


def test_loading_never_unpickles(tmp_path):
    m, opt = _trained()
    path = _save(tmp_path, 1, m, opt)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"step": 1, "x": Evil()}, path / "state.pt")
    ck.write_manifest(path)  # checksums agree: the loader itself must refuse to unpickle
    with pytest.raises(CheckpointError, match="never unpickles"):
        ck.load_checkpoint(path, Tied(), None)


@pytest.mark.parametrize("fail_after", ["model.safetensors", "optimizer.pt", "state.pt",
                                        "meta.json"])
def test_interrupted_save_leaves_previous_checkpoint(tmp_path, fail_after):
    m, opt = _trained()
    _save(tmp_path, 10, m, opt)
    m_new, opt_new = _trained(seed=1)

    def crash(name, path):
        if name == fail_after:
            raise KeyboardInterrupt("killed mid-save")

    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 20, m_new, opt_new, _write_file=crash)
    latest = ck.latest_checkpoint(tmp_path)
    assert latest.name == "step_000010"
    m2 = Tied()
    ck.load_checkpoint(latest, m2, torch.optim.AdamW(m2.parameters()))
    assert torch.equal(m2.mix.weight, m.mix.weight)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_partial_folder_from_a_killed_process_is_ignored(tmp_path):
    m, opt = _trained()
    _save(tmp_path, 5, m, opt)
    # what SIGKILL mid-save leaves: a temp folder with some files, and even a step folder
    # without its meta.json (cannot happen through save_checkpoint, but must not be trusted)
    tmp = tmp_path / ".tmp-step_000006-abc"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"\0" * 10)
    broken = tmp_path / "step_000009"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"junk")
    assert ck.latest_checkpoint(tmp_path).name == "step_000005"
    _save(tmp_path, 6, m, opt)  # the next save sweeps the leftovers
    assert not tmp.exists()


def test_stale_pointer_and_missing_pointer(tmp_path):
    m, opt = _trained()
    _save(tmp_path, 1, m, opt)
    _save(tmp_path, 2, m, opt)
    # a crash between the folder rename and the pointer update: the newer folder wins
    (tmp_path / "latest").write_text("step_000001\n")
    assert ck.latest_checkpoint(tmp_path).name == "step_000002"
    (tmp_path / "latest").unlink()
    assert ck.latest_checkpoint(tmp_path).name == "step_000002"
    assert ck.latest_checkpoint(tmp_path / "nothing") is None


def test_keeps_the_last_k(tmp_path):
    m, opt = _trained()
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, m, opt, keep=3)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == [
        "step_000003", "step_000004", "step_000005"]
    _save(tmp_path, 5, m, opt, keep=3)  # re-saving a step (a restarted run) replaces it
    assert ck.latest_checkpoint(tmp_path).name == "step_000005"


def test_resolve_checkpoint_forms_and_errors(tmp_path):
    m, opt = _trained()
    step = _save(tmp_path / "run" / "ckpt", 3, m, opt)
    for given in (tmp_path / "run", tmp_path / "run" / "ckpt", step):
        assert ck.resolve_checkpoint(given) == step
    with pytest.raises(CheckpointError, match="nope: no such file or folder"):
        ck.resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "emptyrun").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ck.resolve_checkpoint(tmp_path / "emptyrun")


def test_wrong_model_is_a_clear_error(tmp_path):
    m, opt = _trained()
    path = _save(tmp_path, 1, m, opt)
    with pytest.raises(CheckpointError, match="another spec|size|shape"):
        ck.load_checkpoint(path, Tied(width=4))
    (path / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        ck.read_meta(path)
