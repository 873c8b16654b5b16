"""PrefixStore on S3, against a real S3-compatible server (moto's) that the tests start on loopback:
writer processes racing on shared prefixes, a writer killed mid-put, a corrupted object, eviction
under a budget, and a restart that finds everything again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from store_helpers import S3_OPTS, kv_cache, record_pool_sizes, s3_client, start_moto, tiny_model, tokens  # noqa: E402
from subprocess_env import python_path  # noqa: E402

pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
pytest.importorskip("moto", reason="moto[server] is not installed")

from rvqstore.store import PrefixStore, scan  # noqa: E402
from rvqstore.store.inspection import verify_store  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def endpoint():
    server, ep = start_moto()
    yield ep
    server.stop()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def url():
    return f"s3://rvq-test/{uuid.uuid4().hex[:8]}"


def store(url, endpoint, model, **kw):
    return PrefixStore(url, model=model, block_size=BLOCK, endpoint=endpoint, **S3_OPTS, **kw)


def worker(spec, endpoint, url):
    env = dict(os.environ, PYTHONPATH=python_path(HERE.parent))
    return subprocess.Popen([sys.executable, str(HERE / "store_helpers.py"),
                             json.dumps(dict(spec, endpoint=endpoint, url=url, block_size=BLOCK))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def prompt(parts):
    return [t for seed, n in parts for t in tokens(seed, n)]


def all_good(st):
    report = verify_store(st.backend, decode=True)
    return report.checked > 0 and not report.bad and not report.orphans


def test_an_object_store_uses_every_worker_whatever_the_cores(endpoint, model, url, monkeypatch):
    """An object store's requests wait on the network: its pools take ``workers`` threads (up to the
    blocks) even on a machine with fewer cores, unlike a local directory's (tests/test_store.py)."""
    from rvqstore.store import prefix_store

    sizes = record_pool_sizes(monkeypatch)
    monkeypatch.setattr(prefix_store.os, "cpu_count", lambda: 2)
    toks = prompt([(11, 5 * BLOCK)])
    st = store(url, endpoint, model, workers=6)
    st.put(toks, kv_cache(model, toks))
    sizes.clear()
    n, _ = store(url, endpoint, model, workers=6).longest_prefix(toks)
    assert n == 5 * BLOCK and sizes[-1] == 5


def test_two_writer_processes_race_on_shared_prefixes(endpoint, model, url, tmp_path):
    shared = [[10, 40]]
    prompts = [shared + [[20 + i, 30]] for i in range(4)] + [shared]
    barrier = [str(tmp_path), 2]  # both start publishing at the same moment, in opposite orders
    procs = [worker({"prompts": prompts, "barrier": barrier}, endpoint, url),
             worker({"prompts": prompts[::-1], "barrier": barrier}, endpoint, url)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    by_writer = [sum(json.loads(line)["new_blocks"] for line in o[0].splitlines()) for o in outs]
    assert all(by_writer)  # both writers published blocks: they really shared the work
    published = sum(by_writer)
    st = store(url, endpoint, model)
    idx = scan(st.backend)
    # every block exactly once, although both writers wrote every prompt
    assert published == len(idx.blocks)
    assert all_good(st)
    import rvqstore
    from test_store import same

    # the shared tokens hold the codes of whichever prompt's prefill published them (with OpenBLAS a
    # prefix's K/V differ in the last bits between prefills of different lengths), each prompt's own
    # tokens its own codes
    encoded = [rvqstore.convert_prompt_cache(kv_cache(model, prompt(parts))) for parts in prompts]
    n_shared = shared[0][1]
    for parts, own in zip(prompts, encoded):
        toks = prompt(parts)
        n, caches = st.longest_prefix(toks)
        assert n == len(toks)
        assert all(any(same(caches, e, t + 1, start=t) for e in encoded) for t in range(n_shared))
        assert same(caches, own, n, start=n_shared)


def test_a_writer_killed_mid_put_leaves_a_clean_prefix(endpoint, model, url):
    parts = [[30, 160]]  # 10 blocks, published one every 0.4 s
    p = worker({"prompts": [parts], "delay": 0.4}, endpoint, url)
    st = store(url, endpoint, model)
    deadline = time.time() + 60
    while time.time() < deadline and len(scan(st.backend).blocks) < 3:
        time.sleep(0.1)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=30)
    have = len(scan(st.backend).blocks)
    assert 3 <= have < 10
    assert all_good(st)  # nothing partial, nothing broken
    toks = prompt(parts)
    n, _ = st.longest_prefix(toks)
    assert n == BLOCK * have  # the published blocks form an unbroken prefix
    r = st.put(toks, kv_cache(model, toks))  # another writer finishes the job
    assert r.stored_before == n and r.new_blocks == 10 - have
    assert st.longest_prefix(toks)[0] == len(toks) and all_good(st)


