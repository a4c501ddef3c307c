"""Files: where lookupdec keeps its caches, and the one way it writes a file.

Every file lookupdec writes (an edited config and its backup, the rolling cache, a pass-cost profile, an HTML
trace, a reassembled model file) goes through :func:`atomic_write`: a temporary file in the same folder, flushed
and fsynced, then ``os.replace`` onto the target. Readers see the old file or the whole new one, never half of
one, and a failure or Ctrl-C at any point leaves the target as it was and no temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def cache_dir() -> Path:
    """lookupdec's cache folder: $LOOKUPDEC_CACHE_DIR, else $XDG_CACHE_HOME/lookupdec, else ~/.cache/lookupdec.

    Empty variables count as unset (as the XDG spec asks). The folder is not created here.
    """
    explicit = os.environ.get("LOOKUPDEC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "lookupdec"
    return Path.home() / ".cache" / "lookupdec"


def _umask() -> int:
    # os.umask can only be read by setting it; set it straight back (a few microseconds, once per write).
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, binary: bool = False, backup: bool = False) -> Iterator[IO]:
    """``with atomic_write(path) as f: f.write(...)`` replaces ``path`` only when the block ends without error.

    The temporary file lives in ``path``'s folder, so ``os.replace`` is a rename on one filesystem (atomic), never a
    copy; its data is fsynced before the rename, or a crash could leave an empty file under the real name. The new
    file keeps the mode of the file it replaces, else gets the mode a plain ``open`` would give it (``mkstemp``
    alone would make it private). ``backup``: the old file is first copied, atomically too, to ``path.bak``.
    Text is written as UTF-8 with newlines untranslated. The folder must exist.
    """
    path = Path(path)
    folder = path.parent
    temps: list[str] = []

    def temp() -> str:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
        temps.append(name)
        return name

    try:
        if backup and path.exists():
            bak = temp()
            shutil.copy2(path, bak)
            os.replace(bak, path.with_name(path.name + ".bak"))
        new = temp()
        with open(new, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8", "newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(new, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask())
        os.replace(new, path)
    finally:
        for name in temps:
            with contextlib.suppress(FileNotFoundError):
                os.remove(name)
