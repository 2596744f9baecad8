"""Checkpoint trust and integrity: hostile pickles never run, corrupted bytes never load silently.

* Hostile ``meta.pt``, single-file ``.ckpt``, DCP ``.metadata`` and a pickled item inside a
  shard, each with a ``__reduce__`` payload that would write a marker file: every loader (engine
  ``load``, the strategy's ``LightningCheckpointIO``, the consolidate CLI with and without
  ``--weights-only``) raises ``UntrustedCheckpointError`` and no marker appears; with
  ``trust_checkpoint=True`` the file loads and the marker appears (so the tests can fail).
* 256 bytes set to 0xFF inside a tensor of a shard file (plain, Zstandard-compressed, a
  2-rank save, sync and async) or of a full ``.ckpt``: ``ChecksumMismatchError`` naming the file
  and the tensor; ``verify_checksums=False`` loads it and the values differ.
* Honest checkpoints load bit-identically.
"""

from __future__ import annotations

import contextlib

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_ragged as lr
from lightning_ragged import checkpoint as ck
from lightning_ragged.checkpoint import checksums
from lightning_ragged.cli.consolidate import main as consolidate_main
from lightning_ragged.lightning.checkpoint_io import LightningCheckpointIO
from tests.models import lm_loss, make_batches, make_model

CORRUPT = b"\xff" * 256


class Payload:
    """Pickles as ``eval(<write the marker>)``: unpickling it runs code. Evaluates to ``value``."""

    def __init__(self, marker: Path, value: object = 0) -> None:
        self.marker = marker
        self.value = value

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').write('pwned') and {self.value!r}",))


def _trained(seed: int = 0):
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lm_loss(model, make_batches(1, 4)[0]).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, param in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        for key, value in optimizer.state.get(param, {}).items():
            out[f"o.{index}.{key}"] = value.detach().clone()
    return out


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resign(directory: Path) -> None:
    """What an attacker does after editing a small file: record its new checksum too."""
    manifest = checksums.Manifest.read(directory)
    manifest.add_file(directory, ".metadata")
    manifest.add_file(directory, ck.META_FILENAME)
    manifest.write(directory)


def _flip_tensor_bytes(file: Path, values: torch.Tensor) -> None:
    """Set 256 bytes inside the saved bytes of ``values`` (found in ``file``) to 0xFF."""
    data = bytearray(file.read_bytes())
    raw = values.detach().contiguous().numpy().tobytes()
    position = data.find(raw[:512])
    assert position >= 0 and len(raw) >= 64 + len(CORRUPT), "tensor bytes not found in the file"
    data[position + 64 : position + 64 + len(CORRUPT)] = CORRUPT
    file.write_bytes(bytes(data))


def _item_file(directory: Path, key: str) -> Path:
    metadata = pickle.loads((directory / ".metadata").read_bytes())  # our own honest file
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == key]
    return directory / info.relative_path


@pytest.fixture()
def saved(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    model, optimizer = _trained()
    ck.save(tmp_path / "ckpt", model, [optimizer], {"step": 1})
    return tmp_path / "ckpt", _state(model, optimizer)


def _fresh():
    model = make_model(seed=5)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


# ------------------------------------------------------------------------ honest
@pytest.mark.parametrize("compress", [False, True])
def test_honest_checkpoint_loads_bit_identically_with_checksums(tmp_path, compress: bool) -> None:
    model, optimizer = _trained()
    ck.save(tmp_path / "c", model, [optimizer], {"step": 3}, compress=compress)
    manifest = json.loads((tmp_path / "c" / checksums.MANIFEST_FILENAME).read_text())
    assert set(manifest["files"]) == {".metadata", ck.META_FILENAME} and manifest["items"]
    restored, restored_opt = _fresh()
    assert ck.load(tmp_path / "c", restored, [restored_opt]) == {"step": 3}
    assert _identical(_state(restored, restored_opt), _state(model, optimizer))
    # .metadata stays exactly DCP's (no checksum attribute left on its storage entries)
    metadata = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    assert all(not hasattr(info, "_ragged_crc32") for info in metadata.storage_data.values())


def test_honest_full_file_has_a_sidecar_and_loads_bit_identically(tmp_path) -> None:
    model, optimizer = _trained()
    ck.save(tmp_path / "full.ckpt", model, [optimizer], full=True)
    assert checksums.sidecar_path(tmp_path / "full.ckpt").is_file()
    assert checksums.verify_file(tmp_path / "full.ckpt")
    torch.load(tmp_path / "full.ckpt", weights_only=True)  # still an ordinary checkpoint
    restored, restored_opt = _fresh()
    ck.load(tmp_path / "full.ckpt", restored, [restored_opt])
    assert _identical(_state(restored, restored_opt), _state(model, optimizer))
    LightningCheckpointIO().remove(tmp_path / "full.ckpt")
    assert not list(tmp_path.iterdir())  # the sidecar went with the file


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_another_kind_of_optimizer_is_refused_by_name(tmp_path, full: bool) -> None:
    # Before: loaded, then torch's bare KeyError: 'momentum' at SGD's first step (as under DDP)
    model, optimizer = _trained()
    ck.save(tmp_path / "ckpt", model, [optimizer], full=full)
    restored = make_model(seed=5)
    sgd = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ck.CheckpointMismatchError, match=r"another kind of optimizer than SGD: its param groups "
                       r"hold \['amsgrad', 'betas'.*where this optimizer's hold \['dampening', 'momentum'"):
        ck.load(tmp_path / "ckpt", restored, [sgd])
    adamw = torch.optim.AdamW(restored.parameters(), lr=1e-2)  # the same kind loads (an LR scheduler's
    adamw.param_groups[0]["initial_lr"] = 1e-2  # key on one side only is allowed)
    ck.load(tmp_path / "ckpt", restored, [adamw])
    assert all(torch.equal(adamw.state[p]["exp_avg"], optimizer.state[q]["exp_avg"])
               for p, q in zip(restored.parameters(), model.parameters()))


