"""Writing a checkpoint file atomically: beside its destination, synced, then
renamed over it, so that an interrupted save leaves the previous file intact.

The file gets the mode an ordinary write would give it (as `open(path, "wb")`
does, which is what NumPy and Equinox do): a new file the mode the user's umask
allows (0644 under umask 022), an existing file keeps its own.
"""

import contextlib
import os
import pathlib
import secrets
import stat
from collections.abc import Iterator
from typing import Any


def _temporary(path: pathlib.Path) -> tuple[int, pathlib.Path]:
    """A new, empty file beside `path`: its descriptor and its path."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            # 0o666: the kernel applies the umask, as for any new file.
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_write(path: str | pathlib.Path) -> Iterator[Any]:
    """A binary file object whose contents replace `path` once complete."""
    path = pathlib.Path(path)
    fd, tmp = _temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            try:
                os.fchmod(f.fileno(), stat.S_IMODE(os.stat(path).st_mode))
            except FileNotFoundError:
                pass  # a new file: the umask's mode, as created
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
