"""Writing into a folder of the user's without ever leaving half an output or touching what is not
od-dist's: a staging directory moved into place only when complete (`move_into_place`), one file
through a temporary file renamed over it (`write_file`), and `write_owned`, the files a command owns
in a folder among the user's, listed with their digests in a manifest."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable

from od_dist.data.errors import DatasetError

# ----- an output written aside, then moved into place ------------------------------------------


def staging_dir(out_dir: str) -> str:
    """A fresh, empty folder on `out_dir`'s file system (so renames are atomic) to write an output
    into before `move_into_place`: beside it, or inside it when it is a mount point; the caller
    removes it when done."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    if os.path.isdir(out_dir) and os.stat(out_dir).st_dev != os.stat(parent).st_dev:
        parent = out_dir
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 would become the output's mode
    return staging


def partial_file_beside(out: str, text: str, suffix: str = "") -> str:
    """A new temporary file beside `out` (the same file system, so a rename moves it in at once)
    holding `text`, with the mode a new file gets; the caller moves it in or removes it."""
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.partial-", suffix=suffix, dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would become the file's mode
    except BaseException:
        os.remove(tmp)
        raise
    return tmp


def write_file(out: str, text: str) -> None:
    """`text` into the file `out` through a temporary file beside it, renamed over it when
    complete: a reader sees the old file or the new one, never a part; a symlink at `out` is
    replaced, never written through. DatasetError (nothing changed) for a directory at `out`."""
    if os.path.isdir(out) and not os.path.islink(out):
        raise DatasetError(f"--out: '{out}': a directory; name the file to write, e.g. {out}/jobset.yaml")
    tmp = partial_file_beside(out, text)
    try:
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def move_into_place(staging: str, out_dir: str, owned: Callable[[str], bool]) -> None:
    """A finished staging folder (beside `out_dir`, on its file system) becomes `out_dir`'s output;
    `owned(name)` says which names in `out_dir` are an earlier output of the same kind. Nothing
    else there is ever replaced or deleted, and a file not ours where a new one would go is
    refused (DatasetError, nothing changed).

    A new `out_dir`, or one holding nothing but an earlier output, is swapped whole: an interrupt
    leaves the old output or the new one, never a mix. Anything written into it meanwhile (a
    checkpoint, a log) is moved back from the old folder, never deleted with it. A folder that
    also holds other files, or the working directory, or a mount point, is never moved: each new
    file or folder is renamed over its earlier one (each atomically), then the earlier output's
    names that this one does not write (stale shards) are removed."""
    if not os.path.lexists(out_dir):
        os.rename(staging, out_dir)  # atomic: the whole output appears at once
        return
    if not os.path.isdir(out_dir):
        raise DatasetError(f"--out: '{out_dir}': exists and is not a directory; choose another --out")
    ours = sorted(os.listdir(staging))
    present = os.listdir(out_dir)
    theirs = sorted(n for n in present if n in ours and not owned(n))
    if theirs:
        raise DatasetError(
            f"--out: '{out_dir}': {', '.join(theirs[:3])}{' ...' if len(theirs) > 3 else ''} there "
            f"{'was' if len(theirs) == 1 else 'were'} not written by od-dist and would be replaced; "
            "move them away, or choose another --out"
        )
    if all(owned(n) for n in present) and not _in_use(out_dir):
        _swap(staging, out_dir, owned)
        return
    # saved_model.pb last: a SavedModel is loadable only once its variables are in
    for name in sorted(ours, key=lambda n: n == "saved_model.pb"):
        src, dst = os.path.join(staging, name), os.path.join(out_dir, name)
        if os.path.isdir(src) and os.path.lexists(dst):
            if os.path.isdir(dst) and not os.path.islink(dst):
                _swap(src, dst, lambda n: True)  # an owned folder (a SavedModel's variables/)
                continue
            os.remove(dst)  # a file or symlink where the new output has a folder: ours by its name
        os.replace(src, dst)
    for name in present:
        if owned(name) and name not in ours:
            _remove_owned(os.path.join(out_dir, name))


def _in_use(folder: str) -> bool:
    """The working directory or a folder holding it (a rename would move it from under the
    process, and fails for '.'), or a mount point (which cannot be renamed)."""
    real, cwd = os.path.realpath(folder), os.path.realpath(os.getcwd())
    return os.path.ismount(folder) or cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep)


def _swap(new: str, folder: str, owned: Callable[[str], bool]) -> None:
    """`new` renamed into `folder`'s place; then whatever in the old folder is not `owned` (written
    there since it was listed) moved back into the new one, and the rest deleted."""
    parent = os.path.dirname(os.path.abspath(folder))
    aside = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.old-", dir=parent)
    os.rmdir(aside)  # a free name beside it, on the same file system
    os.rename(folder, aside)
    try:
        os.rename(new, folder)
    except BaseException:
        os.rename(aside, folder)  # interrupted between the two: the old output back in place
        raise
    kept = False
    for name in os.listdir(aside):
        if owned(name):
            continue
        try:
            os.rename(os.path.join(aside, name), os.path.join(folder, name))
        except OSError:  # the new output holds that name too: kept where it is, never deleted
            kept = True
    if kept:
        for name in os.listdir(aside):
            if owned(name):
                _remove_owned(os.path.join(aside, name))
        print(f"od-dist: files written into {folder} while it was replaced are in {aside}", file=sys.stderr)
    else:
        shutil.rmtree(aside, ignore_errors=True)


