"""GGUFTokenizer: a byte-level BPE tokenizer rebuilt from GGUF metadata, and ``vocab_hash``, the
vocabulary identity stored in snapshot fingerprints."""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Iterable, Sequence

import mlx.core as mx
import numpy as np

from .errors import UnsupportedModelError

__all__ = ["GGUFTokenizer", "vocab_hash"]

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


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, mx.array) else v


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