def test_top_k_removal_is_done_after_the_async_save_in_flight_is_published(tmp_path) -> None:
    # Before: every removal waited for the save in flight, so with ModelCheckpoint(save_top_k=1) (the default),
    # which removes the previous checkpoint after each save, no async save overlapped training. The removal
    # must not come before the new checkpoint exists either: a crash in between would leave none.
    from concurrent.futures import Future

    from lightning_ragged.checkpoint.writer import PendingSave

    model, optimizer = _trained()
    for outcome in ("published", "failed"):
        ck.save(tmp_path / "old.ckpt", model, [optimizer])
        future: Future = Future()
        io = LightningCheckpointIO(async_save=True)
        io.writer.pending = pending = PendingSave(future, lambda: None, tmp_path / "new.ckpt")
        io.remove(tmp_path / "old.ckpt")  # returns at once
        assert (tmp_path / "old.ckpt").exists()
        if outcome == "published":
            future.set_result(None)
            pending.wait()
            assert not (tmp_path / "old.ckpt").exists()
        else:
            future.set_exception(OSError("disk full"))
            with pytest.raises(OSError):
                pending.wait()
            restored, restored_optimizer = _fresh()
            ck.load(tmp_path / "old.ckpt", restored, [restored_optimizer])  # kept: the new one never came
        ran = []
        io.writer.pending = PendingSave(future, lambda: ran.append(1), tmp_path / "new.ckpt")
        with pytest.raises(OSError) if outcome == "failed" else contextlib.nullcontext():
            io.remove(tmp_path / "new.ckpt")  # the checkpoint being written: waited for first
        assert ran == ([1] if outcome == "published" else [])


# ------------------------------------------------------------------- corruption
@pytest.mark.parametrize("compress", [False, True])
def test_flipped_tensor_bytes_in_a_shard_name_the_file_and_tensor(tmp_path, compress: bool) -> None:
    model, optimizer = _trained()
    ck.save(tmp_path / "c", model, [optimizer], compress=compress)
    file = _item_file(tmp_path / "c", "model.blocks.0.qkv.weight")
    if compress:  # the bytes on disk are a Zstandard stream: corrupt its middle
        data = bytearray(file.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 256] = CORRUPT
        file.write_bytes(bytes(data))
    else:
        _flip_tensor_bytes(file, model.blocks[0].qkv.weight)
    restored, restored_opt = _fresh()
    with pytest.raises(ck.ChecksumMismatchError) as error:
        ck.load(tmp_path / "c", restored, [restored_opt])
    assert file.name in str(error.value) and Path(error.value.file).name == file.name
    if not compress:
        assert error.value.tensor == "model.blocks.0.qkv.weight" and "'model.blocks.0.qkv.weight'" in str(error.value)
        unverified, _ = _fresh()
        ck.load(tmp_path / "c", unverified, verify_checksums=False)  # loads silently, as DCP alone does
        assert torch.isnan(unverified.blocks[0].qkv.weight).any()
        assert not torch.equal(unverified.blocks[0].qkv.weight, model.blocks[0].qkv.weight)


def test_flipped_bytes_in_a_full_file_are_named(tmp_path) -> None:
    model, optimizer = _trained()
    ck.save(tmp_path / "full.ckpt", model, [optimizer], full=True)
    _flip_tensor_bytes(tmp_path / "full.ckpt", model.blocks[0].qkv.weight)
    restored, _ = _fresh()
    with pytest.raises(ck.ChecksumMismatchError, match="full.ckpt"):
        ck.load(tmp_path / "full.ckpt", restored)
    with pytest.raises(ck.ChecksumMismatchError, match="full.ckpt"):
        LightningCheckpointIO().load(restored, [], tmp_path / "full.ckpt", fitting=False)
    ck.load(tmp_path / "full.ckpt", restored, verify_checksums=False)
    assert not torch.equal(restored.blocks[0].qkv.weight, model.blocks[0].qkv.weight)


