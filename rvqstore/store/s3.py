"""The prefix store on S3 or any S3-compatible object store, through obstore.

Client chosen by measurement (``tools/bench_s3_clients.py``, ``tools/results/s3-clients.md``): against
moto on loopback obstore's GET, ranged GET, HEAD and LIST took 0.3-0.5x boto3's time and 0.15-0.3x
s3fs's, and it expresses the conditional create the store's atomic publish rests on
(``put(mode="create")``: ``If-None-Match: *``); s3fs has none (check-then-write races).

Publishing is one PUT with ``If-None-Match: *``: S3 makes a single PUT visible all at once or not
at all, and the condition keeps the first writer's object, so a reader's ranged reads of one object
never straddle two versions. A writer killed mid-PUT leaves nothing.

Configuration: ``s3://bucket/prefix``; ``endpoint`` (or ``AWS_ENDPOINT_URL``), ``region`` (or
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, default us-east-1), ``access_key_id`` / ``secret_access_key``
(or the ``AWS_*`` variables). Plain-HTTP endpoints are allowed (a server on loopback).
"""

from __future__ import annotations

import os

from .backend import ObjectInfo
from .errors import BackendUnavailableError, CorruptBlockError, StoreURLError


class S3Backend:
    def __init__(self, url: str, *, endpoint: str | None = None, region: str | None = None,
                 access_key_id: str | None = None, secret_access_key: str | None = None):
        try:
            from obstore.store import S3Store
        except ImportError:
            raise BackendUnavailableError("s3:// stores need obstore: pip install 'rvqstore[s3]'") from None
        rest = url[len("s3://"):]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StoreURLError(f"{url}: no bucket name")
        self.url = url
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        kw = {"region": region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
        key = access_key_id or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY")
        if key and secret:
            kw.update(access_key_id=key, secret_access_key=secret)
        if endpoint:
            kw.update(endpoint=endpoint, virtual_hosted_style_request=False)
        client = {"allow_http": True} if endpoint and endpoint.startswith("http://") else {}
        self._store = S3Store(bucket, prefix=self.prefix or None, client_options=client, **kw)

    def create(self, path: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            obstore.put(self._store, path, data, mode="create", use_multipart=False)
            return True
        except (AlreadyExistsError, PreconditionError, FileExistsError):
            return False

    def put(self, path: str, data: bytes) -> None:
        import obstore

        obstore.put(self._store, path, data, use_multipart=False)

    def get(self, path: str, max_bytes: int | None = None) -> bytes | None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            r = obstore.get(self._store, path)
            if max_bytes is not None and int(r.meta["size"]) > max_bytes:  # checked before the body is read
                raise ObjectTooLargeError(f"{self.url}/{path}: {r.meta['size']} bytes, more than {max_bytes}")
            return bytes(r.bytes())
        except (NotFoundError, FileNotFoundError):
            return None

    def get_range(self, path: str, start: int, end: int) -> bytes:
        import obstore

        return bytes(obstore.get_range(self._store, path, start=start, end=end))

    def range_source(self, path: str) -> "_S3Range | None":
        """A range source (``size``, ``read(offset, length)``) over one object, pinned to its ETag: a
        read after the object changed fails instead of mixing two versions. None if it is gone."""
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            meta = obstore.head(self._store, path)
        except (NotFoundError, FileNotFoundError):
            return None
        return _S3Range(self, path, int(meta["size"]), meta.get("e_tag"))

    def exists(self, path: str) -> bool:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            obstore.head(self._store, path)
            return True
        except (NotFoundError, FileNotFoundError):
            return False

    def list(self, prefix: str) -> list[ObjectInfo]:
        import obstore

        out = []
        for batch in obstore.list(self._store, prefix or None):
            for o in batch:
                out.append(ObjectInfo(o["path"], int(o["size"]), o["last_modified"].timestamp()))
        return out

    def delete(self, path: str) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            obstore.delete(self._store, path)
        except (NotFoundError, FileNotFoundError):
            pass

    def local_path(self, path: str) -> str | None:
        return None


class ObjectTooLargeError(CorruptBlockError):
    """An object is far larger than any block of its name can be (never downloaded)."""


class _S3Range:
    def __init__(self, backend: S3Backend, path: str, size: int, etag: str | None):
        self._b, self.name, self.size, self._etag = backend, path, size, etag
        self.bytes_read = 0

    def read(self, offset: int, length: int) -> bytes:
        import obstore

        if length <= 0 or offset >= self.size:
            return b""
        end = min(self.size, offset + length)
        opts = {"range": (offset, end)}
        if self._etag:
            opts["if_match"] = self._etag
        data = bytes(obstore.get(self._b._store, self.name, options=opts).bytes())
        self.bytes_read += len(data)
        return data