def test_a_corrupted_object_is_never_served(endpoint, model, url):
    toks = prompt([[40, 64]])
    st = store(url, endpoint, model)
    st.put(toks, kv_cache(model, toks))
    idx = scan(st.backend)
    third = next(b for b in idx.blocks.values() if b.depth == 2)
    key = f"{url.split('/', 3)[3]}/{third.path}"
    s3 = s3_client(endpoint)
    body = bytearray(s3.get_object(Bucket="rvq-test", Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x01
    s3.put_object(Bucket="rvq-test", Key=key, Body=bytes(body))
    assert not all_good(st)
    fresh = store(url, endpoint, model)
    n, caches = fresh.longest_prefix(toks)
    assert n == 2 * BLOCK and fresh.stats.corrupt_blocks == 1  # stops before the bad object, removes it
    assert fresh.put(toks, kv_cache(model, toks)).new_blocks == 1
    assert fresh.longest_prefix(toks)[0] == 64 and all_good(fresh)
    # a block's token ids alone come through ranged reads (preamble, header, token section)
    from rvqstore.format import open_rvq

    src = fresh.backend.range_source(third.path)
    with open_rvq(src) as f:
        assert f.tokens().tolist() == toks[32:48]
        needed = 64 + f.header.header_length + f.section("tokens").length + 2 * 63  # + alignment padding
    assert src.bytes_read <= needed < src.size  # no layer section was fetched


def test_eviction_under_a_budget_then_a_restart_finds_what_is_left(endpoint, model, url):
    st = store(url, endpoint, model)
    ps = {name: prompt([[50 + i, 48]]) for i, name in enumerate("abc")}
    for name, toks in ps.items():
        st.put(toks, kv_cache(model, toks))
        time.sleep(1.1)  # S3 times are in whole seconds
    assert st.longest_prefix(ps["a"])[0] == 48  # a is now the most recently used; b the least
    from rvqstore.store.keys import chain_keys

    b_keys = {k for _, _, k in chain_keys(st.ns, ps["b"], 0, BLOCK)}
    blocks = scan(st.backend).blocks.values()
    budget = sum(x.size for x in blocks if x.name.key not in b_keys)
    plan = st.gc(max_bytes=budget)
    assert {x.name.key for x in plan.evict} == b_keys  # exactly the least recently used prompt
    restarted = store(url, endpoint, model)  # a new process would start exactly like this
    assert restarted.longest_prefix(ps["b"]) == (0, None)
    assert restarted.longest_prefix(ps["a"])[0] == 48 and restarted.longest_prefix(ps["c"])[0] == 48
    assert restarted.du() == budget and all_good(restarted)
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
               PYTHONPATH=python_path(HERE.parent))
    r = subprocess.run([sys.executable, "-m", "rvqstore", "store", "ls", "--json", url], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    (ns,) = json.loads(r.stdout)["namespaces"]
    assert ns["blocks"] == 6 and ns["tokens"] == 96 and ns["leaves"] == 2


def test_an_oversized_object_under_a_block_name_is_never_downloaded(endpoint, model, url, monkeypatch):
    import rvqstore.store.prefix_store as ps
    from rvqstore.store.keys import block_path

    toks = prompt([[60, 16]])
    st = store(url, endpoint, model)
    key = chain_keys_of(st, toks)[0]
    s3 = s3_client(endpoint)
    s3.put_object(Bucket="rvq-test", Key=f"{url.split('/', 3)[3]}/{block_path(st.ns, st.ns, key, BLOCK, toks[0])}",
                  Body=b"\0" * 300_000)
    monkeypatch.setattr(ps, "MAX_BYTES_PER_TOKEN", 1000)
    monkeypatch.setattr(ps, "MAX_HEADER_BYTES", 100_000)
    assert st.longest_prefix(toks) == (0, None)
    assert st.stats.corrupt_blocks == 1 and st.stats.bytes_read == 0
    assert not scan(st.backend).blocks  # removed: the next put writes the real block
    assert st.put(toks, kv_cache(model, toks)).new_blocks == 1


def chain_keys_of(st, toks):
    from rvqstore.store.keys import chain_keys

    return [k for _, _, k in chain_keys(st.ns, toks, 0, BLOCK)]
