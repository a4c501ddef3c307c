"""Files: where lookupdec keeps its caches, and the one way it writes a file.

Every file lookupdec writes (an edited config and its backup, the rolling cache, a pass-cost profile, an HTML
trace, a reassembled model file) goes through :func:`atomic_write`: a temporary file in the same folder, flushed
and fsynced, then ``os.replace`` onto the target. Readers see the old file or the whole new one, never half of
one, and a failure or Ctrl-C at any point leaves the target as it was and no temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
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


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, binary: bool = False, backup: bool = False) -> Iterator[IO]:
    """``with atomic_write(path) as f: f.write(...)`` replaces ``path`` only when the block ends without error.

    The temporary file lives in ``path``'s folder, so ``os.replace`` is a rename on one filesystem (atomic), never a
    copy; its data is fsynced before the rename, or a crash could leave an empty file under the real name. The new
    file keeps the mode of the file it replaces, else gets the mode a plain ``open`` would give it: the temporary
    file is created 0o666 less the umask, which the kernel applies (``mkstemp`` would make it private, and reading
    the umask means setting it, which races other threads). ``backup``: the old file is first copied, atomically
    too, to ``path.bak``. Text is written as UTF-8 with newlines untranslated. The folder must exist.
    """
    path = Path(path)
    folder = path.parent
    temps: list[str] = []

    def temp() -> str:
        while True:
            name = os.path.join(folder, f".{path.name}.{secrets.token_hex(4)}.tmp")
            try:
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                break
            except FileExistsError:
                continue
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
        if path.exists():
            shutil.copymode(path, new)
        os.replace(new, path)
    finally:
        for name in temps:
            with contextlib.suppress(FileNotFoundError):
                os.remove(name)
