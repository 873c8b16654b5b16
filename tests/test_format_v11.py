"""Format revision 1.1 through the library API: version/feature derivation by the writer, what a 1.0
reader does with 1.1 files, per-side quantizers, list children, decoded sizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import rvqstore.format as F
from rvqstore.format import constants as C
from rvqstore.format import header as Hdr

ROOT = Path(__file__).resolve().parent.parent
VEC = ROOT / "format_spec" / "vectors" / "valid"
sys.path.insert(0, str(ROOT / "tools"))

import make_format_vectors as MV  # noqa: E402

V11 = sorted(MV.V11)


@pytest.mark.parametrize("name", V11)
def test_a_1_0_reader_refuses_every_1_1_file(name, monkeypatch):
    monkeypatch.setattr(C, "KNOWN_FEATURES", frozenset({"zstd"}))
    with pytest.raises(F.UnknownFeatureError, match="layer-kinds|per-side-geometry|quantizer-table"):
        F.open_rvq(VEC / name)


def _write(tmp_path, build, name="x.rvq"):
    content, secs = build()
    sections = [F.Section(s["name"], s["layer"], s["kind"],
                          np.frombuffer(s["_data"], dtype=np.dtype(C.DTYPES[s["dtype"]][0])).reshape(s["shape"]),
                          dtype=s["dtype"]) for s in secs]
    return F.write_rvq(tmp_path / name, content, sections, compress="none"), tmp_path / name


def test_writer_lists_exactly_the_features_used(tmp_path):
    # value_head_dim equal to head_dim is dropped: no feature, a 1.0 file
    def same_dim():
        content, secs = MV.v_worked_example()
        content = dict(content, layers=[dict(content["layers"][0], value_head_dim=8)])
        return content, secs
    h, p = _write(tmp_path, same_dim)
    assert (h.major, h.minor, h.required_features) == (1, 0, ())
    assert p.read_bytes() == (VEC / "worked_example.rvq").read_bytes()
    h, _ = _write(tmp_path, MV.v_per_side, "p.rvq")
    assert (h.minor, h.required_features) == (1, ("per-side-geometry", "quantizer-table"))
    h, _ = _write(tmp_path, MV.v_list, "l.rvq")
    assert (h.minor, h.required_features) == (1, ("layer-kinds",))


def test_quantizer_for_and_codec_for(tmp_path):
    with F.open_rvq(VEC / "worked_example.rvq") as f:  # 1.0: one map for every side
        assert f.quantizer_for(0, "keys") is f.quantizer_for(0, "values") is f.quantizer
        assert f.codec_for(0, "values", use_kernels=False).dim == 8
        with pytest.raises(ValueError):
            f.quantizer_for(0, "queries")
    with F.open_rvq(VEC / "per_side_quantizers.rvq") as f:
        assert f.quantizer is None and len(f.quantizers) == 2
        L0 = f.layers[0]
        assert (L0.head_dim, L0.value_head_dim, L0.key_quantizer, L0.value_quantizer) == (56, 40, 0, 1)
        assert f.quantizer_for(0, "keys")["dim"] == 56 and f.quantizer_for(0, "values")["dim"] == 40
        assert f.codec_for(1, "keys", use_kernels=False).bits == (2, 2)
        with pytest.raises(F.UnknownFeatureError, match="codec_for"):
            f.codec()
    with F.open_rvq(VEC / "arrays_state.rvq") as f:
        assert f.quantizer_for(0, "keys") is None


def test_list_children_and_state_slots():
    exp = json.loads((VEC / "cache_list.json").read_text())
    with F.open_rvq(VEC / "cache_list.rvq") as f:
        lst = f.layers[0]
        assert lst.kind == "list" and [c.kind for c in lst.children] == ["rvq", "arrays"]
        assert all(c.parent == 0 for c in lst.children)
        child = lst.children[0]
        arrays = f.layer_arrays(child)
        assert set(arrays) == {"keys.codes1", "keys.codes2", "keys.scales", "values.codes1", "values.codes2",
                               "values.scales"}
        np.testing.assert_array_equal(arrays["keys.scales"].reshape(-1),
                                      exp["sections"]["layers.0.c0.keys.scales"]["values"])
        assert lst.children[1].state_sections() == {0: "layers.0.c1.state.0"}
        assert [L.index for L in f.header.all_layers()] == [0, 0, 1, 1]
    with F.open_rvq(VEC / "arrays_state.rvq") as f:
        assert f.layers[0].state_sections() == {0: "layers.0.state.0", 2: "layers.0.state.2"}  # slot 1 empty


def test_rotating_layer_fields():
    with F.open_rvq(VEC / "rotating_window.rvq") as f:
        L = f.layers[1]
        assert (L.kind, L.max_size, L.keep, L.offset, L.n_tokens, L.n_dense_tokens) == ("rvq-rotating", 4, 1, 9, 4, 1)
        assert L.to_dict()["offset"] == 9 and L.is_coded and L.is_attention


def test_decoded_nbytes_counts_every_kind():
    with F.open_rvq(VEC / "per_side_quantizers.rvq") as f:
        # layer 0: bf16 keys 56 + values 40; layer 1: f16 keys 40 + f32 values 40; 2 tokens, 1 head; tokens
        assert f.decoded_nbytes() == 2 * (56 * 2 + 40 * 2) + 2 * (40 * 2 + 40 * 4) + 2 * 4
    with F.open_rvq(VEC / "cache_list.rvq") as f:
        assert f.decoded_nbytes() == 2 * 24 * 2 * 2 + 8 * 2 + 2 * 24 * 2 * 2 + 2 * 4


def test_kinds_of_1_1_are_unknown_without_the_feature():
    # in a file that does not list layer-kinds, a state.0 / c0.x section is an unknown kind: skipped
    assert Hdr._kind_known("state.0", False) is False and Hdr._kind_known("c0.keys.codes1", False) is False
    assert Hdr._kind_known("state.0", True) and Hdr._kind_known("c3.values.dense", True)
    assert not Hdr._kind_known("state.01", True) and not Hdr._kind_known("c0.future", True)
