"""Attention straight on the packed codes, written with MLX ops (every backend; on MLX's CPU backend the
fallback of :mod:`.host`, which computes the same formulation with numpy).

The codec stores a key as ``k = (H^T y_k / D) * signs * s_k`` (``y_k`` the centroid values picked by
the codes, ``s_k`` the bfloat16 norm; see :mod:`rvqstore.codec`). Since the rotation is orthogonal up
to ``D``, ``q . k = s_k * (q_rot . y_k)`` with ``q_rot = H(q * signs) / D`` computed once per query.
So per step:

1. rotate the queries once per head;
2. ``y`` of keys and values from the codes with the codec's group tables (no inverse rotation, no
   rescale, no cast per token: :meth:`RVQCodec.dequantize`), scores = ``s_k * (q_rot @ y_k^T)``;
3. one softmax over the coded tokens and the full-precision window together (plus sinks);
4. values accumulate in the rotated domain, ``o_rot = (p * s_v) @ y_v``, un-rotated once per head
   and query; the window's values join in the natural domain.

GQA: the ``G = n_heads / n_kv_heads`` query heads of a group share each decoded code row (queries are
viewed as ``(B, Hkv, G * L, D)``, so one matmul serves the group).
"""

from __future__ import annotations

import mlx.core as mx

from .. import hadamard
from . import masks
from .view import CodesView


def rotate_queries(view: CodesView, queries: mx.array, scale: float) -> mx.array:
    """``H(q * signs) * scale / D`` in float32: scores against rotated-domain keys need nothing else."""
    kc = view.key_codec
    return hadamard.forward(queries.astype(mx.float32) * kc._signs_mx) * (scale / kc.dim)


def unrotate_output(view: CodesView, o_rot: mx.array) -> mx.array:
    """Values' inverse rotation, applied once to the accumulated output (it is linear)."""
    vc = view.value_codec
    return hadamard.inverse(o_rot, 1.0 / vc.dim) * vc._signs_mx


def attend(view: CodesView, queries: mx.array, scale: float, mask=None, sinks: mx.array | None = None) -> mx.array:
    """Attention of ``queries`` ``(B, n_heads, L, Dk)`` over the cache seen through ``view``.

    Same contract as ``mx.fast.scaled_dot_product_attention(queries, K, V, scale=, mask=, sinks=)``
    on the decoded keys/values; returns ``(B, n_heads, L, Dv)`` in the queries' dtype.
    """
    b, hq, l, dk = queries.shape
    hkv, g = view.n_kv_heads, hq // view.n_kv_heads
    q_rot = rotate_queries(view, queries, scale).reshape(b, hkv, g * l, dk)
    parts = []  # scores of coded tokens, then of the window, (B, Hkv, G*L, *)
    if view.n_coded:
        yk, ks = view.rotated_keys()
        parts.append((q_rot @ yk.swapaxes(-1, -2)) * ks[:, :, None, :])
    if view.n_dense:
        qd = (queries.astype(mx.float32) * scale).reshape(b, hkv, g * l, dk)
        parts.append(qd @ view.dense_keys.astype(mx.float32).swapaxes(-1, -2))
    scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    t = scores.shape[-1]
    scores = masks.apply(scores.reshape(b, hkv, g, l, t), mask)
    if sinks is not None:  # a per-head logit that takes part in the normalization only
        sk = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, hkv, g, 1, 1), (b, hkv, g, l, 1))
        scores = mx.concatenate([sk, scores], axis=-1)
    p = mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        p = p[..., 1:]
    p = p.reshape(b, hkv, g * l, t)
    out = None
    if view.n_coded:
        yv, vs = view.rotated_values()
        n = view.n_coded
        out = unrotate_output(view, (p[..., :n] * vs[:, :, None, :]) @ yv)
    if view.n_dense:
        od = p[..., t - view.n_dense:] @ view.dense_values.astype(mx.float32)
        out = od if out is None else out + od
    return out.reshape(b, hq, l, -1).astype(queries.dtype)
