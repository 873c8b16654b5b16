"""Format 1.2 ``codec-state`` end to end: caches with sink positions and a key mean saved, loaded and
resumed through real files; the library's decoded keys against the vectors' exact reference; what the
writer derives (version, features) and what older readers, loaders and the prefix store do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rvqstore
import rvqstore.format as F
from rvqstore import RVQKVCache
from rvqstore.format import constants as C
from rvqstore.format.quantizer import decode_layers
from rvqstore.generation import greedy_tokens, prefill

ROOT = Path(__file__).resolve().parent.parent
VEC = ROOT / "format_spec" / "vectors"
sys.path.insert(0, str(ROOT / "tools"))

import make_format_vectors as MV  # noqa: E402
from vector_values import bits_to_float, ulp  # noqa: E402

TOKENS = [int(i) for i in np.random.default_rng(3).integers(3, 128, 40)]
STATE_VECTORS = sorted(MV.V12)


@pytest.fixture(scope="module")
def llama():
    from tiny_models import build

    return build("llama")[0]


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)  # bits, so NaN == NaN


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_np(a), _np(b))


def _filled(dtype, *, n=12, sink=2, center=True, dense_window=3, mode="packed", seed=1) -> RVQKVCache:
    k = (mx.random.normal((1, 2, n, 32), key=mx.random.key(seed)) + 0.7).astype(dtype)
    v = mx.random.normal((1, 2, n, 32), key=mx.random.key(seed + 1)).astype(dtype)
    c = RVQKVCache(bits=(2, 2), dense_window=dense_window, flush_block=4, mode=mode, sink_tokens=sink,
                   center_keys=center)
    c.update_and_fetch(k[:, :, :n // 2], v[:, :, :n // 2])
    c.update_and_fetch(k[:, :, n // 2:], v[:, :, n // 2:])
    return c


def _assert_same_cache(a: RVQKVCache, b: RVQKVCache) -> None:
    assert (a.offset, a.n_sink, a.n_coded, a.n_dense) == (b.offset, b.n_sink, b.n_coded, b.n_dense)
    assert (a.sink_tokens, a.center_keys, a.dtype) == (b.sink_tokens, b.center_keys, b.dtype)
    for name in ("sink_keys", "sink_values", "key_mean"):
        assert _same(getattr(a, name), getattr(b, name)), name
    ka, va = a.keys_and_values()
    kb, vb = b.keys_and_values()
    assert _same(ka, kb) and _same(va, vb)


# ---- round trips through real files --------------------------------------------------------------------
@pytest.mark.parametrize("dtype,mode", [(mx.float32, "packed"), (mx.float16, "resident"), (mx.bfloat16, "packed"),
                                        (mx.float16, "packed")])
def test_caches_with_state_round_trip(tmp_path, dtype, mode):
    c = _filled(dtype, mode=mode)
    assert c.n_sink == 2 and c.n_coded and c.n_dense and c.key_mean is not None
    path = tmp_path / "s.rvq"
    rvqstore.save_prompt_cache(path, [c], tokens=list(range(12)))
    with F.open_rvq(path) as f:
        assert f.version == (1, 2) and "codec-state" in f.header.required_features
        layer = f.layers[0]
        assert (layer.sink_tokens, layer.center_keys, layer.n_sink) == (2, True, 2)
        assert layer.n_quantized_tokens == c.n_coded and layer.n_dense_tokens == c.n_dense
        want = "bfloat16" if dtype == mx.bfloat16 else "float16"  # the state dtype
        for kind in C.CODEC_STATE_KINDS:
            assert f.section(layer.sections[kind]).dtype == want
        f.verify(decode=decode_layers)
    (back,) = rvqstore.load_prompt_cache(path)
    assert back.mode == mode
    _assert_same_cache(c, back)


@pytest.mark.parametrize("n,sink,dense_window", [(5, 8, 0), (2, 2, 3), (12, 3, 0)],
                         ids=["sink_longer_than_tokens", "only_sink_tokens", "no_window"])
def test_edge_shapes_round_trip(tmp_path, n, sink, dense_window):
    c = _filled(mx.float16, n=n, sink=sink, dense_window=dense_window)
    path = tmp_path / "e.rvq"
    rvqstore.save_prompt_cache(path, [c])
    with F.open_rvq(path) as f:
        layer = f.layers[0]
        assert layer.n_sink == min(n, sink) and layer.n_quantized_tokens == c.n_coded
        assert ("keys.mean" in layer.sections) == (c.n_coded > 0)  # centered, yet no mean beside no codes
    (back,) = rvqstore.load_prompt_cache(path)
    _assert_same_cache(c, back)


def test_float32_state_that_overflows_float16_is_stored_as_float32(tmp_path):
    k = mx.random.normal((1, 1, 6, 32), key=mx.random.key(4)) * 1e5  # beyond float16's 65504
    c = RVQKVCache(bits=(2, 2), flush_block=2, sink_tokens=1, center_keys=True)
    c.update_and_fetch(k, k * 1e-5)
    path = tmp_path / "o.rvq"
    rvqstore.save_prompt_cache(path, [c])
    with F.open_rvq(path) as f:
        names = f.layers[0].sections
        dts = {kind: f.section(names[kind]).dtype for kind in C.CODEC_STATE_KINDS}
    assert dts == {"keys.sink": "float32", "values.sink": "float16", "keys.mean": "float32"}
    _assert_same_cache(c, rvqstore.load_prompt_cache(path)[0])


def test_a_cache_without_state_writes_exactly_the_same_bytes(tmp_path):
    k = mx.random.normal((1, 2, 9, 32), key=mx.random.key(7)).astype(mx.float16)
    files = []
    for kw in ({}, {"sink_tokens": 0, "center_keys": False}):
        c = RVQKVCache(bits=(2, 2), flush_block=4, dense_window=2, **kw)
        c.update_and_fetch(k, k)
        files.append(tmp_path / f"{len(files)}.rvq")
        rvqstore.save_prompt_cache(files[-1], [c], tokens=list(range(9)))
    assert files[0].read_bytes() == files[1].read_bytes()
    with F.open_rvq(files[0]) as f:
        assert f.version == (1, 0) and "codec-state" not in f.header.required_features
        assert "sink_tokens" not in f.header.raw["layers"][0] and not any(
            s.kind in C.CODEC_STATE_KINDS for s in f.sections)


def test_mlx_lm_list_layers_carry_state_in_children(tmp_path):
    from mlx_lm.models.cache import CacheList

    c = _filled(mx.float16)
    path = tmp_path / "l.rvq"
    rvqstore.save_prompt_cache(path, [CacheList(c)])
    with F.open_rvq(path) as f:
        child = f.layers[0].children[0]
        assert child.sink_tokens == 2 and set(C.CODEC_STATE_KINDS) <= set(child.sections)
        assert {s.kind for s in f.sections if s.kind.endswith((".sink", ".mean"))} == {
            "c0.keys.sink", "c0.values.sink", "c0.keys.mean"}
    (back,) = rvqstore.load_prompt_cache(path)
    _assert_same_cache(c, back.caches[0])


def test_ranged_reads_and_inspect_see_the_state(tmp_path, capsys):
    c = _filled(mx.float32)
    path = tmp_path / "r.rvq"
    rvqstore.save_prompt_cache(path, [c, _filled(mx.float32, seed=9)], tokens=list(range(12)))
    data = path.read_bytes()
    reads = []

    class Source:  # a range source: only the bytes asked for
        size = len(data)

        def read(self, offset, length):
            reads.append((offset, length))
            return data[offset: offset + length]

    with F.open_rvq(Source()) as f:
        mean = f.read_section_mx(f.layers[1].sections["keys.mean"])
        assert _same(mean, _filled(mx.float32, seed=9).key_mean)
        assert f.decoded_nbytes() == 2 * (2 * 12 * 32 * 4 * 2 + 2 * 32 * 2) + 12 * 4  # the means count too
    assert sum(n for _, n in reads) < len(data) // 2  # header + one small section, not the file
    from rvqstore.cli import main

    assert main(["inspect", str(path)]) == 0
    assert "codec state  layers 0-1: first 2 position(s) exact (sink_tokens 2); keys centered by a stored" \
        in capsys.readouterr().out
    assert main(["inspect", "--json", str(path)]) == 0
    rows = json.loads(capsys.readouterr().out)["layers"]
    assert rows[0]["codec_state"] == {"sink_tokens": 2, "n_sink": 2, "center_keys": True, "key_mean": True}
    assert main(["verify", "-q", str(path)]) == 0


# ---- resume and continue ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,mode", [(mx.float32, "packed"), (mx.float16, "resident")])
def test_resume_and_continue_equals_the_uninterrupted_cache(llama, tmp_path, dtype, mode):
    model = llama
    if dtype != mx.float32:
        from tiny_models import build

        model = build("llama")[0]
        model.set_dtype(dtype)
    kw = dict(sink_tokens=1, center_keys=True, dense_window=4, flush_block=8, mode=mode)
    caches = rvqstore.make_prompt_cache(model, (2, 2), **kw)
    prefill(model, TOKENS, caches)
    assert all(c.n_sink == 1 and c.key_mean is not None and c.key_mean.dtype == mx.float16 for c in caches)
    path = tmp_path / "p.rvq"
    rvqstore.save_prompt_cache(path, caches, tokens=TOKENS, model=model)
    r = rvqstore.resume(path, TOKENS + [5, 6], model)
    assert r.reused == len(TOKENS) and r.remaining == [5, 6]
    for a, b in zip(caches, r.cache):
        _assert_same_cache(a, b)
    want = list(greedy_tokens(model, caches, [5, 6], 6))
    got = list(greedy_tokens(model, r.cache, r.remaining, 6))
    assert got == want
    for a, b in zip(caches, r.cache):  # the new tokens were coded against the same mean
        _assert_same_cache(a, b)
    # a prompt that leaves the stored tokens at 25: cut back, the state kept, the same as trimming in memory
    again = rvqstore.load_prompt_cache(path)
    r = rvqstore.resume(path, TOKENS[:25] + [9, 9], model)
    assert r.reused == 25
    for a, b in zip(again, r.cache):
        a.trim(a.offset - 25)
        _assert_same_cache(a, b)
        assert b.sink_tokens == 1 and b.center_keys
    # nothing shared: fresh caches with the same settings
    fresh = rvqstore.resume(path, [7, 8, 9], model)
    assert fresh.reused == 0 and all((c.sink_tokens, c.center_keys, c.offset) == (1, True, 0) for c in fresh.cache)


def test_sliding_window_layers_keep_no_state_beside_layers_that_do(tmp_path):
    from tiny_models import build

    model = build("gemma3_text")[0]  # two sliding-window layers, then a full-attention one
    caches = rvqstore.make_prompt_cache(model, (2, 2), sink_tokens=1, center_keys=True, flush_block=8)
    prefill(model, TOKENS, caches)
    path = tmp_path / "g.rvq"
    rvqstore.save_prompt_cache(path, caches, tokens=TOKENS, model=model)
    with F.open_rvq(path) as f:
        assert [(x.kind, x.sink_tokens, x.center_keys) for x in f.layers] == [
            ("rvq-rotating", 0, False), ("rvq-rotating", 0, False), ("rvq", 1, True)]
        assert f.header.required_features == ("zstd", "layer-kinds", "codec-state")
    r = rvqstore.resume(path, TOKENS + [5], model)
    assert r.reused == len(TOKENS)
    assert list(greedy_tokens(model, r.cache, r.remaining, 4)) == list(greedy_tokens(model, caches, [5], 4))


# ---- the vectors, decoded by the library --------------------------------------------------------------------
def _ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    return ulp(x, dtype, MV.FORMATS)


def _vector_caches(name: str) -> dict:
    caches = rvqstore.load_prompt_cache(VEC / "valid" / name)
    out = {}
    for i, c in enumerate(caches):
        if isinstance(c, RVQKVCache):
            out[f"layers.{i}"] = c
        elif hasattr(c, "caches"):
            out.update({f"layers.{i}.c{j}": x for j, x in enumerate(c.caches) if isinstance(x, RVQKVCache)})
    return out


@pytest.mark.parametrize("name", STATE_VECTORS)
def test_library_decodes_every_position_within_the_spec_tolerance(name):
    """Every position of every rvq layer against the vector's exact reference (spec 8.2): sinks and dense
    positions bit for bit, coded keys within 2^-20 s + ulp(d) + 2 ulp(r)."""
    exp = json.loads((VEC / "valid" / (name[:-4] + ".json")).read_text())
    caches = _vector_caches(name)
    assert set(caches) == set(exp["decoded_positions"])
    centered = 0
    for base, want in exp["decoded_positions"].items():
        c = caches[base]
        S, Tq = c.n_sink, c.n_coded
        got_k, got_v = c.keys_and_values()
        for side, got in (("keys", got_k), ("values", got_v)):
            w = want[side]
            assert list(got.shape) == w["shape"] and str(got.dtype).endswith(w["dtype"])
            got = np.array(got.astype(mx.float32)).astype(np.float64)
            ref = bits_to_float(np.array(w["bits"], dtype=np.uint64), w["dtype"]).reshape(got.shape)
            exact = np.ones(got.shape[2], bool)
            exact[S:S + Tq] = False
            assert np.array_equal(got[:, :, exact], ref[:, :, exact], equal_nan=True), (base, side)
            g, r = got[:, :, S:S + Tq], ref[:, :, S:S + Tq]
            assert np.array_equal(np.isnan(g), np.isnan(r)), (base, side)
            dec = bits_to_float(np.array(exp["decoded"][f"{base}.{side}"]["bits"], dtype=np.uint64), w["dtype"])
            s = np.array(c.state[0 if side == "keys" else 3].astype(mx.float32)).astype(np.float64)[..., None]
            nan = np.isnan(r)
            tol = (2.0 ** -20 * s + _ulp(dec.reshape(r.shape), w["dtype"]) + 2 * _ulp(r, w["dtype"]))[~nan]
            assert np.all(np.abs(g - r)[~nan] <= tol), (base, side)
            if side == "keys" and c.key_mean is not None:
                centered += 1
                assert np.max(np.abs(g - dec.reshape(r.shape))[~nan]) > 1e-2  # the mean is really there
    assert centered >= 1


def test_coded_keys_are_the_float32_sum_rounded_once_to_the_key_dtype():
    """The cache's own decoded keys are exactly ``dtype(float32(dec) + float32(mean))`` of its codec's decode."""
    from rvqstore.codec import EncodedVectors

    for base, c in _vector_caches("codec_state_layers.rvq").items():
        if c.key_mean is None:
            continue
        ks, k1, k2 = c.state[:3]
        dec = c._keys.codec.decode(EncodedVectors(ks, k1, k2, c.dtype), dtype=c.dtype)
        want = (dec.astype(mx.float32) + c.key_mean.astype(mx.float32)[:, :, None, :]).astype(c.dtype)
        got = c.keys_and_values()[0][:, :, c.n_sink:c.n_sink + c.n_coded]
        assert _same(got, want), base


# ---- versions, features, refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", STATE_VECTORS)
def test_a_1_1_reader_refuses_codec_state(name, monkeypatch):
    monkeypatch.setattr(C, "KNOWN_FEATURES", C.KNOWN_FEATURES - {"codec-state"})
    with pytest.raises(F.UnknownFeatureError, match="codec-state"):
        F.open_rvq(VEC / "valid" / name)


def test_every_older_vector_still_reads_as_before():
    old = [e["file"] for e in json.loads((VEC / "valid" / "MANIFEST.json").read_text())
           if e["file"] not in MV.V12]
    assert len(old) >= 20
    for name in old:
        with F.open_rvq(VEC / "valid" / name) as f:
            assert f.version[1] in (0, 1, 7) and "codec-state" not in f.header.required_features
            assert all(layer.sink_tokens == 0 and not layer.center_keys for layer in f.header.all_layers())


def _sections(secs):
    return [F.Section(s["name"], s["layer"], s["kind"],
                      np.frombuffer(s["_data"], dtype=np.dtype(C.DTYPES[s["dtype"]][0])).reshape(s["shape"]),
                      dtype=s["dtype"]) for s in secs]


def test_writer_derives_version_and_features(tmp_path):
    content, secs = MV.v_worked_example()
    content = dict(content, layers=[dict(content["layers"][0], sink_tokens=0, center_keys=False)])
    h = F.write_rvq(tmp_path / "a.rvq", content, _sections(secs), compress="none")
    assert (h.minor, h.required_features) == (0, ())  # defaults dropped: the 1.0 file, byte for byte
    assert (tmp_path / "a.rvq").read_bytes() == (VEC / "valid" / "worked_example.rvq").read_bytes()
    content, secs = MV.v_codec_state_layers()
    h = F.write_rvq(tmp_path / "b.rvq", content, _sections(secs), compress="none")
    assert (h.minor, h.required_features) == (2, ("layer-kinds", "codec-state"))
    # a state section with nothing in the layer map to say what it is: refused before anything is written
    content, secs = MV.v_worked_example()
    secs = secs + [MV.sec("layers.0.keys.mean", 0, "keys.mean", "float16", [1, 1, 8], bytes(16))]
    with pytest.raises(F.MalformedHeaderError, match="center_keys is false"):
        F.write_rvq(tmp_path / "c.rvq", content, _sections(secs), compress="none")
    assert not (tmp_path / "c.rvq").exists()


@pytest.mark.parametrize("entry", [e for e in json.loads((VEC / "invalid" / "MANIFEST.json").read_text())
                                   if e["file"].startswith("codec_state")], ids=lambda e: e["file"])
def test_loaders_refuse_every_invalid_codec_state_vector_typed(entry):
    cls = getattr(F.errors, entry["error"])
    path = VEC / "invalid" / entry["file"]
    with pytest.raises(cls) as e:
        rvqstore.load_prompt_cache(path)
    assert type(e.value) is cls and str(e.value).startswith(str(path))


def test_the_prefix_store_refuses_caches_with_state(llama, tmp_path):
    from rvqstore.store import StoreConfigError

    caches = rvqstore.make_prompt_cache(llama, (2, 2), sink_tokens=1)
    prefill(llama, TOKENS[:8], caches)
    store = rvqstore.PrefixStore(str(tmp_path / "s"), model=llama, bits=(2, 2), block_size=8)
    with pytest.raises(StoreConfigError, match="codec state"):
        store.put(TOKENS[:8], caches)
    assert not any((tmp_path / "s").rglob("*.rvq"))
