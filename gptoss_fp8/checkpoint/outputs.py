"""Files the user names for us to write (reports, logits dumps, plots, reference files).

Two steps, so that a bad path is one line before any long work rather than a traceback after it:

- ``check_output_path(path, overwrite=..., forbidden=..., option=...)`` runs first. It refuses a
  path inside a checkpoint being read or written (``--report SRC/config.json`` would replace the
  source's config), an existing directory or non-regular file (``/dev/null``, a FIFO), an existing
  file unless ``overwrite``, and a parent that cannot become a writable directory (a parent that is
  a file, or not writable). A missing parent directory is fine: it is created when writing.
- ``write_atomic(path, data, overwrite=...)`` or ``with atomic_output(path, overwrite=...) as tmp:``
  writes. The data goes to a temporary file with a unique name beside ``path``, created exclusively
  (``O_CREAT | O_EXCL | O_NOFOLLOW``: never an existing file, never through a planted symlink),
  fsync'ed, then moved into place: ``os.replace`` when ``overwrite``, else a hard link that fails if
  ``path`` appeared meanwhile. A reader sees the old file or the whole new one, never a part; on
  any failure (Ctrl-C included) the temporary file is removed.

Errors are ``GptOssFp8Error`` with one line naming the option and the path.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gptoss_fp8.errors import GptOssFp8Error

_OVERWRITE_HINT = "pass --overwrite-outputs to replace it, or choose another name"


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _nearest_existing(path: Path) -> Path:
    p = path
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def check_output_path(path: str | Path, *, overwrite: bool = False, forbidden: Iterable[str | Path] = (),
                      option: str = "output") -> Path:
    """Check that ``path`` may be written (see the module docstring); return it as a ``Path``.

    ``forbidden``: directories (checkpoints being read or written) and files (inputs) that the
    output must not be, or be inside; symlinks are resolved on both sides. ``option`` names the
    path in messages (e.g. ``"--report"``). Nothing is created."""
    path = Path(path)
    where = f"{option} {path}"
    if path.name in ("", ".", ".."):
        raise GptOssFp8Error(f"{where}: not a file name; give a file path")
    real = path.resolve()
    for f in forbidden:
        root = Path(f).resolve()
        if _inside(real, root):
            what = "is the input file" if root.is_file() else "is" if real == root else "is inside"
            raise GptOssFp8Error(f"{where}: {what} {f}, which this command reads or writes; write it elsewhere")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:  # e.g. a parent component is a file (ENOTDIR), or not searchable
        raise GptOssFp8Error(f"{where}: cannot be written ({e.strerror}); choose another path") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise GptOssFp8Error(f"{where}: is a directory; give a file path")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise GptOssFp8Error(f"{where}: exists and is not a regular file; choose another path")
        if not overwrite:
            raise GptOssFp8Error(f"{where}: already exists; {_OVERWRITE_HINT}")
    parent = _nearest_existing(path.parent)
    if not parent.is_dir():
        raise GptOssFp8Error(f"{where}: {parent} is not a directory; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise GptOssFp8Error(f"{where}: directory {parent} is not writable; choose another path")
    return path


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, empty file beside ``path`` with a unique name, opened for writing; keeps the suffix
    (matplotlib picks the image format from it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.stem}.tmp-{secrets.token_hex(6)}{path.suffix}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise GptOssFp8Error(f"{path}: cannot find a free temporary name beside it")


def _commit(tmp: Path, path: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)  # replaces a symlink at path itself, never its target
        return
    try:
        os.link(tmp, path)  # fails if path exists: no clobbering, even racing
    except FileExistsError:
        raise GptOssFp8Error(f"{path}: appeared while this command ran; not replaced ({_OVERWRITE_HINT})") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
            raise
        # a file system without hard links: check, then replace (a narrow race instead of none)
        if os.path.lexists(path):
            raise GptOssFp8Error(f"{path}: appeared while this command ran; not replaced ({_OVERWRITE_HINT})") from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename itself is atomic
    finally:
        os.close(fd)


def _unlink_quietly(p: Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def _write_error(path: Path, e: OSError) -> GptOssFp8Error:
    hint = "free space and rerun" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "choose another path"
    return GptOssFp8Error(f"cannot write {path}: {e.strerror or e}; {hint}")


@contextmanager
def atomic_output(path: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """``with atomic_output(path) as tmp: writer(tmp)``: the body writes the file ``tmp`` (a fresh,
    empty file created exclusively beside ``path``), which becomes ``path`` when the body returns;
    if it raises, ``tmp`` is removed and ``path`` is untouched. Missing parent directories are
    created."""
    path = Path(path)
    tmp = None
    try:  # from the temporary file's creation on, whatever stops us (a Ctrl-C too) removes it
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temp(path)
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)  # 0o666 less the umask: what a new file gets
        finally:
            os.close(fd)
        yield tmp
        with open(tmp, "rb+") as f:  # the body may have written through its own handle: flush it to disk
            os.fchmod(f.fileno(), mode)  # a writer that recreated the file (safetensors: 0o600) gets the usual mode
            os.fsync(f.fileno())
        _commit(tmp, path, overwrite)
    except OSError as e:
        if tmp is not None:
            _unlink_quietly(tmp)
        raise _write_error(path, e) from None
    except BaseException:
        if tmp is not None:
            _unlink_quietly(tmp)
        raise
    _fsync_dir(path.parent)


def write_atomic(path: str | Path, data: bytes | str, *, overwrite: bool = False) -> Path:
    """Write ``data`` (``str`` is encoded as UTF-8) to ``path`` atomically (see the module
    docstring); refuse to replace an existing file unless ``overwrite``. Returns ``path``."""
    payload = data.encode() if isinstance(data, str) else data
    with atomic_output(path, overwrite=overwrite) as tmp, open(tmp, "wb") as f:
        f.write(payload)
    return Path(path)
