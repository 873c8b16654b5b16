"""The prefix store in a local (or network-mounted) directory.

Publishing: the bytes go to a uniquely named temporary file in the target directory, are fsynced,
then hard-linked to the final name (``link`` fails if the name exists, so the first writer wins and
nobody's object is ever replaced), and the temporary name is removed. A writer killed at any point
leaves either nothing or a ``.tmp-*`` file that listings ignore and ``gc`` removes.
"""

from __future__ import annotations

import os
import secrets

from ..format.writer import fsync_dir
from .backend import ObjectInfo

TMP_PREFIX = ".tmp-"


class LocalBackend:
    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root

    def _abs(self, path: str) -> str:
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"bad object path {path!r}")
        return os.path.join(self.root, *path.split("/"))

    def _write_temp(self, full: str, data: bytes) -> str:
        d = os.path.dirname(full)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def create(self, path: str, data: bytes) -> bool:
        full = self._abs(path)
        if os.path.exists(full):
            return False
        tmp = self._write_temp(full, data)
        try:
            os.link(tmp, full)
            created = True
        except FileExistsError:
            created = False
        finally:
            os.unlink(tmp)
        if created:
            fsync_dir(os.path.dirname(full))
        return created

    def put(self, path: str, data: bytes) -> None:
        full = self._abs(path)
        tmp = self._write_temp(full, data)
        os.replace(tmp, full)

    def get(self, path: str, max_bytes: int | None = None) -> bytes | None:
        try:
            with open(self._abs(path), "rb") as f:
                if max_bytes is not None and os.fstat(f.fileno()).st_size > max_bytes:
                    from .errors import CorruptBlockError

                    raise CorruptBlockError(f"{path}: larger than {max_bytes} bytes")
                return f.read()
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        return os.path.isfile(self._abs(path))

    def list(self, prefix: str) -> list[ObjectInfo]:
        # walk from the deepest directory the prefix names, then filter by the full prefix
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self._abs(base) if base else self.root
        out = []
        for d, _, files in os.walk(top):
            for name in files:
                if name.startswith(TMP_PREFIX):
                    continue
                full = os.path.join(d, name)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                if not rel.startswith(prefix):
                    continue
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # removed while we walked
                    continue
                out.append(ObjectInfo(rel, st.st_size, st.st_mtime))
        return out

    def list_temporaries(self) -> list[ObjectInfo]:
        """Temporary files of writers (live or killed): for gc."""
        out = []
        for d, _, files in os.walk(self.root):
            for name in files:
                if name.startswith(TMP_PREFIX):
                    full = os.path.join(d, name)
                    try:
                        st = os.stat(full)
                    except FileNotFoundError:
                        continue
                    out.append(ObjectInfo(os.path.relpath(full, self.root).replace(os.sep, "/"), st.st_size,
                                          st.st_mtime))
        return out

    def delete(self, path: str) -> None:
        try:
            os.unlink(self._abs(path))
        except FileNotFoundError:
            pass

    def local_path(self, path: str) -> str | None:
        return self._abs(path)
