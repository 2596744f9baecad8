"""Publishing a checkpoint with one atomic rename, and the hidden copies a crash can leave.

A save writes everything into a hidden sibling of its name ``P`` (``.ragged-partial-<h>``,
``h`` a hash of the name), then :func:`publish` makes it the checkpoint at ``P`` with
exactly **one** rename, so a crash at any moment leaves ``P`` as either the previous
complete checkpoint or the new one -- never absent (unless there was none before):

* **exchange** (where the filesystem can swap two names atomically,
  ``renameat2(RENAME_EXCHANGE)``: Linux ext4, xfs, btrfs, tmpfs, ...): the new directory and
  the one at ``P`` trade names in one call, so ``P`` stays a real directory; the old one,
  now hidden, is deleted afterwards.
* **link** (elsewhere: NFS, Lustre, non-Linux, ...): the new directory becomes a hidden
  version ``.ragged-data-<h>.v<N>`` and ``P`` a relative symlink to it, replaced with one
  ``os.replace``; older versions are deleted afterwards. A real directory already at ``P``
  (written before versions existed) must be moved aside first: that one migration is the
  only two-step publish, and the loader then finds the new complete version.
* a single **file** (``state_dict_type="full"``) replaces what is at ``P`` with one
  ``os.replace`` (a directory at ``P``: exchanged, as above).

Hidden names (``.ragged-*-<hex>``) match neither Lightning's ``last*.ckpt`` (``ckpt_path="last"``)
nor ``hpc_ckpt_*`` (SLURM resume, which reads every digit of a name containing it).

Every filesystem step of a save calls :func:`step` once it is done, with its name (the
names are :data:`STEPS`); :func:`on_step` installs a hook there, which the tests use to kill
the process between every pair of steps. :func:`hidden_copies` lists, newest first, the
hidden copies of ``P`` an interrupted save or removal can leave, for the loader to validate
when ``P`` itself is missing (it never chooses an incomplete one).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

TMP_PREFIX = ".ragged-partial-"
"""Where a save to ``P`` writes before it is published (and, after an exchange, the previous checkpoint until it is deleted)."""
OLD_PREFIX = ".ragged-old-"
"""A previous real directory moved aside (link publishing over it; also what older versions of this code left)."""
TRASH_PREFIX = ".ragged-trash-"
"""A directory being deleted (renamed first, so no half-deleted directory ever sits at a checkpoint's name)."""
VERSION_PREFIX = ".ragged-data-"
"""Link publishing: ``.ragged-data-<h>.v<N>``, the directory ``P`` links to."""
LINK_PREFIX = ".ragged-link-"
"""Link publishing: the new symlink, before it replaces ``P``."""
FILE_PREFIX = ".ragged-file-"
"""A single-file checkpoint (``"full"``) while it is written, before it replaces ``P``."""

STEPS = (
    "clear_partial",  # rank 0: a crashed save's hidden leftovers removed
    "make_partial",  # rank 0: the empty hidden directory
    "write_shards",  # every rank: DCP's files (rank 0's .metadata last)
    "write_meta",  # rank 0: meta.pt.part written and fsynced
    "rename_meta",  # rank 0: meta.pt.part -> meta.pt
    "write_checksums",  # rank 0: checksums.json
    "write_file",  # "full": the single file written (hidden)
    "rename_version",  # link: the directory -> .ragged-data-<h>.v<N>
    "make_link",  # link: .ragged-link-<h> -> .ragged-data-<h>.v<N>
    "retire_old",  # link over a real directory (migration) only: P -> .ragged-old-<h>
    "publish",  # THE rename: P is now the new checkpoint
    "fsync_parent",
    "remove_old",  # the previous checkpoint and stale hidden copies deleted
)
"""The names :func:`step` is called with, in the order a save takes them (each save takes a subsequence)."""

use_exchange: bool | None = None
"""None: exchange where the filesystem supports it (probed once per device); False: always link."""

_hooks: list[Callable[[str, Path], None]] = []
_exchange_support: dict[int, bool] = {}
_swept: set[Path] = set()  # directories whose leftovers this process has removed (remove_leftovers)
_VERSION = re.compile(r"\.v(\d+)$")


# ----------------------------------------------------------------------------- steps
def step(name: str, path: Path) -> None:
    """Called right after the filesystem step ``name`` (one of :data:`STEPS`) completed, on ``path``."""
    for hook in tuple(_hooks):
        hook(name, path)


@contextlib.contextmanager
def on_step(hook: Callable[[str, Path], None]) -> Iterator[None]:
    """Call ``hook(name, path)`` after every step of every save in this process while the block runs."""
    _hooks.append(hook)
    try:
        yield
    finally:
        _hooks.remove(hook)


# ----------------------------------------------------------------------------- names
def _digest(path: Path) -> str:
    return hashlib.sha1(path.name.encode()).hexdigest()[:12]


def hidden_sibling(path: Path, prefix: str) -> Path:
    """``prefix`` + a hash of ``path``'s name, next to it (hidden; no digit pattern Lightning scans for)."""
    path = Path(path)
    return path.parent / f"{prefix}{_digest(path)}"


def partial_path(path: str | os.PathLike) -> Path:
    """Where a save to ``path`` is written before it is published."""
    return hidden_sibling(Path(path), TMP_PREFIX)


def file_part_path(path: Path) -> Path:
    """Where a single-file checkpoint for ``path`` is written before it replaces it (torch.save needs a suffix)."""
    path = Path(path)
    return path.parent / f"{FILE_PREFIX}{_digest(path)}.part"


def _version_name(path: Path, number: int) -> str:
    return f"{VERSION_PREFIX}{_digest(path)}.v{number}"


def versions(path: Path) -> list[Path]:
    """The hidden versions of ``path`` (link publishing), oldest first."""
    path = Path(path)
    stem = f"{VERSION_PREFIX}{_digest(path)}.v"
    numbered = []
    try:
        entries = os.listdir(path.parent)
    except OSError:
        return []
    for name in entries:
        match = _VERSION.search(name)
        if name.startswith(stem) and match and name == stem + match.group(1):
            numbered.append((int(match.group(1)), path.parent / name))
    return [entry for _, entry in sorted(numbered)]


def linked_version(path: Path) -> Path | None:
    """The version ``path`` links to, if it is one of our links (a user's or Lightning's symlink is not)."""
    path = Path(path)
    if not path.is_symlink():
        return None
    target = os.readlink(path)
    if os.sep in target or (os.altsep and os.altsep in target):
        return None
    match = _VERSION.search(target)
    if match is None or target != _version_name(path, int(match.group(1))):
        return None
    return path.parent / target


def hidden_copies(path: Path) -> list[Path]:
    """Hidden directories that may hold a complete copy of ``path``'s checkpoint, newest first (validate them).

    Versions (link publishing), newest first; then what the previous two-rename publish
    left when interrupted between its renames: the new copy (``.ragged-partial-``, only
    next to a ``.ragged-old-``: alone it is an unfinished save) and the previous one.
    """
    path = Path(path)
    found = list(reversed(versions(path)))
    old, partial = hidden_sibling(path, OLD_PREFIX), partial_path(path)
    if old.is_dir() and not old.is_symlink():
        if partial.is_dir() and not partial.is_symlink():
            found.append(partial)
        found.append(old)
    return found


# ------------------------------------------------------------------------ primitives
def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_atomically(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path.part``, fsync it, then rename it to ``path`` (never a torn file at ``path``)."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    step("write_meta", part)
    os.replace(part, path)
    step("rename_meta", path)


def _delete(path: Path) -> None:
    """Remove a file, symlink (not its target) or directory (renamed to a trash name first)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        trash = hidden_sibling(path, TRASH_PREFIX)
        if os.path.lexists(trash):
            _remove_tree(trash)
        os.replace(path, trash)
        _remove_tree(trash)


def _remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _renameat2() -> Callable[[bytes, bytes, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return lambda a, b, flags: function(-100, a, -100, b, flags)  # AT_FDCWD


_RENAMEAT2 = _renameat2()
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EPERM, getattr(errno, "ENOTSUP", -1), getattr(errno, "EOPNOTSUPP", -1)}


def exchange(a: Path, b: Path) -> None:
    """Swap the names ``a`` and ``b`` (both exist; any types) in one atomic step, or raise OSError."""
    if _RENAMEAT2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a))
    if _RENAMEAT2(os.fsencode(a), os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def supports_exchange(directory: Path) -> bool:
    """Whether :func:`exchange` works in ``directory`` (probed once per filesystem device)."""
    if use_exchange is False or _RENAMEAT2 is None:
        return False
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return False
    if device not in _exchange_support:
        probe_a = Path(directory) / f".ragged-probe-{os.getpid()}-a"
        probe_b = Path(directory) / f".ragged-probe-{os.getpid()}-b"
        try:
            probe_a.touch()
            probe_b.touch()
            exchange(probe_a, probe_b)
            _exchange_support[device] = True
        except OSError as error:
            if error.errno not in _UNSUPPORTED:
                raise
            _exchange_support[device] = False
        finally:
            probe_a.unlink(missing_ok=True)
            probe_b.unlink(missing_ok=True)
    return _exchange_support[device]


def _is_real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


# --------------------------------------------------------------------------- a save
def refuse_foreign_directory(path: Path, markers: tuple[str, ...]) -> None:
    """A save replaces what is at ``path``: a directory holding files but none of ``markers`` is not a checkpoint
    (the user's output directory, ``default_root_dir``), so it is refused instead of deleted."""
    if path.is_dir() and not any((path / marker).exists() for marker in markers) and any(path.iterdir()):
        raise FileExistsError(
            f"checkpoint path {path} is an existing directory that holds no checkpoint (none of {list(markers)}): "
            "saving there would replace it and delete its files. Save to a new path (e.g. a file or directory "
            "inside it), or remove it first"
        )


def prepare_partial(path: Path, complete_marker: str) -> Path:
    """Rank 0, at the start of a save to ``path``: an empty hidden directory to write it in.

    A leftover at that name is an unfinished save and is removed -- except where an
    older version of this code was interrupted between its two renames (``path`` absent,
    a ``.ragged-old-`` copy next to it): then it is the newest complete copy and is kept,
    as a version, until this save is published.
    """
    path = Path(path)
    tmp = partial_path(path)
    if os.path.lexists(tmp):
        adopt = (
            not os.path.lexists(path)
            and _is_real_dir(hidden_sibling(path, OLD_PREFIX))
            and _is_real_dir(tmp)
            and (tmp / complete_marker).is_file()
        )
        if adopt:
            os.replace(tmp, path.parent / _version_name(path, _next_number(path)))
        else:
            _delete(tmp)
    step("clear_partial", tmp)
    tmp.mkdir(parents=True)
    step("make_partial", tmp)
    return tmp


def remove_leftovers_once(directory: Path, finished_marker: str) -> None:
    """:func:`remove_leftovers` at this process's first save into ``directory`` (rank 0; best effort)."""
    key = Path(directory).resolve()
    if key not in _swept:
        _swept.add(key)
        remove_leftovers(key, finished_marker)


def remove_leftovers(directory: Path, finished_marker: str) -> list[Path]:
    """Delete what crashed saves and removals of *other* names left in ``directory``; the deleted, sorted.

    Names change from save to save (``epoch=0-step=100``, ...), so a save killed mid-write
    left a ``.ragged-partial-`` copy (up to a whole checkpoint) that no later save to the same
    name would clear, and a removal killed mid-``rmtree`` a ``.ragged-trash-`` one. Deleted:
    every trash directory, unused link and exchange probe; a ``.ragged-old-`` copy and a finished
    partial copy (``finished_marker``, the file a save writes last) whose name now holds
    something strictly newer (the previous checkpoint an exchange or a two-step publish left,
    the copy a ``"full"`` save made its file from); an unfinished partial copy and a
    single-file part, unless it is the new half of a two-step publish (next to its kept
    ``.ragged-old-``). Kept: whatever may be the only complete copy (versions, a
    ``.ragged-old-`` whose name is missing or not newer, a finished copy not older than its
    name: a save killed between its last file and its publish; equal times, on filesystems
    with coarse timestamps, count as not newer). One job per directory, as
    ``ModelCheckpoint`` assumes; an entry that cannot be deleted is left.
    """
    directory = Path(directory)
    removed: list[Path] = []
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return removed
    named = {_digest(directory / name): directory / name for name in entries if not name.startswith(".")}

    def digest_of(name: str) -> str:
        return name.rsplit("-", 1)[-1].split(".", 1)[0]

    stale_old = {name for name in entries if name.startswith(OLD_PREFIX)
                 and _newer(named.get(digest_of(name)), directory / name)}
    for name in entries:
        entry = directory / name
        digest = digest_of(name)
        old = f"{OLD_PREFIX}{digest}"
        beside_old = old not in stale_old and _is_real_dir(directory / old)
        if name.startswith((TRASH_PREFIX, LINK_PREFIX, ".ragged-probe-")) or name in stale_old:
            stale = True
        elif name.startswith(FILE_PREFIX):  # no mark of completion: only a two-step publish's new half is kept
            stale = not beside_old
        elif name.startswith(TMP_PREFIX):
            finished = (entry / finished_marker).is_file()
            stale = _newer(named.get(digest), entry) if finished else not beside_old
        else:
            stale = False
        if stale:
            try:
                _remove_tree(entry)
            except OSError:
                continue
            if not os.path.lexists(entry):
                removed.append(entry)
    return removed


def _newer(published: Path | None, copy: Path) -> bool:
    """Whether ``published`` exists and was completed strictly after ``copy`` (a tie keeps ``copy``)."""
    try:
        return published is not None and os.stat(published).st_mtime_ns > os.stat(copy).st_mtime_ns
    except OSError:
        return False


def _next_number(path: Path) -> int:
    found = versions(path)
    return int(_VERSION.search(found[-1].name).group(1)) + 1 if found else 1


def publish(tmp: Path, path: Path) -> None:
    """Make ``tmp`` (a complete directory or file) the checkpoint at ``path``: one atomic rename (rank 0).

    Then the parent directory is fsynced and what ``path`` held before (and any stale hidden
    copy of it) is deleted.
    """
    tmp, path = Path(tmp), Path(path)
    if _is_real_dir(tmp) and not supports_exchange(path.parent):
        _publish_as_link(tmp, path)
    elif not os.path.lexists(path) or (not _is_real_dir(tmp) and not _is_real_dir(path)):
        os.replace(tmp, path)  # nothing there, or a file over a file / symlink
        step("publish", path)
    elif supports_exchange(path.parent):
        exchange(tmp, path)  # tmp now holds the previous checkpoint
        step("publish", path)
    else:  # a file over a real directory, without exchange: the one two-step case
        _retire(path)
        os.replace(tmp, path)
        step("publish", path)
    fsync_dir(path.parent)
    step("fsync_parent", path.parent)
    remove_stale(path, tmp)
    step("remove_old", path.parent)


def _publish_as_link(tmp: Path, path: Path) -> None:
    version = path.parent / _version_name(path, _next_number(path))
    os.replace(tmp, version)
    step("rename_version", version)
    link = hidden_sibling(path, LINK_PREFIX)
    if os.path.lexists(link):
        _delete(link)
    os.symlink(version.name, link)  # relative: the directory can be moved or copied whole
    step("make_link", link)
    if _is_real_dir(path):
        _retire(path)
    os.replace(link, path)
    step("publish", path)


def _retire(path: Path) -> None:
    old = hidden_sibling(path, OLD_PREFIX)
    if os.path.lexists(old):
        _delete(old)
    os.replace(path, old)
    step("retire_old", old)


def remove_stale(path: Path, tmp: Path | None = None) -> None:
    """Delete the hidden copies of ``path`` it no longer uses (and ``tmp``, what an exchange left there)."""
    path = Path(path)
    current = linked_version(path)
    stale = [v for v in versions(path) if current is None or v.name != current.name]
    stale += [hidden_sibling(path, OLD_PREFIX), hidden_sibling(path, LINK_PREFIX), file_part_path(path)]
    if tmp is not None:
        stale.append(Path(tmp))
    for entry in stale:
        if os.path.lexists(entry):
            _delete(entry)


# --------------------------------------------------------------------------- removal
def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint (directory, file or symlink) so that no half-deleted directory ever looks valid.

    Our link: its version is moved to a trash name first (``path`` dangles: no checkpoint),
    then the link is unlinked and the version deleted. Any other symlink is unlinked (its
    target left alone); a directory is renamed to a hidden name, then deleted.
    """
    path = Path(path)
    version = linked_version(path)
    if version is not None and version.is_dir():
        trash = hidden_sibling(version, TRASH_PREFIX)
        if os.path.lexists(trash):
            _remove_tree(trash)
        os.replace(version, trash)
        path.unlink()
        _remove_tree(trash)
    elif os.path.lexists(path):
        _delete(path)
    for entry in versions(path):  # versions nothing links to any more (an interrupted save or removal)
        _delete(entry)
