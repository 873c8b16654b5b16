"""Run the model over a text with a simulated quantized cache and score the second half.

Every key and value the model hands to its cache goes through the method's quantizer before
attention sees it (so quantization also reaches later layers' hidden states, as in real use). For
RVQ this is bit-for-bit what ``RVQKVCache`` in packed mode returns (decode of the stored codes).

Protocols (the scored tokens are the same in both: the second half of the text):
* ``half``: the first half is prefilled in chunks of 512 (a cached prompt), then the second half
  runs in one forward pass against it;
* ``stream``: the whole text goes through in chunks of ``chunk`` tokens (as in chunked prefill or
  generation with a growing cache: each chunk sees the earlier chunks only through the cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .methods import Method
from .metrics import TokenScores, compare

PROTOCOLS = ("half", "stream")


class SimCache(KVCache):
    """A KVCache that stores the method's reconstruction of what it is handed, and sums the
    relative errors E||x - x_hat||^2 / ||x||^2 of keys and values."""

    def __init__(self, layer: int, method: Method):
        super().__init__()
        self.layer, self.method = layer, method
        self.err = {"k": [], "v": []}
        self.key_mean = None  # (B, H, 1, D) float16-rounded, fixed at the first update

    def _code(self, xf: mx.array, side: str, keep: int) -> mx.array:
        fn = self.method.plan(self.layer, side).fn
        if side != "k" or not self.method.center_keys:
            return fn(xf)
        if self.key_mean is None:
            body = xf[:, :, keep:] if xf.shape[2] > keep else xf
            self.key_mean = mx.mean(body, axis=2, keepdims=True).astype(mx.float16).astype(mx.float32)
        return fn(xf - self.key_mean) + self.key_mean

    def update_and_fetch(self, keys, values):
        out = []
        for x, side in ((keys, "k"), (values, "v")):
            xf = x.astype(mx.float32)
            keep = min(max(self.method.sink - self.offset, 0), x.shape[2])
            xh = self._code(xf, side, keep)
            if keep:
                xh = mx.concatenate([xf[:, :, :keep].astype(mx.float16).astype(mx.float32), xh[:, :, keep:]], axis=2)
            num = mx.sum(mx.square(xf - xh), axis=-1)
            den = mx.maximum(mx.sum(mx.square(xf), axis=-1), 1e-30)
            self.err[side].append(mx.sum(num / den))
            out.append(xh.astype(x.dtype))
        return super().update_and_fetch(*out)


@dataclass
class Run:
    scores: TokenScores
    k_err: float
    v_err: float


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _head(model: Any):
    """The LM head as a function of the final hidden states, when the model exposes it (llama-style
    mlx-lm models); None otherwise."""
    body = getattr(model, "model", None)
    if body is None:
        return None
    if getattr(model, "lm_head", None) is not None:
        return model.lm_head
    if getattr(getattr(model, "args", None), "tie_word_embeddings", False) and hasattr(body, "embed_tokens"):
        return body.embed_tokens.as_linear
    return None


def _forward(model: Any, ids: mx.array, caches: list, start: int, stop: int, chunk: int,
             keep_from: int = 0) -> list[tuple[int, mx.array]]:
    """(first position, logits) per chunk. Chunks that end at or before ``keep_from`` only fill the
    cache: where the model allows it, the LM head then runs on their last position only (the head is
    a fifth of the work of a 512-token chunk of SmolLM2)."""
    out = []
    head = _head(model)
    for s in range(start, stop, chunk):
        e = min(stop, s + chunk)
        first = s
        if head is not None and e <= keep_from:
            logits, first = head(model.model(ids[:, s:e], cache=caches)[:, -1:])[0], e - 1
        else:
            logits = model(ids[:, s:e], cache=caches)[0]
        mx.eval(logits)
        out.append((first, logits))
    return out


def next_token_logprobs(model: Any, tokens: Sequence[int], caches: list, protocol: str = "half",
                        chunk: int = 128) -> mx.array:
    """Log-probabilities (T/2, V) for targets ``tokens[n//2:]`` under ``protocol``."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    n = len(tokens)
    h = n // 2
    ids = mx.array(list(tokens), dtype=mx.int32)[None]
    if protocol == "half":
        last = _forward(model, ids, caches, 0, h, 512, keep_from=h)[-1][1][-1:]  # position h - 1
        rest = _forward(model, ids, caches, h, n - 1, n)
        logits = mx.concatenate([last, *(lg for _, lg in rest)])
    else:
        parts = [(f, lg) for f, lg in _forward(model, ids, caches, 0, n - 1, chunk, keep_from=h - 1)
                 if f + lg.shape[0] > h - 1]
        logits = mx.concatenate([lg for _, lg in parts])[h - 1 - parts[0][0]:]
    return _log_softmax(logits)


def reference(model: Any, tokens: Sequence[int], protocol: str = "half", chunk: int = 128) -> mx.array:
    """The unquantized (float32 KVCache) log-probabilities of the same protocol."""
    lp = next_token_logprobs(model, tokens, [KVCache() for _ in model.layers], protocol, chunk)
    mx.eval(lp)
    return lp


def run_method(model: Any, tokens: Sequence[int], method: Method, ref: mx.array, protocol: str = "half",
               chunk: int = 128) -> Run:
    caches = [SimCache(i, method) for i in range(len(model.layers))]
    lp = next_token_logprobs(model, tokens, caches, protocol, chunk)
    targets = mx.array(list(tokens[len(tokens) // 2:]), dtype=mx.int32)
    scores = compare(ref, lp, targets)
    n_vec = sum(c.offset * c.keys.shape[1] for c in caches)  # tokens x kv heads, over layers
    errs = [float(sum(mx.sum(mx.stack(c.err[s])).item() for c in caches)) / n_vec for s in ("k", "v")]
    return Run(scores, *errs)
