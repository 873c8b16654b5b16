"""GGUFs the loader cannot handle are refused from their header, naming what is unsupported."""

import struct

import pytest

from rvqstore import gguf
from rvqstore.errors import UnsupportedModelError
from rvqstore.gguf_header import GGUFHeaderError, read_gguf_header
from rvqstore.model import load_model


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, value) -> bytes:
    if isinstance(value, str):
        return _s(key) + struct.pack("<I", 8) + _s(value)
    if isinstance(value, list):
        return _s(key) + struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_s(v) for v in value)
    return _s(key) + struct.pack("<II", 4, value)


def _gguf(path, meta: dict, tensors=(("token_embd.weight", (64, 128), 0),), version=3) -> None:
    """A GGUF header (what llama.cpp's gguf writer lays out) followed by zero tensor data."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(meta))
    out += b"".join(_kv(k, v) for k, v in meta.items())
    for name, shape, ttype in tensors:
        out += _s(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        out += struct.pack("<IQ", ttype, 0)
    path.write_bytes(out + bytes(64))


LLAMA = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
         "tokenizer.ggml.tokens": ["a", "b"], "llama.block_count": 2}


@pytest.fixture
def no_tensor_loads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("mx.load was called")

    monkeypatch.setattr(gguf.mx, "load", refuse)


def test_header_reader(tmp_path):
    p = tmp_path / "m.gguf"
    _gguf(p, LLAMA, tensors=[("token_embd.weight", (64, 128), 2), ("output.weight", (64, 128), 14)])
    h = read_gguf_header(p)
    assert h.version == 3 and h.metadata["general.architecture"] == "llama"
    assert h.metadata["tokenizer.ggml.tokens"] == ["a", "b"] and h.metadata["llama.block_count"] == 2
    assert [(t.name, t.shape, t.type_name) for t in h.tensors] == [
        ("token_embd.weight", (64, 128), "Q4_0"), ("output.weight", (64, 128), "Q6_K")]


@pytest.mark.parametrize("meta,tensors,needle", [
    (dict(LLAMA, **{"general.architecture": "qwen2"}), None, "architecture 'qwen2'"),
    (dict(LLAMA, **{"tokenizer.ggml.model": "llama"}), None, "vocabulary type 'llama'"),
    (dict(LLAMA, **{"tokenizer.ggml.pre": "qwen2"}), None, "pre-tokenizer 'qwen2'"),
    (LLAMA, [("a.weight", (64,), 0), ("b.weight", (256, 4), 12), ("c.weight", (256, 4), 12)], "Q4_K (2 tensors)"),
])
def test_unsupported_gguf_is_named_before_any_tensor_loads(tmp_path, no_tensor_loads, meta, tensors, needle):
    p = tmp_path / "m.gguf"
    _gguf(p, meta, **({"tensors": tensors} if tensors else {}))
    with pytest.raises(UnsupportedModelError, match="not supported: .*" + needle.replace("(", r"\(").replace(")", r"\)")):
        load_model(p)


def test_damaged_headers(tmp_path, no_tensor_loads):
    p = tmp_path / "m.gguf"
    _gguf(p, LLAMA)
    whole = p.read_bytes()
    for cut in (3, 20, 60, len(whole) - 80):
        p.write_bytes(whole[:cut])
        with pytest.raises(GGUFHeaderError):
            load_model(p)
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 2**40) + bytes(100))  # a count larger than the file
    with pytest.raises(GGUFHeaderError, match="exceed"):
        read_gguf_header(p)
    p.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(GGUFHeaderError, match="magic"):
        load_model(p)
    _gguf(p, LLAMA, version=1)
    with pytest.raises(GGUFHeaderError, match="version 1"):
        load_model(p)
