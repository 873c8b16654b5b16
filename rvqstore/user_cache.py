"""What rvqstore keeps about this machine between processes: compiled kernels and their first-use verdicts
(:mod:`rvqstore.kernel_cache`), weight hashes (:mod:`rvqstore.weights_cache`).

Each purpose has a directory of its own under ``~/.cache/rvqstore``, moved by an environment variable
(``off``, ``0``, ``none``, ``false`` or an empty value turn it off). Files are written atomically and
privately (``mkstemp``: mode 0600) and a record is believed only when it names the key it was read
for, so a damaged, foreign or half-written file is ignored (and rewritten), never trusted.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

_OFF = ("0", "off", "none", "false", "")
#: a record larger than this is not one of ours: ignored, not parsed
MAX_RECORD_BYTES = 4096


def directory(env: str, default: str) -> Path | None:
    """The directory named by the environment variable ``env``, else ``~/.cache/rvqstore/<default>``;
    None where the variable turns the cache off."""
    value = os.environ.get(env)
    if value is not None and value.strip().lower() in _OFF:
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "rvqstore" / default


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a private temporary file and a rename: readers see the old file
    or the whole new one. Raises ``OSError`` (a read-only or full disk); leaves no temporary behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_record(path: Path, key: str) -> dict | None:
    """The JSON map at ``path`` if it is one written for ``key`` (its ``"key"`` field), else None."""
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            return None
        record = json.loads(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("key") == key else None


def write_record(path: Path, key: str, fields: dict) -> None:
    """Keep ``fields`` (JSON values) under ``key`` at ``path``; raises ``OSError`` like :func:`atomic_write`."""
    atomic_write(path, json.dumps({**fields, "key": key}).encode())


__all__ = ["directory", "atomic_write", "read_record", "write_record", "MAX_RECORD_BYTES"]
