"""The raw-parameter digest behind the model check's memo and the weight-hash cache: both kinds (host XXH3,
device lane sums) see every name, shape, dtype and bit, and the lane sums equal a numpy model of them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from rvqstore import parameter_digest as pd

KINDS = [False, True]  # on_device: host XXH3, lane sums (run by MLX on this machine's device)


def _fmix32(h: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = h ^ (h >> 16)
        h = h * np.uint32(0x85EBCA6B)
        h = h ^ (h >> 13)
        h = h * np.uint32(0xC2B2AE35)
        return h ^ (h >> 16)


def _lanes_model(words: np.ndarray, start: int) -> list[int]:
    with np.errstate(over="ignore"):
        i = np.arange(words.size, dtype=np.uint32) + np.uint32(start)
        base = i * np.uint32(0x9E3779B9)
        return [int(_fmix32(words ^ (base + np.uint32(c))).sum(dtype=np.uint64) % 2**32) for c in pd._LANE_SEEDS]


class _Holder(nn.Module):
    def __init__(self, **params):
        super().__init__()
        for k, v in params.items():
            setattr(self, k, v)


def _model(dtype=mx.float16, shape=(9, 7), seed=0):
    rng = np.random.default_rng(seed)
    return _Holder(w=mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype),
                   b=mx.array(rng.standard_normal(shape[0]).astype(np.float32)))


@pytest.mark.parametrize("start", [0, 5, 2**32 - 3])  # the last wraps the word index: still the model
def test_lane_sums_equal_the_numpy_model(start):
    words = np.random.default_rng(1).integers(0, 2**32, size=1001, dtype=np.uint32)
    got = np.array(pd._lane_sums(mx.array(words), mx.array(start, mx.uint32))).tolist()
    assert got == _lanes_model(words, start)


def test_blocks_sum_to_the_whole(monkeypatch):
    m = _model(mx.float32, (64, 33))
    whole = pd.parameters_digest(m, on_device=True)
    monkeypatch.setattr(pd, "_BLOCK_WORDS", 100)  # 2112 words in 22 blocks, the last one short
    assert pd.parameters_digest(m, on_device=True) == whole


@pytest.mark.parametrize("on_device", KINDS)
def test_the_same_parameters_give_the_same_digest(on_device):
    a, b = _model(), _model()
    assert pd.parameters_digest(a, on_device=on_device) == pd.parameters_digest(b, on_device=on_device)
    assert pd.parameters_digest(a, on_device=on_device) != pd.parameters_digest(_model(seed=1), on_device=on_device)


@pytest.mark.parametrize("on_device", KINDS)
@pytest.mark.parametrize("edit", ["one value", "two signs", "swap", "rename", "reshape", "same bits, other dtype"])
def test_every_edit_changes_the_digest(on_device, edit):
    m = _model()
    before = pd.parameters_digest(m, on_device=on_device)
    w = m.w
    if edit == "one value":
        w[3, 4] += 1.0  # in place: the same array object
    elif edit == "two signs":  # two top bits flipped: invisible to any sum of the words themselves
        w[0, 0] = -w[0, 0]
        w[5, 6] = -w[5, 6]
    elif edit == "swap":
        x, y = w[1, 1].item(), w[2, 2].item()
        assert x != y
        w[1, 1], w[2, 2] = y, x
    elif edit == "rename":
        m = _Holder(v=m.w, b=m.b)
    elif edit == "reshape":
        m.w = w.reshape(7, 9)
    else:
        m.w = w.view(mx.uint16)
    mx.eval(m.parameters())
    assert pd.parameters_digest(m, on_device=on_device) != before


@pytest.mark.parametrize("on_device", KINDS)
@pytest.mark.parametrize("dtype,shape", [(mx.bfloat16, (4, 6)), (mx.float16, (3, 5)), (mx.uint8, (3, 3)),
                                         (mx.uint32, (2, 3))])  # odd byte counts are widened word by word
def test_dtypes_and_odd_sizes(on_device, dtype, shape):
    m = _Holder(w=(mx.arange(int(np.prod(shape))).reshape(shape) % 200).astype(dtype))
    before = pd.parameters_digest(m, on_device=on_device)
    m.w[-1, -1] = 201
    mx.eval(m.w)
    assert pd.parameters_digest(m, on_device=on_device) != before


@pytest.mark.parametrize("on_device", KINDS)
def test_a_strided_view_digests_as_its_values_in_c_order(on_device):
    x = mx.arange(35, dtype=mx.float32).reshape(5, 7)
    view, copy = _Holder(w=x.T), _Holder(w=mx.array(np.array(x.T)))
    assert pd.parameters_digest(view, on_device=on_device) == pd.parameters_digest(copy, on_device=on_device)


def test_kinds_are_named_and_never_equal():
    m = _model()
    host, lanes = pd.parameters_digest(m, on_device=False), pd.parameters_digest(m, on_device=True)
    assert host.startswith("xxh3-128:") and lanes.startswith("lanes-v1:") and host != lanes
    want = lanes if mx.default_device() == mx.gpu else host
    assert pd.parameters_digest(m) == want


def test_a_device_digest_that_fails_falls_back_to_the_host_once(monkeypatch, caplog):
    m = _model()
    monkeypatch.setattr(pd.mx, "default_device", lambda: pd.mx.gpu)
    monkeypatch.setattr(pd, "_failed", {})
    calls = []

    def broken(params):
        calls.append(1)
        raise RuntimeError("no such op here")

    monkeypatch.setattr(pd, "_lanes_digest", broken)
    want = pd.parameters_digest(m, on_device=False)
    assert pd.parameters_digest(m) == want and pd.parameters_digest(m) == want
    assert len(calls) == 1 and "no such op here" in pd._failed["lanes"]  # tried once, then the host's
    with pytest.raises(RuntimeError):
        pd.parameters_digest(m, on_device=True)  # forced: the error itself