def test_edited_meta_and_missing_manifest_are_detected(saved) -> None:
    path, _ = saved
    meta = torch.load(path / ck.META_FILENAME, weights_only=True)
    meta["step"] = 2
    torch.save(meta, path / ck.META_FILENAME)
    with pytest.raises(ck.ChecksumMismatchError, match="meta.pt"):
        ck.load(path, make_model())
    (path / checksums.MANIFEST_FILENAME).unlink()
    with pytest.raises(ck.CorruptCheckpointError, match="checksums"):
        ck.load(path, make_model())
    assert ck.load(path, make_model(), verify_checksums=False) == {"step": 2}


def check_two_rank_corruption(root: str) -> dict:
    """Save on 2 ranks (sync and async), corrupt rank 1's file, load on 2 ranks: both ranks name it."""
    rank = dist.get_rank()
    out = {}
    for mode in ("sync", "async"):
        model = lr.fully_shard(make_model(), shard_granularity="row")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        writer = ck.CheckpointWriter()
        ck.save(f"{root}/{mode}", model, [optimizer], async_save=mode == "async", writer=writer)
        writer.wait()
        saved = _state(model, optimizer)
        restored = lr.fully_shard(make_model(seed=5), shard_granularity="row")
        restored_opt = torch.optim.AdamW(restored.parameters(), lr=1e-2)
        ck.load(f"{root}/{mode}", restored, [restored_opt])
        out[f"{mode}_identical"] = _identical(_state(restored, restored_opt), saved)
        dist.barrier()
        if rank == 0:
            data = Path(root, mode, "__1_0.distcp")
            blob = bytearray(data.read_bytes())
            blob[len(blob) // 2 : len(blob) // 2 + 256] = CORRUPT
            data.write_bytes(bytes(blob))
        dist.barrier()
        try:
            ck.load(f"{root}/{mode}", restored, [restored_opt])
            out[f"{mode}_error"] = None
        except ck.ChecksumMismatchError as error:
            out[f"{mode}_error"] = str(error)
    return out


def test_two_rank_checksums_travel_to_rank_zero_and_corruption_is_named_on_every_rank(dist_pool, tmp_path) -> None:
    for result in dist_pool(2).run(check_two_rank_corruption, str(tmp_path)):
        for mode in ("sync", "async"):
            assert result[f"{mode}_identical"], result
            assert result[f"{mode}_error"] and "__1_0.distcp" in result[f"{mode}_error"], result


# -------------------------------------------------------------- hostile pickles
def _hostile_meta(path: Path, marker: Path) -> None:
    meta = torch.load(path / ck.META_FILENAME, weights_only=True)
    meta["hyper_parameters"] = {"lr": Payload(marker, 0.1)}
    torch.save(meta, path / ck.META_FILENAME)
    _resign(path)


def _hostile_metadata(path: Path, marker: Path) -> None:
    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.storage_meta.modules = [Payload(marker, "x")]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _resign(path)


HOSTILE = {"meta.pt": _hostile_meta, ".metadata": _hostile_metadata}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_directory_is_refused_by_every_loader_and_runs_only_when_trusted(saved, tmp_path, kind: str) -> None:
    path, state = saved
    marker = tmp_path / "marker"
    HOSTILE[kind](path, marker)
    model, optimizer = _fresh()
    untrusted, words = ck.UntrustedCheckpointError, f"{kind}.*trust_checkpoint=True"
    for attempt, error, message in (
        (lambda: ck.load(path, model, [optimizer]), untrusted, words),
        (lambda: ck.load(path, model, [optimizer], weights_only=True), untrusted, words),
        (lambda: ck.inspect_checkpoint(path, verify_checksums=False), untrusted, words),
        (lambda: LightningCheckpointIO().load(model, [optimizer], path, fitting=True), untrusted, words),
        # a string is no flag: before, trust_checkpoint="no" (non-empty) was read as True and the payload ran
        (lambda: ck.load(path, model, [optimizer], trust_checkpoint="no"), TypeError, "trust_checkpoint='no' must be"),
        (lambda: ck.consolidate(path, tmp_path / "out.ckpt", trust_checkpoint="false"), TypeError, "='false' must be"),
        (lambda: ck.inspect_checkpoint(path, trust_checkpoint="False"), TypeError, "trust_checkpoint='False' must be"),
        (lambda: LightningCheckpointIO(trust_checkpoint="false"), TypeError, "trust_checkpoint='false' must be"),
        (lambda: ck.load(path, model, [optimizer], weights_only="no"), TypeError, "weights_only='no' must be a bool"),
    ):
        with pytest.raises(error, match=message):
            attempt()
        assert not marker.exists()
    LightningCheckpointIO(trust_checkpoint=True).load(model, [optimizer], path, fitting=True)
    assert marker.exists()  # the payload ran: the refusals above were real
    assert _identical(_state(model, optimizer), state)
    marker.unlink()
    ck.load(path, make_model(), trust_checkpoint=True)
    assert marker.exists()


def test_checkpoint_arguments_are_checked_by_name(saved, tmp_path) -> None:
    path, state = saved
    model, optimizer = _fresh()
    for attempt, message in (
        (lambda: ck.load(path, model, [optimizer], strict="no"), "strict='no' must be a bool"),
        (lambda: ck.load(path, model, [optimizer], verify_checksums="no"), "verify_checksums='no' must be a bool"),
        (lambda: ck.load(path, model, optimizer), r"optimizers=AdamW\(...\) must be a list of optimizers: pass \[optimizer\]"),
        (lambda: ck.save(tmp_path / "other", model, optimizer), "must be a list of optimizers"),
        (lambda: ck.save(tmp_path / "other", model, full="no"), "full='no' must be a bool"),
    ):
        with pytest.raises(TypeError, match=message):
            attempt()
    # consolidating into the checkpoint itself would replace its own files (meta.pt: the checkpoint was lost)
    for inside in (path / "meta.pt", path):
        with pytest.raises(ValueError, match="inside the checkpoint it consolidates"):
            ck.consolidate(path, inside)
    with pytest.raises(ValueError, match="batch_bytes=0 must be a positive int"):
        ck.consolidate(path, tmp_path / "out.ckpt", batch_bytes=0)
    ck.load(path, model, [optimizer])  # untouched by all of the above
    assert _identical(_state(model, optimizer), state)
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_consolidate_cli_refuses_hostile_pickles_with_and_without_weights_only(saved, tmp_path, capsys, kind: str) -> None:
    path, _ = saved
    marker = tmp_path / "marker"
    HOSTILE[kind](path, marker)
    for flags in ([], ["--weights-only"]):
        assert consolidate_main([str(path), str(tmp_path / "out.ckpt"), *flags]) == 1
        assert "UntrustedCheckpointError" in capsys.readouterr().err
        assert not marker.exists() and not (tmp_path / "out.ckpt").exists()
    assert consolidate_main([str(path), str(tmp_path / "out.ckpt"), "--trust-checkpoint"]) == 0
    assert marker.exists() and checksums.verify_file(tmp_path / "out.ckpt")


def test_hostile_full_file_is_refused_and_runs_only_when_trusted(tmp_path) -> None:
    model, optimizer = _trained()
    file, marker = tmp_path / "full.ckpt", tmp_path / "marker"
    ck.save(file, model, [optimizer], full=True)
    checkpoint = torch.load(file, weights_only=True)
    checkpoint["hyper_parameters"] = {"lr": Payload(marker, 0.1)}
    torch.save(checkpoint, file)
    checksums.write_sidecar(file)
    restored, restored_opt = _fresh()
    for attempt in (
        lambda: ck.load(file, restored, [restored_opt]),
        lambda: LightningCheckpointIO().load(restored, [restored_opt], file, fitting=True),
    ):
        with pytest.raises(ck.UntrustedCheckpointError, match="full.ckpt"):
            attempt()
        assert not marker.exists()
    ck.load(file, restored, [restored_opt], trust_checkpoint=True)
    assert marker.exists()
    assert _identical(_state(restored, restored_opt), _state(model, optimizer))


def test_hostile_pickled_item_inside_a_shard_is_refused(tmp_path) -> None:
    """DCP's own planner torch.loads non-tensor items (param groups...) with weights_only=False."""
    model, optimizer = _trained()
    marker = tmp_path / "marker"
    state = ck.sharded_optimizer_state_dict(model, optimizer)
    state["param_groups"][0]["lr"] = Payload(marker, 0.01)
    ck.CheckpointWriter().save({"model": ck.sharded_model_state_dict(model), "optimizer_0": state}, tmp_path / "c")
    assert not marker.exists()  # pickling only records the call
    restored, restored_opt = _fresh()
    with pytest.raises(ck.UntrustedCheckpointError, match="pickled item"):
        ck.load(tmp_path / "c", restored, [restored_opt])
    assert not marker.exists()
    ck.load(tmp_path / "c", restored, [restored_opt], trust_checkpoint=True)
    assert marker.exists() and restored_opt.param_groups[0]["lr"] == 0.01


def test_trust_and_weights_only_contradict(saved) -> None:
    with pytest.raises(ValueError, match="contradicts"):
        ck.load(saved[0], make_model(), weights_only=True, trust_checkpoint=True)
