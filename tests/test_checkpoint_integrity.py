"""Checkpoints are verified before use (issue 16, #2, #6, #7): every file has a SHA-256 in
the manifest, any changed byte is found, a damaged or ill-formed checkpoint is passed over
for the newest good one (saying which and why), pruning waits for the new checkpoint to
verify, and what killed runs leave behind is swept on start."""
import json

import pytest
import torch

from hostile import time_limit
from restopo.train import checkpoint as ck
from restopo.train.checkpoint import CheckpointError

from test_checkpoint_atomic import Tied, _save, _trained


@pytest.fixture(autouse=True)
def _each_under_a_time_limit():
    with time_limit(600):
        yield

FILES = ck.FILES + (ck.MANIFEST,)


def _flip(path, offset, n=1):
    data = bytearray(path.read_bytes())
    offset %= len(data)
    for i in range(offset, min(offset + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_anywhere_is_found(tmp_path, name):
    m, opt = _trained()
    step = _save(tmp_path, 3, m, opt)
    size = (step / name).stat().st_size
    for offset in sorted({0, 1, size // 3, size // 2, size - 1}):
        assert ck.verify_checkpoint(step) is None
        _flip(step / name, offset)
        why = ck.verify_checkpoint(step)
        assert why is not None and (name in why or ck.MANIFEST in why), (offset, why)
        with pytest.raises(CheckpointError, match="damaged"):
            ck.load_checkpoint(step, Tied(), None)
        _flip(step / name, offset)  # put it back
    (step / name).write_bytes((step / name).read_bytes()[:-1])  # truncated
    assert ck.verify_checkpoint(step) is not None


def test_nothing_is_loaded_from_a_damaged_checkpoint(tmp_path):
    m, opt = _trained()
    step = _save(tmp_path, 1, m, opt)
    _flip(step / "optimizer.pt", 100)
    fresh = Tied()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError):
        ck.load_checkpoint(step, fresh, torch.optim.AdamW(fresh.parameters()))
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def _bad_state(step_dir, state):
    torch.save(state, step_dir / "state.pt")
    ck.write_manifest(step_dir)  # checksums agree: only the schema can catch it


def _bad_meta(step_dir, meta):
    (step_dir / "meta.json").write_text(json.dumps(meta))
    ck.write_manifest(step_dir)


def _good_state(step):
    return {"step": step, "torch_cpu": torch.get_rng_state(),
            "data": {"generator": torch.Generator().get_state()}}


@pytest.mark.parametrize("damage, words", [
    (lambda d: _bad_state(d, {"step": 2}), "no data position"),
    (lambda d: _bad_state(d, {**_good_state(2), "step": "abc"}), "not a whole number"),
    (lambda d: _bad_state(d, {**_good_state(2), "step": 7}), "meta.json says step 2"),
    (lambda d: _bad_state(d, {**_good_state(2), "data": {"generator": torch.zeros(
        5056, dtype=torch.uint8)}}), "no valid data position"),
    (lambda d: _bad_state(d, {**_good_state(2), "torch_cpu": torch.zeros(3)}),
     "no valid torch RNG state"),
    (lambda d: _bad_state(d, [1, 2]), "not a dict"),
    (lambda d: _bad_meta(d, {"step": 2, "overrides": [1]}), "'overrides' must be a list"),
    (lambda d: _bad_meta(d, {"step": 2, "spec_text": 123}), "'spec_text' is 123"),
    (lambda d: _bad_meta(d, {"step": "2"}), "'step' is '2'"),
    (lambda d: _bad_meta(d, [2]), "not a JSON object"),
])
def test_contents_that_load_but_are_wrong_fail_the_schema(tmp_path, damage, words):
    m, opt = _trained()
    _save(tmp_path, 1, m, opt)
    step = _save(tmp_path, 2, m, opt)
    damage(step)
    assert ck.verify_checkpoint(step) is None  # intact files ...
    assert words in ck.check_checkpoint(step)  # ... that do not hold a training state
    with pytest.raises(CheckpointError, match="cannot"):
        ck.load_checkpoint(step, Tied(), None)
    found, skipped = ck.find_resumable(tmp_path)
    assert found.name == "step_000001" and skipped[0][0] == step and words in skipped[0][1]


def test_a_checkpoint_that_does_not_read_back_prunes_nothing(tmp_path, monkeypatch):
    m, opt = _trained()
    for step in (1, 2, 3):
        _save(tmp_path, step, m, opt, keep=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]

    # a disk that changes the data after it was written: flip once the save has renamed it
    real_verify = ck.verify_checkpoint

    def flaky(step_dir):
        if step_dir.name == "step_000004":
            _flip(step_dir / "model.safetensors", 10)
        return real_verify(step_dir)

    monkeypatch.setattr(ck, "verify_checkpoint", flaky)
    with pytest.raises(CheckpointError, match="did not read back intact"):
        _save(tmp_path, 4, m, opt, keep=2)
    monkeypatch.setattr(ck, "verify_checkpoint", real_verify)
    names = [p.name for p in ck.list_checkpoints(tmp_path)]
    assert "step_000002" in names and "step_000003" in names  # nothing pruned


def test_pruning_renames_before_deleting_and_leftovers_are_swept(tmp_path):
    m, opt = _trained()
    for step in (1, 2):
        _save(tmp_path, step, m, opt)
    # what a kill leaves: a half-pruned folder, a save's temp folder, the atomic writer's
    # temp file of `latest`, a step folder missing files (a kill mid-delete before renames)
    (tmp_path / ".pruned-step_000000-1").mkdir()
    (tmp_path / ".tmp-step_000003-x").mkdir()
    (tmp_path / ".restopo-abc").write_text("step_000002\n")
    (tmp_path / ".latest-xyz").write_text("step_000002\n")
    half = tmp_path / "step_000000"
    half.mkdir()
    (half / "optimizer.pt").write_bytes(b"x")
    done = ck.clean_leftovers(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["damaged", "latest", "step_000001", "step_000002"], names
    assert (tmp_path / "damaged" / "step_000000" / "optimizer.pt").exists()  # kept aside
    assert len(done) == 5
    # the reason is the folder's own, read before it is moved (it named every file missing)
    assert "moved step_000000 to damaged/step_000000 (incomplete: model.safetensors, state.pt, " \
        "meta.json missing)" in done, done


def test_a_checkpoint_saved_before_manifests_still_loads(tmp_path):
    m, opt = _trained()
    step = _save(tmp_path, 1, m, opt)
    (step / ck.MANIFEST).unlink()
    assert ck.verify_checkpoint(step) is None and not ck.has_manifest(step)
    m2 = Tied()
    ck.load_checkpoint(step, m2, None)
    assert torch.equal(m2.mix.weight, m.mix.weight)


def test_resolve_passes_over_damaged_and_names_an_explicit_one(tmp_path):
    m, opt = _trained()
    root = tmp_path / "run" / "ckpt"
    _save(root, 1, m, opt)
    bad = _save(root, 2, m, opt)
    _flip(bad / "state.pt", 40)
    heard = []
    assert ck.resolve_checkpoint(tmp_path / "run", say=heard.append).name == "step_000001"
    assert "step_000002 is damaged (state.pt does not match" in heard[0]
    with pytest.raises(CheckpointError, match="step_000002 is damaged") as e:
        ck.resolve_checkpoint(bad)
    # and what to give instead (it said nothing)
    assert str(e.value).endswith(f"; give its run folder ({tmp_path / 'run'}) to use the "
                                 f"newest one that verifies")


@pytest.mark.parametrize("sharded", [False, True])
def test_a_missing_file_is_said_as_a_damaged_one_is(tmp_path, sharded):
    """A newer checkpoint missing a file (a shard, the weights) was passed over without a
    word, so eval, generate and export used an older step silently; given by its own path
    it said 'no complete checkpoint' without naming the file. A folder without a manifest
    is said to be used unverified."""
    m, opt = _trained()
    root = tmp_path / "run" / "ckpt"
    save = _save_sharded if sharded else _save
    save(root, 1, m, opt)
    newer = save(root, 2, m, opt)
    gone = next(n for n in ck.checkpoint_files(newer) if n.startswith(("shard-", "model")))
    (newer / gone).unlink()
    heard = []
    assert ck.resolve_checkpoint(tmp_path / "run", say=heard.append).name == "step_000001"
    assert heard == [f"{newer} is damaged (incomplete: {gone} missing); passing over it"]
    with pytest.raises(CheckpointError, match=f"step_000002 is incomplete: {gone} missing"):
        ck.resolve_checkpoint(newer)
    (root / "step_000001" / ck.MANIFEST).unlink()
    heard.clear()
    ck.resolve_checkpoint(root / "step_000001", say=heard.append)
    assert heard and "has no manifest.json" in heard[0] and "unverified" in heard[0]


def _save_sharded(root, step, m, opt):
    """A sharded checkpoint (the FSDP and pipeline layouts' form) written by one rank."""
    state = {"step": step, "torch_cpu": torch.get_rng_state(),
             "data": {"generator": torch.Generator().manual_seed(step).get_state()}}
    return ck.save_sharded(root, step, list(m.named_parameters()), opt, state,
                           {"spec_text": "x"}, rank=0, world=1, exchange=lambda o: [o],
                           layout="fsdp")


def test_a_flipped_byte_in_a_sharded_checkpoint_is_found_and_passed_over(tmp_path):
    """The layouts that write shards (added after the manifest) keep its promise: every
    file they write is in the manifest, any changed byte is found before anything is
    loaded, and resume passes over the damaged checkpoint for the one before."""
    m, opt = _trained()
    _save_sharded(tmp_path, 1, m, opt)
    step = _save_sharded(tmp_path, 2, m, opt)
    assert ck.is_sharded(step)
    names = ck.checkpoint_files(step) + (ck.MANIFEST,)
    assert sorted(names) == sorted(p.name for p in step.iterdir())  # nothing unlisted
    assert any(n.startswith("shard-") for n in names)
    order = [n for n, _ in m.named_parameters()]
    for name in names:
        size = (step / name).stat().st_size
        for offset in sorted({0, size // 2, size - 1}):
            assert ck.check_checkpoint(step) is None
            _flip(step / name, offset)
            why = ck.verify_checkpoint(step)
            assert why is not None, (name, offset)
            fresh = Tied()
            before = {k: v.clone() for k, v in fresh.state_dict().items()}
            with pytest.raises(CheckpointError):
                ck.load_into(step, list(fresh.named_parameters()),
                             torch.optim.AdamW(fresh.parameters()), order=order)
            assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
            found, skipped = ck.find_resumable(tmp_path)
            assert found.name == "step_000001", (name, offset)
            if why == f"{ck.INDEX} unreadable":  # no list of files: not even complete; train
                assert step not in ck.list_checkpoints(tmp_path)  # sweeps it aside (below)
            else:
                assert [(p, w) for p, w in skipped] == [(step, why)], (name, offset)
            _flip(step / name, offset)  # put it back
    shard = next(step / n for n in names if n.startswith("shard-"))
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated
    assert "bytes, the manifest says" in ck.verify_checkpoint(step)
    (step / ck.INDEX).write_text("{")  # what train's start says of an unreadable index
    assert ck.clean_leftovers(tmp_path) == [
        f"moved step_000002 to damaged/step_000002 (incomplete: {ck.INDEX} unreadable)"]


def test_the_index_weight_map_names_only_tensors_one_file_holds():
    """index.json's Hugging Face-style weight_map named the first shard for every tensor,
    also for those cut by rows across both (a reader of weight_map would take half of one
    for all of it). A cut tensor is left out; its parts say where its rows are."""
    from restopo.train.shards import build_index

    def entry(rows):
        return {"shape": [4, 2], "dtype": "float32", "rows": rows}
    index = build_index([("s0", {"model/w": entry([0, 2]), "model/b": entry(None)}),
                         ("s1", {"model/w": entry([2, 4]), "model/b": entry(None)})], 2, "fsdp")
    assert index["weight_map"] == {"model/b": "s0"}
    assert [p["file"] for p in index["tensors"]["model/w"]["parts"]] == ["s0", "s1"]



@pytest.mark.parametrize("gone", ["optimizer.pt", "state.pt"])
def test_a_checkpoint_without_optimizer_state_loads_as_a_model_not_to_resume(tmp_path, gone):
    """optimizer.pt deleted (it is twice the weights' size; evaluating needs none of it),
    or state.pt: eval and export refused the folder as incomplete and used an older step,
    and `restopo train` moved it to damaged/. A model loads from it; resuming does not."""
    m, opt = _trained()
    root = tmp_path / "run" / "ckpt"
    _save(root, 1, m, opt)
    newer = _save(root, 2, m, opt)
    (newer / gone).unlink()
    heard = []
    assert ck.resolve_checkpoint(tmp_path / "run", say=heard.append) == newer and not heard
    assert ck.resolve_checkpoint(newer) == newer
    m2 = Tied()
    ck.load_checkpoint(newer, m2)
    assert torch.equal(m2.mix.weight, m.mix.weight)
    with pytest.raises(CheckpointError, match=f"{gone} missing"):
        ck.load_checkpoint(newer, Tied(), torch.optim.AdamW(Tied().parameters()))
    assert ck.find_resumable(root)[0].name == "step_000001"
    assert ck.clean_leftovers(root) == [] and newer.is_dir()  # not a leftover: kept in place
    assert ck.newest_meta(root)[0] == newer
    # the weights are still checked against the manifest
    _flip(newer / "model.safetensors", 100)
    with pytest.raises(CheckpointError, match="model.safetensors does not match"):
        ck.resolve_checkpoint(newer)
