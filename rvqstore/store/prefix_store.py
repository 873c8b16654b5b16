"""``PrefixStore``: KV caches of many prompts, shared by prefix, in a directory or an S3 bucket.

    store = PrefixStore("s3://bucket/caches", model=model, tokenizer=tokenizer)
    store.put(tokens, cache)                  # stores only the blocks not stored yet
    n, caches = store.longest_prefix(tokens)  # RVQKVCaches holding tokens[:n] (None if n == 0)

Blocks are content-addressed (``keys``), encoded as ``.rvq`` files (``blocks``), published
atomically by the backend (``local`` / ``s3``); the index is the store's own listing (``index``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from ..codec import DEFAULT_BITS, RVQCodec, _parse_bits
from ..format import open_rvq
from ..errors import RVQError
from .backend import Backend, open_backend
from .blocks import (BlockData, LayerRun, assemble, decode_block, encode_block, encode_range, open_block_bytes,
                     read_block_tokens)
from .errors import CorruptBlockError, StoreConfigError
from .index import GCPlan, run_gc, scan
from .keys import (block_key, block_path, chain_keys, children_prefix, namespace_id, namespace_info,
                   namespace_path, parse_block_path, used_path)

log = logging.getLogger("rvqstore.store")

# Tokens per block. Sharing is token-granular anyway (partial use, radix splits), so the block size
# trades each block's fixed cost (a ~31 KB header for SmolLM2's 30 layers; zstd on bigger sections)
# against the unused part of a block read for a partial hit.
DEFAULT_BLOCK_SIZE = 256
DEFAULT_MIN_PARTIAL = 16
# A block object larger than this is not downloaded (a planted or mangled object must not cost a huge
# allocation): 1 MiB per token is ~8x a 4+2-bit token of an 80-layer, 8-KV-head, dim-128 model.
MAX_HEADER_BYTES = 1 << 20
MAX_BYTES_PER_TOKEN = 1 << 20


@dataclass(frozen=True)
class BlockRef:
    """A stored block on a lookup's path; it covers tokens [start, end) of the query. A partial ref
    (``n_block > end - start``) uses only the first ``end - start`` of the block's tokens."""

    start: int
    end: int
    parent: str
    key: str
    n_block: int
    first: int  # the block's first token id (part of its object name)

    @property
    def partial(self) -> bool:
        return self.n_block > self.end - self.start


@dataclass
class PutResult:
    stored_before: int  # tokens of this prompt already in the store
    new_tokens: int  # tokens this call stored
    new_blocks: int  # blocks this call published (blocks another writer published first are not counted)
    new_bytes: int


@dataclass
class StoreStats:
    """Counters of one PrefixStore object (this process only)."""

    lookups: int = 0
    hit_tokens: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    corrupt_blocks: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    errors: list[str] = field(default_factory=list)