def _remove_owned(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.remove(path)


# ----- a folder of files od-dist owns among the user's ------------------------------------------

MANIFEST = ".od-dist-written"
_MANIFEST_HEAD = (
    "# The files od-dist wrote here, each with its SHA-256 (`sha256sum -c` checks them). Running it "
    "again\n# replaces or removes only these, and only while unchanged; nothing else here.\n"
)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def written_before(out_dir: str) -> dict[str, set[str]]:
    """What the manifest in `out_dir` lists: each plain file name with the digests it was written
    with (an empty set: listed by an od-dist that kept no digests)."""
    listed: dict[str, set[str]] = {}
    try:
        with open(os.path.join(out_dir, MANIFEST), encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#")]
    except (OSError, ValueError):  # none, or not a manifest: nothing there is known to be ours
        return listed
    for line in lines:
        digest, _, name = line.partition("  ") if "  " in line else ("", "", line.strip())
        if name and name == os.path.basename(name) and not name.startswith(".") and "\\" not in name:
            listed.setdefault(name, set()).update({digest} if re.fullmatch(r"[0-9a-f]{64}", digest) else ())
    return listed


def _unchanged(path: str, digests: set[str]) -> bool | None:
    """True: the regular file at `path` holds what od-dist wrote (one of `digests`); False: it was
    changed (or is a folder); None: a symlink, or no digest to compare with."""
    if os.path.islink(path):
        return None
    if not os.path.isfile(path):
        return False
    if not digests:
        return None
    with open(path, "rb") as f:
        return _digest(f.read()) in digests


def write_owned(out_dir: str, files: dict[str, tuple[bytes, int]]) -> list[str]:
    """Writes `files` (name -> (bytes, mode)) into `out_dir`, each through a temporary file beside
    it renamed over it when complete (a reader sees the old file or the new one, a symlink is
    replaced, never written through), and a manifest of them with their digests. Nothing else in
    `out_dir` is touched: only a file the manifest lists, unchanged since, is replaced. Refused
    (DatasetError, nothing written): a name to write that is a folder, a file the manifest does not
    list, or a listed file changed since. Files an earlier run listed that this run does not write
    go when unchanged; the others (changed, or listed without a digest) are returned: kept."""
    out_dir = os.path.normpath(out_dir)
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise DatasetError(f"--out: '{out_dir}': exists and is not a directory; choose another --out")
    before = written_before(out_dir)
    theirs, changed = [], []
    for name in files:
        path = os.path.join(out_dir, name)
        if not os.path.lexists(path):
            continue
        if name not in before:
            theirs.append(name)
        elif _unchanged(path, before[name]) is False:
            changed.append(name)
    for names, why in ((theirs, "not written by od-dist"), (changed, "changed since od-dist wrote them")):
        if names:
            raise DatasetError(
                f"--out: '{out_dir}': {', '.join(sorted(names)[:3])}{' ...' if len(names) > 3 else ''} "
                f"there {'is' if len(names) == 1 else 'are'} {why} and would be replaced; move "
                f"{'it' if len(names) == 1 else 'them'} away, or choose another --out"
            )
    stale = {n: d for n, d in before.items() if n not in files and os.path.lexists(os.path.join(out_dir, n))}
    new = {name: _digest(data) for name, (data, _) in files.items()}

    def manifest(entries):
        return _MANIFEST_HEAD + "".join(f"{d}  {n}\n" for n, ds in entries.items() for d in sorted(ds))

    # First a manifest naming both runs' files: an interrupted run leaves nothing it cannot replace.
    both = {n: {*before.get(n, ()), *({new[n]} if n in new else ())} for n in {*before, *new}}
    _replace(
        os.path.join(out_dir, MANIFEST), manifest({n: ds for n, ds in both.items() if ds}).encode(), 0o666
    )
    for name, (data, mode) in files.items():
        _replace(os.path.join(out_dir, name), data, mode)
    kept = []
    for name, digests in sorted(stale.items()):
        path = os.path.join(out_dir, name)
        if _unchanged(path, digests) is not False and (digests or os.path.islink(path)):
            os.remove(path)  # ours and unchanged, or a symlink put in its place (its target stays)
        else:
            kept.append(name)
    _replace(os.path.join(out_dir, MANIFEST), manifest({n: {d} for n, d in new.items()}).encode(), 0o666)
    return kept


def _replace(path: str, data: bytes, mode: int) -> None:
    """`data` into `path` through a temporary file beside it, renamed over it when complete."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.partial-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, mode & ~umask)  # mkstemp's 0600 would become the file's mode
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
