"""Hostile or damaged checkpoint directories whose pickles are harmless: refused by name, nothing read elsewhere.

Each case takes an honest checkpoint and changes one thing a DCP save never writes (found by a
hostile-checkpoint sweep; before the checks, each loaded silently, read outside the directory,
took memory without bound or raised a bare exception): a data file outside the directory
(``..``, an absolute path, a symlink), a tensor its chunks do not cover exactly once, a sparse
``.metadata`` of 3 GiB, a Zstandard frame that inflates to 80 MiB in a pickled item, garbage in
a tensor item read unverified (damage, not a refusal to trust), fields of the wrong type, and a
planted link at the consolidated file's temporary name.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch

from lightning_ragged import checkpoint as ck
from lightning_ragged.checkpoint import checksums
from tests.test_checkpoint_trust import _fresh, _trained


def _metadata(directory: Path):
    return pickle.loads((directory / ".metadata").read_bytes())  # our own honest file


def _rewrite(directory: Path, metadata) -> None:
    """Write ``metadata`` and record every file's and item's checksum anew: an attacker who re-signs."""
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = checksums.Manifest()
    manifest.add_file(directory, ".metadata")
    manifest.add_file(directory, ck.META_FILENAME)
    for index, info in metadata.storage_data.items():
        crc, _ = checksums.crc32_of_file(directory / info.relative_path, info.offset, info.length)
        manifest.add_item(info.relative_path, info.offset, info.length, crc, index.fqn, index.offset or ())
    manifest.write(directory)


def _entry(metadata, key: str):
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == key]
    return info


@pytest.fixture()
def saved(tmp_path) -> Path:
    model, optimizer = _trained()
    ck.save(tmp_path / "ckpt", model, [optimizer], {"step": 1})
    return tmp_path / "ckpt"


def _load(path: Path, **kwargs) -> None:
    model, optimizer = _fresh()
    ck.load(path, model, [optimizer], **kwargs)


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink"])
def test_data_file_outside_the_directory_is_refused(saved, tmp_path, how: str) -> None:
    """Another checkpoint's shard (a readable file in DCP's item format) is never pulled into the model."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    metadata = _metadata(saved)
    name = _entry(metadata, "model.embed.weight").relative_path
    shutil.move(saved / name, outside / name)
    if how == "symlink":
        (saved / name).symlink_to(outside / name)
    else:
        target = f"../elsewhere/{name}" if how == "parent" else str(outside / name)
        for info in metadata.storage_data.values():
            if info.relative_path == name:
                info.relative_path = target
    _rewrite(saved, metadata)
    for load in (_load, lambda p: ck.consolidate(p, tmp_path / "out.ckpt")):
        with pytest.raises(ck.CorruptCheckpointError, match=f"outside {saved}: refused"):  # untrusted
            load(saved)
    assert not (tmp_path / "out.ckpt").exists()


