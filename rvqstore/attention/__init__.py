"""Attention straight on the packed codes of an :class:`rvqstore.RVQKVCache`.

- :mod:`.ops`: the formulation in MLX ops (rotate the queries once, scores from rotated-domain code
  rows, one softmax with the full-precision window, values accumulated rotated, un-rotated once);
- :mod:`.host`: the same formulation computed with numpy, for MLX's CPU backend (its gathers and
  ``exp`` are slow there);
- :mod:`.kernel`: the split-K GPU kernel (one body for Metal and CUDA, ``kernels/rvq_attend.inc``);
- :mod:`.kernel_mma`: the same split kernel on tensor cores (CUDA, fp16 queries; ``kernels/rvq_attend_mma.inc``);
- :mod:`.fold`: a bound decode step's append folded into the tensor-core split kernel (one launch fewer a layer);
- :mod:`.launch_args`: what both split kernels' launches share (the split plan, small constant arrays);
- :mod:`.dispatch`: which of them serves a call (or decode-then-SDPA, for long prefills);
- :mod:`.hook`: how mlx-lm's models reach it without forking their code.

Design and measurements: docs/attention.md.
"""

from .dispatch import attend
from .hook import install, uninstall
from .view import CodesView

__all__ = ["attend", "install", "uninstall", "CodesView"]
