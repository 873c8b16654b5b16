"""PrefixStore on a local directory: bit-exact reuse, shared blocks, partial blocks, codec and kind
checks, corruption, LRU gc, and the `rvqstore store` commands. A tiny random-weight llama keeps it fast."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_helpers import kv_cache, record_pool_sizes, tiny_model, tokens  # noqa: E402

import rvqstore  # noqa: E402
from rvqstore.compat import UnsupportedCacheError  # noqa: E402
from rvqstore.store import PrefixStore, StoreConfigError, StoreURLError, scan  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def prompts(model):
    """A 200-token shared prefix, two continuations, and their mlx-lm caches."""
    base = tokens(1, 200)
    a, b = base + tokens(2, 70), base + tokens(3, 45)
    return {"a": (a, kv_cache(model, a)), "b": (b, kv_cache(model, b))}


def files(d):
    return sorted(str(p.relative_to(d)) for p in Path(d).rglob("*") if p.is_file())


def same(c1, c2, n, start=0):
    """Decoded keys/values of two caches agree bit for bit on tokens [start, n)."""
    for x, y in zip(c1, c2):
        (k1, v1), (k2, v2) = x.keys_and_values(), y.keys_and_values()
        if not (mx.array_equal(k1[:, :, start:n], k2[:, :, start:n])
                and mx.array_equal(v1[:, :, start:n], v2[:, :, start:n])):
            return False
    return True


def test_put_then_lookup_is_bit_exact_and_prefixes_share_blocks(model, prompts, tmp_path):
    (a, ca), (b, cb) = prompts["a"], prompts["b"]
    s = PrefixStore(str(tmp_path), model=model, block_size=32, min_partial=8)
    r = s.put(a, ca)
    assert (r.stored_before, r.new_tokens, r.new_blocks) == (0, 270, 9)  # 8 full blocks + a 14-token tail
    assert s.put(a, ca).new_blocks == 0  # nothing twice
    n, caches = s.longest_prefix(a + [7, 7])
    assert n == 270 and all(c.offset == 270 for c in caches)
    assert same(caches, rvqstore.convert_prompt_cache(ca), 270)  # exactly what encoding the cache gives
    # b shares 200 tokens: 6 whole blocks, and 8 tokens of the 7th (a radix split stores them once)
    rb = s.put(b, cb)
    assert rb.stored_before == 200 and rb.new_tokens == 45
    n, caches = s.longest_prefix(b)
    # the shared 200 tokens are a's codes (b's prefill may differ in the last bits: a BLAS's sums can
    # depend on how many rows a matmul has), the rest b's
    assert n == 245 and same(caches, rvqstore.convert_prompt_cache(ca), 200)
    assert same(caches, rvqstore.convert_prompt_cache(cb), 245, start=200)
    assert s.longest_prefix(a)[0] == 270  # a is intact
    blocks = [f for f in files(tmp_path) if f.endswith(".rvq")]
    assert len(blocks) == 9 + 1 + 2  # a's blocks, the split's 8 tokens, b's 32 + 5
    # a fresh object over the same directory (a restart) finds everything
    s2 = PrefixStore(str(tmp_path), model=model, block_size=32, min_partial=8)
    assert s2.longest_prefix(a)[0] == 270 and s2.stored_prefix(b) == 245


def test_a_local_store_uses_at_most_one_thread_per_core(model, prompts, tmp_path, monkeypatch):
    """Reading and checking blocks from files is CPU work: a local store's pools take min(workers, cores,
    blocks) threads, and its reads give the same caches whatever that is."""
    (a, ca) = prompts["a"]
    from rvqstore.store import prefix_store

    monkeypatch.setattr(prefix_store.os, "cpu_count", lambda: 2)
    sizes = record_pool_sizes(monkeypatch)
    s = PrefixStore(str(tmp_path), model=model, block_size=32, workers=8)
    s.put(a, ca)  # 9 blocks
    n, two = s.longest_prefix(a)
    assert n == 270 and sizes == [2, 2]
    monkeypatch.setattr(prefix_store.os, "cpu_count", lambda: 64)
    sizes.clear()
    n, eight = PrefixStore(str(tmp_path), model=model, block_size=32, workers=8).longest_prefix(a)
    assert n == 270 and sizes == [8] and same(two, eight, 270)
    monkeypatch.setattr(prefix_store.os, "cpu_count", lambda: None)  # unknown: one thread
    sizes.clear()
    PrefixStore(str(tmp_path), model=model, block_size=32, workers=8).longest_prefix(a)
    assert sizes == [1]


def test_short_shared_runs_are_neither_split_off_nor_read(model, prompts, tmp_path):
    (a, ca), (b, cb) = prompts["a"], prompts["b"]
    s = PrefixStore(str(tmp_path), model=model, block_size=32)  # min_partial 16 > the 8 shared tokens
    s.put(a, ca)
    assert s.stored_prefix(b) == 192  # whole blocks only
    rb = s.put(b, cb)
    assert rb.stored_before == 192 and rb.new_blocks == 2  # b's own blocks from 192: no 8-token split block
    assert s.longest_prefix(b)[0] == 245
    with pytest.raises(StoreConfigError):
        PrefixStore(str(tmp_path), model=model, min_partial=0)


def test_partial_block_use_and_max_tokens(model, prompts, tmp_path):
    (a, ca) = prompts["a"]
    s = PrefixStore(str(tmp_path), model=model, block_size=64)
    s.put(a, ca)
    n, caches = s.longest_prefix(a[:150] + [1, 2, 3])  # inside the third block
    assert n == 150 and same(caches, rvqstore.convert_prompt_cache(ca), 150)
    n, caches = s.longest_prefix(a, max_tokens=len(a) - 1)  # leave one token to compute
    assert n == 256  # 13 of the 14-token tail: fewer than min_partial (16), not worth a block read
    assert s.longest_prefix(tokens(99, 50)) == (0, None)
    assert s.longest_prefix(a, min_tokens=271) == (270, None)  # shorter than a caller's own: not read
    assert s.stats.blocks_read == 3 + 4  # only the blocks each hit needed
    s8 = PrefixStore(str(tmp_path), model=model, block_size=64, min_partial=8)
    n, caches = s8.longest_prefix(a, max_tokens=len(a) - 1)
    assert n == 269 and caches[0].offset == 269


def test_rvq_caches_with_a_dense_window_and_codec_settings(model, prompts, tmp_path):
    (a, _) = prompts["a"]
    rc = rvqstore.make_prompt_cache(model, dense_window=40)
    from rvqstore.generation import prefill

    prefill(model, a, rc)
    assert rc[0].n_dense > 0
    s = PrefixStore(str(tmp_path), model=model, block_size=64)
    assert s.put(a, rc).new_tokens == 270
    n, caches = s.longest_prefix(a)
    assert n == 270
    for got, src in zip(caches, rc):  # the codes as held, and the window's tokens encoded as a flush would
        nc = src.n_coded
        gk, gv = got.keys_and_values()
        sk, sv = src.keys_and_values()
        assert mx.array_equal(gk[:, :, :nc], sk[:, :, :nc]) and mx.array_equal(gv[:, :, :nc], sv[:, :, :nc])
        codec = rvqstore.RVQCodec(32, src.codec_bits)
        assert mx.array_equal(gk[:, :, nc:], codec.decode(codec.encode(src._dense_k)))
    other = PrefixStore(str(tmp_path), model=model, bits=(2, 2), block_size=64)
    before = files(tmp_path)
    with pytest.raises(StoreConfigError, match="re-encoding"):
        other.put(a, rc)
    assert files(tmp_path) == before  # a failed put leaves the store as it was
    assert other.longest_prefix(a) == (0, None)  # another codec is another namespace
    sides, fresh = rvqstore.make_prompt_cache(model, value_bits=(2, 2)), tokens(77, 20)
    prefill(model, fresh, sides)
    with pytest.raises(StoreConfigError, match="per-side"):
        s.put(fresh, sides)
    assert files(tmp_path) == before


def test_unsupported_cache_kinds_are_refused_by_name(model, prompts, tmp_path):
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    (a, ca) = prompts["a"]
    s = PrefixStore(str(tmp_path), model=model, block_size=64)
    rot = RotatingKVCache(max_size=64)
    k, v = ca[0].state[:2] if len(ca[0].state) == 2 else (ca[0].keys, ca[0].values)
    rot.update_and_fetch(k[:, :, :100], v[:, :, :100])
    for bad, name in (([rot] + list(ca[1:]), "RotatingKVCache"), ([ArraysCache(2)] + list(ca[1:]), "ArraysCache")):
        with pytest.raises(UnsupportedCacheError, match=name):
            s.put(a, bad)
    assert files(tmp_path) == []
    with pytest.raises(StoreConfigError, match="layers"):
        s.put(a, ca[:2])


def test_another_model_finds_nothing(model, prompts, tmp_path):
    (a, ca) = prompts["a"]
    PrefixStore(str(tmp_path), model=model).put(a, ca)
    other = tiny_model(layers=2)
    assert PrefixStore(str(tmp_path), model=other).longest_prefix(a) == (0, None)


def test_a_corrupted_block_is_caught_removed_and_rewritten(model, prompts, tmp_path):
    (a, ca) = prompts["a"]
    s = PrefixStore(str(tmp_path), model=model, block_size=64)
    s.put(a, ca)
    third = next(p for p in Path(tmp_path).rglob("*.rvq") if p.parent.name == _key_of_block(s, a, 1))
    data = bytearray(third.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in a section
    third.write_bytes(bytes(data))
    n, caches = s.longest_prefix(a)
    assert n == 128 and same(caches, rvqstore.convert_prompt_cache(ca), 128)  # stops before the bad block
    assert s.stats.corrupt_blocks == 1 and not third.exists()
    assert s.put(a, ca).new_blocks == 1  # written again under the same key: its children link up again
    assert s.longest_prefix(a)[0] == 270


def _key_of_block(s, toks, i):
    from rvqstore.store.keys import chain_keys

    return chain_keys(s.ns, np.asarray(toks), 0, s.block_size)[i][2]


def test_gc_evicts_least_recently_used_and_orphans(model, prompts, tmp_path):
    (a, ca), (b, cb) = prompts["a"], prompts["b"]
    s = PrefixStore(str(tmp_path), model=model, block_size=64)
    s.put(a, ca)
    c = tokens(5, 100)
    s.put(c, kv_cache(model, c))
    s.put(b, cb)
    for p in Path(tmp_path).rglob("*"):  # everything written long ago...
        os.utime(p, (1_000_000, 1_000_000))
    assert s.longest_prefix(c)[0] == 100  # ...but c was just used
    idx = scan(s.backend)
    c_bytes = sum(x.size for x in idx.blocks.values() if x.last_used > 2_000_000)
    plan = s.gc(max_bytes=c_bytes)
    assert s.longest_prefix(c)[0] == 100
    assert s.longest_prefix(a) == (0, None) and s.longest_prefix(b) == (0, None)
    assert plan.keep_bytes == c_bytes == s.du()
    # an orphan (its parent removed behind the store's back) goes at the next gc
    s.put(a, ca)
    root_block = next(x for x in scan(s.backend).blocks.values() if x.depth == 0 and x.name.n_tokens == 64)
    s.backend.delete(root_block.path)
    plan = s.gc()
    assert len(plan.orphans) >= 1 and all(x.depth >= 0 for x in scan(s.backend).blocks.values())
    with pytest.raises(StoreConfigError):
        s.gc(max_bytes=-1)


def test_bad_arguments_raise_typed_errors(model, tmp_path):
    with pytest.raises(StoreURLError):
        PrefixStore("ftp://host/x", model=model)
    with pytest.raises(StoreConfigError):
        PrefixStore(str(tmp_path), model=model, block_size=0)
    s = PrefixStore(str(tmp_path), model=model)
    with pytest.raises(StoreConfigError):
        s.longest_prefix([1, -5, 3])
    with pytest.raises(StoreConfigError):
        s.longest_prefix([[1, 2]])
    with pytest.raises(rvqstore.CodecConfigError):
        PrefixStore(str(tmp_path), model=model, bits=(9, 9))
    with pytest.raises(StoreConfigError, match="fingerprint"):
        PrefixStore(str(tmp_path))
    with pytest.raises(StoreConfigError, match="mode"):
        s.longest_prefix([1, 2, 3], mode="fast")
    assert os.listdir(tmp_path) == []  # nothing was written by any of these


def test_store_commands(model, prompts, tmp_path, capsys):
    from rvqstore import cli

    (a, ca) = prompts["a"]
    s = PrefixStore(str(tmp_path), model=model, block_size=64)
    s.put(a, ca)
    assert cli.main(["store", "ls", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    (ns,) = d["namespaces"]
    assert ns["blocks"] == 5 and ns["tokens"] == 270 and ns["longest_prefix"] == 270 and ns["block_size"] == 64
    assert ns["model"]["num_layers"] == 3 and ns["bytes"] == s.du()
    assert cli.main(["store", "du", str(tmp_path)]) == 0 and f"{s.du():,}" in capsys.readouterr().out
    assert cli.main(["store", "verify", str(tmp_path)]) == 0 and "OK" in capsys.readouterr().out
    victim = sorted(Path(tmp_path).rglob("*.rvq"))[0]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 1
    victim.write_bytes(bytes(data))
    assert cli.main(["store", "verify", str(tmp_path)]) == 1
    assert "BAD" in capsys.readouterr().out
    assert cli.main(["store", "verify", "--repair", str(tmp_path)]) == 1 and not victim.exists()
    capsys.readouterr()
    assert cli.main(["store", "gc", "--max-bytes", "0", str(tmp_path)]) == 0
    assert "removed" in capsys.readouterr().out and s.du() == 0
    assert cli.main(["store", "ls", "ftp://x"]) == 1
    assert "StoreURLError" in capsys.readouterr().err