def test_links_you_made_load_when_trusted(saved, tmp_path) -> None:
    """A Hugging Face cache links every file to ../../blobs/<sha>: refused untrusted (the message says how to
    load it), loaded with trust_checkpoint=True; a name outside the directory in .metadata stays refused."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for data in saved.glob("*.distcp"):
        shutil.move(data, blobs / data.name)
        data.symlink_to(Path("..") / "blobs" / data.name)
    with pytest.raises(ck.CorruptCheckpointError, match="a link to .* load with trust_checkpoint=True"):
        _load(saved)
    model, optimizer = _fresh()
    ck.load(saved, model, [optimizer], trust_checkpoint=True)
    expected, _ = _trained()  # the model the fixture saved
    assert all(torch.equal(v, expected.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_state_named_optimizer_something_is_the_users(saved, tmp_path) -> None:
    """A Fabric save of {"model", "optimizer_g", ...} (a GAN's naming) was refused as misnumbered optimizer states;
    only optimizer_<number> keys are optimizer states. The model loads and consolidation keeps the entry."""
    metadata = _metadata(saved)
    metadata.planner_data = {k: ("optimizer_g", *p[1:]) if p[0] == "optimizer_0" else p for k, p in metadata.planner_data.items()}
    (saved / ".metadata").write_bytes(pickle.dumps(metadata))
    model, _ = _fresh()
    ck.load(saved, model, verify_checksums=False)
    out = ck.consolidate(saved, tmp_path / "out.ckpt", verify_checksums=False)
    assert "optimizer_g" in torch.load(out, weights_only=True)


def test_a_mismatch_on_the_loading_side_is_not_called_damage(saved) -> None:
    """DCP's own size-mismatch error for a template of another shape stays DCP's (it was reported as a damaged
    checkpoint, which invites deleting a good one)."""
    info = ck.inspect_checkpoint(saved)
    with pytest.raises(BaseException) as error:
        info.read_locally({"model": {"embed.weight": torch.zeros(1, 1)}})
    assert not isinstance(error.value, ck.CorruptCheckpointError), error.value


@pytest.mark.parametrize("change", ["drop", "duplicate"])
def test_tensor_not_covered_exactly_once_by_its_chunks_is_refused(saved, tmp_path, change: str) -> None:
    """A dropped chunk left the model's initial values in place silently (DCP loads what is there)."""
    metadata = _metadata(saved)
    item = metadata.state_dict_metadata["model.embed.weight"]
    if change == "drop":
        item.chunks.pop()
        expected = "its chunks hold"
    else:
        item.chunks.append(item.chunks[0])
        expected = "overlap"
    _rewrite(saved, metadata)
    for load in (_load, lambda p: ck.consolidate(p, tmp_path / "out.ckpt")):
        with pytest.raises(ck.CorruptCheckpointError, match=f"'model.embed.weight' .* not covered exactly once .*{expected}"):
            load(saved)


def test_sparse_metadata_file_is_refused_without_reading_it(saved) -> None:
    """A 3 GiB (sparse) .metadata was read whole before its checksum was compared."""
    os.truncate(saved / ".metadata", 3 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(ck.ChecksumMismatchError, match=r"has 3221225472 bytes, the checkpoint recorded \d+ bytes"):
            _load(saved)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20
    _load(saved, verify_checksums=False)  # unverified, it is read as a stream: the unpickler stops at its end


def test_decompression_bomb_in_a_pickled_item_is_refused(tmp_path) -> None:
    """An 80 MiB inflation of a few KB: bounded at 64 MiB (a pickled object's floor), never read whole."""
    import zstandard

    model, optimizer = _trained()
    ck.save(tmp_path / "ckpt", model, [optimizer], {"step": 1}, compress=True)
    metadata = _metadata(tmp_path / "ckpt")
    info = _entry(metadata, "optimizer_0.format")
    assert info.transform_descriptors, "the honest item is compressed"
    frame = zstandard.ZstdCompressor().compress(b"\0" * (80 << 20))
    data = tmp_path / "ckpt" / info.relative_path
    info.offset, info.length = data.stat().st_size, len(frame)
    with open(data, "ab") as handle:
        handle.write(frame)
    _rewrite(tmp_path / "ckpt", metadata)
    with pytest.raises(ck.CorruptCheckpointError, match=r"'optimizer_0.format' .* decompresses to more than 67108864 bytes"):
        _load(tmp_path / "ckpt")


def test_garbage_in_a_tensor_item_read_unverified_is_damage_not_distrust(saved) -> None:
    """Bit rot in an item's header was reported as an untrusted pickle, with advice to trust the file."""
    info = _entry(_metadata(saved), "model.embed.weight")
    with open(saved / info.relative_path, "r+b") as handle:
        handle.seek(info.offset + 40)
        handle.write(b"\x17" * 100)
    with pytest.raises(ck.CorruptCheckpointError, match="damaged: reading its shards failed .*Unsupported operand") as error:
        _load(saved, verify_checksums=False)
    assert not isinstance(error.value, ck.UntrustedCheckpointError)


def test_a_damaged_tensor_archive_read_unverified_is_damage(saved) -> None:
    """The end of a tensor item (its archive's directory) overwritten: torch's raw "PytorchStreamReader failed"
    escaped through DCP's CheckpointException (the consolidate CLI printed a traceback)."""
    info = _entry(_metadata(saved), "model.embed.weight")
    with open(saved / info.relative_path, "r+b") as handle:
        handle.seek(info.offset + info.length - 64)
        handle.write(b"\xff" * 64)
    with pytest.raises(ck.CorruptCheckpointError, match="damaged: reading its shards failed .*PytorchStreamReader"):
        _load(saved, verify_checksums=False)


def _storage_list(metadata) -> None:
    metadata.storage_data = list(metadata.storage_data.values())


def _deep_path(metadata) -> None:
    metadata.planner_data["model.embed.weight"] = ("model",) + ("a",) * 5000


def _optimizer_numbered_5(metadata) -> None:
    for key, path in list(metadata.planner_data.items()):
        if path[0] == "optimizer_0":
            metadata.planner_data[key] = ("optimizer_5",) + tuple(path[1:])


def _negative_offset(metadata) -> None:
    next(iter(metadata.storage_data.values())).offset = -8


def _size_as_text(metadata) -> None:
    metadata.state_dict_metadata["model.embed.weight"].size = "big"


@pytest.mark.parametrize(
    "edit, message",
    [
        (_storage_list, "storage_data is a list, not a dict"),
        (_deep_path, "is not a sequence of 1 to 64 keys"),
        (_optimizer_numbered_5, r"optimizer states are numbered \[5\], not 0 .. N"),
        (_negative_offset, r"storage entry is not \(file, offset >= 0"),
        (_size_as_text, "has no valid size, dtype and chunk list"),
    ],
)
def test_metadata_fields_no_save_writes_are_named(saved, edit, message: str) -> None:
    metadata = _metadata(saved)
    edit(metadata)
    (saved / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ck.CorruptCheckpointError, match=message):
        _load(saved, verify_checksums=False)


def test_meta_and_manifest_of_the_wrong_shape_are_named(saved) -> None:
    meta_bytes = (saved / ck.META_FILENAME).read_bytes()
    buffer = io.BytesIO()
    torch.save([1, 2], buffer)
    (saved / ck.META_FILENAME).write_bytes(buffer.getvalue())
    with pytest.raises(ck.CorruptCheckpointError, match="meta.pt is damaged: it holds a list, not a dict"):
        _load(saved, verify_checksums=False)
    (saved / ck.META_FILENAME).write_bytes(meta_bytes)
    manifest = (saved / checksums.MANIFEST_FILENAME).read_text()
    (saved / checksums.MANIFEST_FILENAME).write_text(manifest.replace('"files": {', '"files": {"x": "y", ', 1))
    with pytest.raises(ck.CorruptCheckpointError, match="checksums.json is unreadable .*the entry of 'x'"):
        _load(saved)


@pytest.mark.parametrize("fmt", ["lightning", "hf"])
def test_consolidation_removes_a_planted_link_at_its_temporary_name(saved, tmp_path, fmt: str) -> None:
    """The output directory is shared: a link at ``.NAME.partial`` must not be written through."""
    victim = tmp_path / "victim.txt"
    victim.write_text("important")
    out = tmp_path / "shared" / ("model.ckpt" if fmt == "lightning" else "export")
    out.parent.mkdir()
    (out.parent / f".{out.name}.partial").symlink_to(victim if fmt == "lightning" else tmp_path)
    if fmt == "lightning":
        ck.consolidate(saved, out)
        assert out.is_file() and not out.is_symlink()
    else:
        from lightning_ragged.checkpoint.hf_export import export_hf

        export_hf(saved, out)
        assert (out / "model.safetensors").is_file() and not (tmp_path / "model.safetensors").exists()
    assert victim.read_text() == "important"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "shared", "victim.txt"]