class PrefixStore:
    """A shared store of KV-cache prefixes for one model and codec setting.

    Args:
        url: a directory (``/path``, ``file:///path``) or ``s3://bucket/prefix``.
        model, tokenizer: the model whose caches are stored; its fingerprint names the namespace, so
            another model's blocks are never found. (Or give ``fingerprint`` and ``n_layers``.)
        bits, seed, residual: the codec of stored blocks (part of the namespace).
        block_size: tokens per block (part of the namespace). Smaller blocks share more of
            prompts that diverge mid-block, at more objects and per-block header bytes.
        backend_options: for S3 (``endpoint``, ``region``, credentials).
        workers: parallel reads/writes. A local directory uses at most one per CPU core: reading and
            checking a block from a file is CPU work, and more threads than cores only contend (2 cores,
            reads of 1k / 4k / 16k tokens 1.12x / 1.14x / 1.18x faster on 2 threads than on 8,
            tools/results/store-workers-cpu.md). Object stores use them all (their requests wait on the
            network).
        min_partial: the fewest tokens of a stored block worth using in part (a lookup) or splitting
            off (a put): below it, reading a whole block or paying a block's header costs more than
            computing or storing those tokens again.
    """

    def __init__(self, url: str, *, model: Any = None, tokenizer: Any = None, fingerprint: dict | None = None,
                 n_layers: int | None = None, bits: tuple[int, int] | int = DEFAULT_BITS, seed: int = 0,
                 residual: str = "conditional", block_size: int = DEFAULT_BLOCK_SIZE, workers: int = 8,
                 min_partial: int = DEFAULT_MIN_PARTIAL,
                 backend: Backend | None = None, **backend_options: Any):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or not 1 <= block_size <= 65536:
            raise StoreConfigError(f"block_size must be an integer in [1, 65536], got {block_size!r}")
        if not isinstance(min_partial, int) or isinstance(min_partial, bool) or min_partial < 1:
            raise StoreConfigError(f"min_partial must be an integer >= 1, got {min_partial!r}")
        self.min_partial = min_partial
        if not isinstance(workers, int) or workers < 1:
            raise StoreConfigError(f"workers must be an integer >= 1, got {workers!r}")
        self.bits = _parse_bits(bits)
        RVQCodec(64, self.bits, seed, residual)  # bad codec settings fail here
        self.seed, self.residual = seed, residual if self.bits[1] else "conditional"
        self.block_size = block_size
        if model is not None:
            from ..prompt_cache import _fingerprint

            fingerprint = _fingerprint(model, tokenizer)
            n_layers = len(model.layers)
        if not isinstance(fingerprint, dict) or not fingerprint:
            raise StoreConfigError("a PrefixStore needs the model (or its fingerprint): blocks are namespaced by it")
        self.fingerprint = fingerprint
        self.n_layers = n_layers
        self.info = namespace_info(fingerprint, bits=self.bits, seed=seed, residual=self.residual,
                                   block_size=block_size)
        self.ns = namespace_id(self.info)
        self.backend = backend if backend is not None else open_backend(url, **backend_options)
        self.url = self.backend.url
        self.workers = workers
        self.stats = StoreStats()
        self._quantizers: dict[int, dict] = {}  # head dim -> quantizer header map
        self._ns_published = False
        self._token_memo: dict[str, np.ndarray] = {}  # block key -> its token ids (immutable)
        self._lock = threading.Lock()

    # ---- lookups ------------------------------------------------------------------------------------
    def _settings(self) -> tuple:
        return (self.bits, self.seed, self.residual)

    def _quantizer(self, dim: int) -> dict:
        if dim not in self._quantizers:
            self._quantizers[dim] = RVQCodec(dim, self.bits, self.seed, self.residual).to_header()
        return self._quantizers[dim]

    @property
    def _local(self) -> bool:
        """Whether the backend is a local directory (files read in place)."""
        return self.backend.local_path("x") is not None

    def _threads(self, items: int) -> int:
        """Threads for ``items`` block reads or writes: ``workers``, capped at the CPU cores for a local
        directory (its work is CPU-bound) and at the items."""
        n = self.workers
        if self._local:
            n = min(n, os.cpu_count() or 1)
        return max(1, min(n, items))

    def _exists_many(self, paths: list[str]) -> list[bool]:
        if len(paths) <= 1 or self._local:
            return [self.backend.exists(p) for p in paths]
        with ThreadPoolExecutor(self.workers) as ex:
            return list(ex.map(self.backend.exists, paths))

    def _walk(self, tokens: np.ndarray) -> list[BlockRef]:
        """The stored blocks that spell the longest prefix of ``tokens``: runs of full blocks (their
        keys are known from the tokens: existence checks, several at a time), and where a run stops,
        one listing of that block's children for a shorter block (a stored prompt's tail) to continue
        from."""
        path: list[BlockRef] = []
        parent, pos, n = self.ns, 0, len(tokens)
        batch = max(4, self.workers * 2)
        while pos < n:
            full = chain_keys(parent, tokens, pos, self.block_size)
            stopped = False
            for i in range(0, len(full), batch):
                chunk = full[i:i + batch]
                found = self._exists_many([block_path(self.ns, (parent if j == 0 and i == 0 else full[i + j - 1][2]),
                                                      k, self.block_size, tokens[s0])
                                           for j, (s0, _, k) in enumerate(chunk)])
                for (s, e, k), ok in zip(chunk, found):
                    if not ok:
                        stopped = True
                        break
                    path.append(BlockRef(s, e, parent, k, e - s, int(tokens[s])))
                    parent, pos = k, e
                if stopped:
                    break
            if pos >= n:
                break
            # a shorter child (a tail) that continues the prefix
            children = [c for c in (parse_block_path(o.path) for o in self.backend.list(children_prefix(self.ns, parent)))
                        if c is not None]
            best = None
            for name in sorted(children, key=lambda t: -t.n_tokens):
                if (name.n_tokens < self.block_size and pos + name.n_tokens <= n and name.first == tokens[pos]
                        and block_key(parent, tokens[pos:pos + name.n_tokens]) == name.key):
                    best = name
                    break
            if best is None:
                # no child is a prefix of the rest: the child sharing the most leading tokens, used in part
                part = self._best_partial(children, tokens[pos:])
                if part is not None:
                    name, m = part
                    path.append(BlockRef(pos, pos + m, parent, name.key, name.n_tokens, name.first))
                break
            path.append(BlockRef(pos, pos + best.n_tokens, parent, best.key, best.n_tokens, best.first))
            parent, pos = best.key, pos + best.n_tokens
        return path

    def _best_partial(self, children, rest: np.ndarray):
        """``(child, m)``: the child whose token ids share the longest run ``m >= 1`` with ``rest``
        (its token ids are read with a ranged read of its header and token section, once per
        process: a block's content never changes), or None."""
        best, best_m = None, 0
        for name in children:
            if not len(rest) or name.first != rest[0] or name.n_tokens <= best_m:
                continue
            ids = self._block_tokens(name)
            if ids is None:
                continue
            from ..prompt_cache import common_prefix_length

            m = min(common_prefix_length(ids, rest), name.n_tokens)
            if m > best_m:
                best, best_m = name, m
        return (best, best_m) if best is not None and best_m >= self.min_partial else None

    def _block_tokens(self, name) -> np.ndarray | None:
        with self._lock:
            hit = self._token_memo.get(name.key)
        if hit is not None:
            return hit
        try:
            ids = read_block_tokens(self.backend, name.path)
        except (RVQError, OSError) as e:
            log.warning("prefix store %s: cannot read the token ids of %s: %s", self.url, name.path, e)
            return None
        if ids is None or len(ids) != name.n_tokens or block_key(name.parent, ids) != name.key:
            return None  # gone, or not the block its name says (verify/lookup will deal with it)
        with self._lock:
            if len(self._token_memo) > 4096:
                self._token_memo.clear()
            self._token_memo[name.key] = ids
        return ids

    def stored_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` the store holds (existence checks only, no block read)."""
        toks = _as_tokens(tokens)
        refs = self._walk(toks)
        return refs[-1].end if refs else 0

    def _read_block(self, ref: BlockRef, tokens: np.ndarray) -> BlockData:
        p = block_path(self.ns, ref.parent, ref.key, ref.n_block, ref.first)
        expect = tokens[ref.start:ref.end]
        if ref.partial:  # the block's own ids, authenticated by its key when the walk read them
            with self._lock:
                expect = self._token_memo.get(ref.key)
            if expect is None:
                raise _Missing(p)
        local = self.backend.local_path(p)
        if local is not None:
            try:
                f = open_rvq(local)
            except FileNotFoundError:
                raise _Missing(p) from None
            except RVQError as e:
                raise CorruptBlockError(f"block {ref.key}: {e}") from None
            size = f.file_length
        else:
            data = self.backend.get(p, max_bytes=MAX_HEADER_BYTES + ref.n_block * MAX_BYTES_PER_TOKEN)
            if data is None:
                raise _Missing(p)
            size = len(data)
            try:
                f = open_block_bytes(data, p)
            except RVQError as e:
                raise CorruptBlockError(f"block {ref.key}: {e}") from None
        with f:
            dim = f.layers[0].head_dim if f.layers else 0
            out = decode_block(f, key=ref.key, parent=ref.parent, tokens=expect,
                               quantizer=self._quantizer(dim), n_layers=self.n_layers)
        if ref.partial:
            m = ref.end - ref.start
            out = BlockData([LayerRun(r.keys.slice(0, m), r.values.slice(0, m), r.dtype, r.head_dim)
                             for r in out.layers], m)
        # evaluate in this thread: MLX streams are per thread, the caller's thread cannot run our ops
        mx.eval([a for r in out.layers for p in (r.keys, r.values) for a in (p.scales, p.codes1, p.codes2)
                 if a is not None])
        with self._lock:
            self.stats.blocks_read += 1
            self.stats.bytes_read += size
        return out

    def longest_prefix(self, tokens: Sequence[int], *, mode: str = "packed", max_tokens: int | None = None,
                       min_tokens: int = 1, use_kernels: bool = True) -> tuple[int, list | None]:
        """``(n, caches)``: the longest stored prefix ``tokens[:n]`` (whole blocks) and one
        :class:`RVQKVCache` per layer holding it; ``(0, None)`` when nothing is stored.

        Only the blocks of that prefix are read, all checked (checksums, key, parent, token ids,
        codec). A block that fails a check is removed from the store (it would fail every reader;
        the next ``put`` of that prefix writes it again) and the prefix ends before it; a block that
        vanished (another process's ``gc``) ends it too. ``max_tokens`` caps ``n`` (e.g. ``len(tokens)
        - 1`` to leave a token for the model to compute); a prefix shorter than ``min_tokens`` (e.g.
        one a caller already holds in memory) is not read: ``(n, None)``.
        """
        if mode not in ("packed", "resident"):
            raise StoreConfigError(f"mode must be 'packed' or 'resident', got {mode!r}")
        toks = _as_tokens(tokens)
        if max_tokens is not None:
            toks = toks[:max(0, max_tokens)]
        self.stats.lookups += 1
        refs = self._walk(toks)
        if not refs or refs[-1].end < min_tokens:
            return (refs[-1].end if refs else 0), None
        with ThreadPoolExecutor(self._threads(len(refs))) as ex:
            futs = [ex.submit(self._read_block, r, toks) for r in refs]
            blocks: list[BlockData] = []
            for r, fut in zip(refs, futs):
                try:
                    blocks.append(fut.result())
                except _Missing:
                    break
                except CorruptBlockError as e:
                    self._quarantine(r, e)
                    break
            for fut in futs:  # let the rest finish (their results are dropped)
                fut.cancel()
        blocks = _consistent_prefix(blocks, refs, self)
        if not blocks:
            return 0, None
        n = refs[len(blocks) - 1].end
        caches = assemble(blocks, self._quantizer(blocks[0].layers[0].head_dim), mode=mode, use_kernels=use_kernels)
        self._mark_used(refs[len(blocks) - 1].key)
        self.stats.hit_tokens += n
        return n, caches

    def _quarantine(self, ref: BlockRef, err: Exception) -> None:
        log.warning("prefix store %s: removing a block that fails its checks: %s", self.url, err)
        with self._lock:
            self.stats.corrupt_blocks += 1
            self.stats.errors.append(str(err))
        self.backend.delete(block_path(self.ns, ref.parent, ref.key, ref.n_block, ref.first))

    def _mark_used(self, key: str) -> None:
        try:
            self.backend.put(used_path(self.ns, key), b"")
        except OSError as e:  # a read-only store still serves lookups; LRU order just ages
            log.warning("prefix store %s: cannot record a use: %s", self.url, e)

    # ---- writes -------------------------------------------------------------------------------------
    def _publish_namespace(self) -> None:
        if not self._ns_published:
            self.backend.create(namespace_path(self.ns), json.dumps(self.info, indent=1, sort_keys=True).encode())
            self._ns_published = True

    def put(self, tokens: Sequence[int], cache: Sequence[Any]) -> PutResult:
        """Store the blocks of ``tokens`` (as far as every layer of ``cache`` holds them) that the
        store lacks. ``cache``: one entry per layer, :class:`RVQKVCache` with this store's codec
        settings or mlx-lm ``KVCache`` / ``QuantizedKVCache`` (encoded here). The last block may be
        shorter than ``block_size`` (the prompt's tail); a later, longer prompt continues from it."""
        toks = _as_tokens(tokens)
        cache = list(cache)
        if self.n_layers is not None and len(cache) != self.n_layers:
            raise StoreConfigError(f"the cache has {len(cache)} layers, the store's model {self.n_layers}")
        if not cache:
            raise StoreConfigError("the cache has no layers")
        held = min(_held(c, i) for i, c in enumerate(cache))
        n = min(len(toks), held)
        refs = self._walk(toks[:n])
        if refs and refs[-1].partial:
            # the prompt leaves a stored block midway: store the shared part as a short block of its
            # own and branch there, so later prompts with this prefix share it (a radix split)
            refs = refs[:-1] + [BlockRef(refs[-1].start, refs[-1].end, refs[-1].parent, "", 0, 0)]
            have, parent = refs[-1].start, refs[-1].parent
            split = refs[-1].end
            if split >= n:  # the whole prompt lies inside stored blocks
                return PutResult(split, 0, 0, 0)
        else:
            have = refs[-1].end if refs else 0
            parent = refs[-1].key if refs else self.ns
            split = None
            if have >= n:
                return PutResult(have, 0, 0, 0)
        runs = encode_range(cache, have, n, self._settings())  # validates kinds and settings first
        self._publish_namespace()
        plan = []
        bounds = [have] + ([split] if split is not None and split < n else []) + list(
            range((split if split is not None else have) + self.block_size, n, self.block_size)) + [n]
        for s, e in zip(bounds[:-1], bounds[1:]):
            key = block_key(parent, toks[s:e])
            plan.append((s, e, parent, key))
            parent = key
        quantizer = self._quantizer(runs[0].head_dim)

        def write(item) -> int:
            s, e, par, key = item
            data = encode_block(runs, s - have, e - have, tokens=toks[s:e], quantizer=quantizer,
                                fingerprint=self.fingerprint,
                                metadata={"store.key": key, "store.parent": par, "store.start": str(s)})
            return len(data) if self.backend.create(block_path(self.ns, par, key, e - s, toks[s]), data) else 0

        # the arrays are evaluated once here so the writer threads only serialize them
        mx.eval([a for r in runs for p in (r.keys, r.values) for a in (p.scales, p.codes1, p.codes2) if a is not None])
        if len(plan) == 1:
            sizes = [write(plan[0])]
        else:
            with ThreadPoolExecutor(self._threads(len(plan))) as ex:
                sizes = list(ex.map(write, plan))
        new = [s for s in sizes if s]
        with self._lock:
            self.stats.blocks_written += len(new)
            self.stats.bytes_written += sum(new)
        before = split if split is not None else have
        return PutResult(before, n - before, len(new), sum(new))

    # ---- maintenance --------------------------------------------------------------------------------
    def gc(self, max_bytes: int | None = None) -> GCPlan:
        """Remove orphaned blocks, then least recently used ones until the store's blocks take at most
        ``max_bytes`` (every namespace of the store counts)."""
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise StoreConfigError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        return run_gc(self.backend, max_bytes)

    def du(self) -> int:
        """Bytes of this namespace's blocks."""
        return scan(self.backend, self.ns).block_bytes


class _Missing(Exception):
    """A block listed a moment ago is gone (removed by gc)."""


def _as_tokens(tokens: Sequence[int]) -> np.ndarray:
    a = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise StoreConfigError("tokens must be a flat sequence of integer token ids")
    a = a.astype(np.int64)
    if a.size and (a.min() < 0 or a.max() >= 2**31):
        raise StoreConfigError("token ids must be in [0, 2^31)")
    return a


def _held(c: Any, i: int) -> int:
    off = getattr(c, "offset", None)
    if not isinstance(off, int):
        from ..compat import UnsupportedCacheError

        raise UnsupportedCacheError(f"layer {i} is a {type(c).__name__}, which the prefix store cannot hold")
    return off


def _consistent_prefix(blocks: list[BlockData], refs: list[BlockRef], store: PrefixStore) -> list[BlockData]:
    """Blocks up to the first whose layer geometry differs from the first block's (a bad block)."""
    if not blocks:
        return blocks

    def geo(b: BlockData):
        return [(r.keys.scales.shape[:2], r.head_dim, r.dtype) for r in b.layers]

    g0 = geo(blocks[0])
    for i, b in enumerate(blocks):
        if geo(b) != g0:
            store._quarantine(refs[i], CorruptBlockError(f"block {refs[i].key}: layer geometry differs from the prefix"))
            return blocks[:i]
    return blocks
