"""rvqstore.kernel_cache on a CUDA device: the precompiled kernels equal MLX's JIT ones, across processes.

Parity: a workload (packed and resident caches at several bits, head dims and dtypes; attention with and
without a window; the codec's fused encode and decode) runs with every kernel call recorded; each
recorded call is then launched twice more, from the cached binary (``mx.fast.precompiled_cuda_kernel``)
and through ``mx.fast.cuda_kernel`` with the same source, and the outputs must be bit-identical. With
RVQ_KERNEL_CACHE_PARITY_REPORT=path each comparison appends a line there
(tools/results/gpu-parity-kernel-cache.txt).

Across processes: a fresh process fills an empty cache directory (NVRTC, first-use checks run and
kept); a second compiles nothing, loads every kernel from the files and skips the checks; a corrupt file
is ignored and rebuilt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQCodec, RVQKVCache, fused, kernel_cache, kernel_ref
from rvqstore.attention import kernel_mma
from subprocess_env import python_path

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
REPORT = os.environ.get("RVQ_KERNEL_CACHE_PARITY_REPORT")


def _cuda():
    if fused.gpu_backend() != "cuda":
        pytest.skip("the kernel cache serves CUDA only")


def _same(a: mx.array, b: mx.array) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {2: mx.uint16, 4: mx.uint32, 1: mx.uint8}[a.dtype.size]
    return bool(mx.array_equal(a.view(bits), b.view(bits)).item())


def _workload():
    rng = np.random.default_rng(0)
    for bits, d, dtype, hkv, g, window, mode in [((2, 2), 128, mx.float16, 8, 4, 0, "packed"),
                                                 ((4, 2), 128, mx.bfloat16, 2, 4, 0, "packed"),
                                                 ((2, 2), 64, mx.float16, 2, 8, 16, "packed"),
                                                 ((2, 2), 128, mx.float16, 2, 4, 0, "resident"),
                                                 ((1, 1), 64, mx.float32, 2, 1, 0, "packed")]:
        c = RVQKVCache(bits, mode=mode, dense_window=window, flush_block=8)
        k = mx.array(rng.standard_normal((1, hkv, 300, d)).astype(np.float32)).astype(dtype)
        c.update_and_fetch(k[:, :, :255], k[:, :, :255] * 0.5)  # 256 slots: in place, a copy growing, in place
        for t in range(3):
            kk, vv = c.update_and_fetch(k[:, :, t:t + 1], k[:, :, t + 1:t + 2])
            mx.eval(kk, vv)
        q = mx.array(rng.standard_normal((1, hkv * g, 1, d)).astype(np.float32)).astype(dtype)
        mx.eval(c.attend_on_codes(q, scale=d ** -0.5))
        if dtype == mx.float16 and not window:  # also the tensor-core kernel with the merge fused into it
            before, kernel_mma.FUSED_MERGE = kernel_mma.FUSED_MERGE, True
            try:
                mx.eval(c.attend_on_codes(q, scale=d ** -0.5))
            finally:
                kernel_mma.FUSED_MERGE = before
    for bits, d in [((2, 2), 128), ((3, 1), 96), ((4, 0), 64)]:
        codec = RVQCodec(d, bits)
        x = mx.array(rng.standard_normal((37, d)).astype(np.float32))
        mx.eval(codec.decode(codec.encode(x)))


def test_gpu_precompiled_kernels_equal_the_jit_kernels(monkeypatch, tmp_path):
    _cuda()
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "kc"))
    calls: dict = {}
    real = kernel_cache.CudaKernel.__call__

    def record(self, **kw):
        key = (self.name, tuple(kw.get("template") or []), tuple(a.dtype for a in kw["inputs"]))
        calls.setdefault(key, (self, kw))
        return real(self, **kw)

    monkeypatch.setattr(kernel_cache.CudaKernel, "__call__", record)
    _workload()
    monkeypatch.setattr(kernel_cache.CudaKernel, "__call__", real)
    names = {k[0].rsplit("_", 1)[0] for k in calls}
    # every configuration's first launch found its module by reference: later launches pass ~90 bytes
    refs = [e for k, _ in calls.values() for e in k._entries.values() if e is not None]
    assert refs and all(e[3].startswith(b"rvqstore-kernel:") and e[3] != e[1] for e in refs) and kernel_ref.enabled()
    for kind in ("rvq_encode", "rvq_decode", "rvq_append", "rvq_append_res", "rvq_append_copy",
                 "rvq_append_inplace", "rvq_unpack", "rvq_attend_attend", "rvq_attend_merge", "rvq_attend_mma_fused"):
        assert any(n == kind or n.startswith(kind + "2") or n.startswith(kind + "1") for n in names), (kind, names)
    failed = []
    for (name, template, _), (kern, kw) in calls.items():
        # MLX's JIT callable takes its dynamic shared memory when it is made (CudaKernel.jit), not per call
        jit_kernel, kw_jit = kern.jit(kw.get("shared_memory", 0)), {k: v for k, v in kw.items() if k != "shared_memory"}
        if "_inplace" in name:  # it writes into its inputs 8..13 (the buffers): each launch into copies, compared
            ins = kw["inputs"]
            bufs = [[(a.view(mx.uint32 if a.dtype.size == 4 else mx.uint16) | 0).view(a.dtype) for a in ins[8:14]]
                    for _ in range(2)]
            mx.eval(bufs)
            done_pre = kern(**dict(kw, inputs=ins[:8] + bufs[0]))
            assert kern.precompiled() > 0, f"{name} did not launch from a cached binary"
            done_jit = jit_kernel(**dict(kw_jit, inputs=ins[:8] + bufs[1]))
            mx.eval(done_pre, done_jit)
            pre, jit = done_pre + bufs[0], done_jit + bufs[1]
        elif "_fused" in name:  # the fused merge counts its threadgroups in its last input (a counter slot, zero
            # between launches): the two launches, which may run at once, get a zeroed slot each
            ins = kw["inputs"]
            pre = kern(**dict(kw, inputs=ins[:-1] + [mx.zeros_like(ins[-1])]))
            assert kern.precompiled() > 0, f"{name} did not launch from a cached binary"
            jit = jit_kernel(**dict(kw_jit, inputs=ins[:-1] + [mx.zeros_like(ins[-1])]))
            mx.eval(pre, jit)
        else:  # launched by reference (rvqstore.kernel_ref) and with the binary, against the JIT kernel
            pre = kern(**kw)
            assert kern.precompiled() > 0, f"{name} did not launch from a cached binary"
            with monkeypatch.context() as m:
                m.setattr(kernel_ref, "BY_REFERENCE", False)
                pre_binary = kern(**kw)
            jit = jit_kernel(**kw_jit)
            mx.eval(pre, pre_binary, jit)
            pre = pre + pre_binary
            jit = jit + jit
        if "_copy" in name:  # whole new buffers: only the first n + t tokens are written (the rest is capacity)
            rows = int(kw["inputs"][7][0].item()) + int(kw["inputs"][6][1].item())  # cnt = [n]; params [nk, t, ..]
            pre, jit = [a[:, :, :rows] for a in pre], [a[:, :, :rows] for a in jit]
        ok = all(_same(a, b) for a, b in zip(pre, jit))
        if REPORT:
            with open(REPORT, "a") as f:
                f.write(f"{name}\t{'pass' if ok else 'FAIL'}\t{dict(template)}\n")
        if not ok:
            failed.append((name, template))
    assert not failed, failed


def _fresh_process(cache: Path, extra: str = "", before: str = "", env: dict | None = None) -> dict:
    code = f"""
import hashlib, json, mlx.core as mx
from rvqstore import RVQKVCache, kernel_cache, kernel_ref
{before}
mx.random.seed(1)
c = RVQKVCache((2, 2))
k = mx.random.normal((1, 2, 64, 128)).astype(mx.float16)
c.update_and_fetch(k, k)
c.update_and_fetch(k[:, :, :1], k[:, :, :1])
mx.random.seed(0)
out = c.attend_on_codes(mx.random.normal((1, 8, 1, 128)).astype(mx.float16), scale=0.1)
mx.eval(c.state, out)
{extra}
print(json.dumps(dict(kernel_cache.stats, out=hashlib.sha256(bytes(memoryview(out.view(mx.uint16)))).hexdigest())))
"""
    env = dict(os.environ, PYTHONPATH=python_path(ROOT), **{kernel_cache.ENV: str(cache)}, **(env or {}))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_gpu_a_second_process_compiles_nothing_and_skips_the_checks(tmp_path):
    _cuda()
    first = _fresh_process(tmp_path)
    assert first["compiled"] >= 4 and first["loaded"] == 0 and first["jit_launches"] == 0
    assert first["by_reference"] >= 4
    files = sorted(p.name for p in (tmp_path / mx.__version__).iterdir())
    assert sum(f.endswith(".bin") for f in files) == first["compiled"]
    assert any(f.endswith(".verdict") for f in files)
    second = _fresh_process(tmp_path)
    assert second["compiled"] == 0 and second["loaded"] >= 4 and second["jit_launches"] == 0
    assert second["verdicts_kept"] >= 2 and second["by_reference"] >= 4
    assert second["out"] == first["out"]
    # damaged files are not used: compiled again and replaced
    for victim in (tmp_path / mx.__version__).glob("*.bin"):
        data = bytearray(victim.read_bytes())
        data[-100] ^= 0xFF
        victim.write_bytes(bytes(data))
    third = _fresh_process(tmp_path)
    assert third["compiled"] == second["loaded"] and third["loaded"] == 0 and third["jit_launches"] == 0
    # the files of the kernels it ran are whole again (checks skipped: the codec's encode kernel, which only the
    # first process's checks ran, keeps its damaged file until a process needs it)
    assert sum(kernel_cache._unpack(p.stem, p.read_bytes()) is not None
               for p in (tmp_path / mx.__version__).glob("*.bin")) == third["compiled"]


def test_gpu_where_mlx_does_not_find_the_reference_the_binaries_launch(tmp_path):
    """MLX looking elsewhere than rvqstore.kernel_ref publishes: each kernel's first launch by reference
    fails to load, the binary's runs instead, with the same result, and later kernels go straight to it."""
    _cuda()
    good = _fresh_process(tmp_path / "kc1")
    # MLX reads an empty directory of its own; rvqstore publishes elsewhere
    broken = _fresh_process(tmp_path / "kc2", env={"MLX_PTX_CACHE_DIR": str(tmp_path / "mlx-reads")}, before=(
        f"kernel_ref.mlx_cache_dir = lambda: __import__('pathlib').Path({str(tmp_path / 'elsewhere')!r})"))
    assert good["by_reference"] >= 4 and broken["by_reference"] == 0
    assert broken["jit_launches"] == 0 and broken["compiled"] == good["compiled"] and broken["out"] == good["out"]


def test_gpu_without_nvrtc_the_kernels_still_run_through_mlx(tmp_path):
    _cuda()
    code_break = ("import rvqstore.kernel_cache as kc\n"
                  "def _no(*a, **k):\n    raise kc.NvrtcError('no NVRTC here')\n"
                  "kc.compile_source = _no\n")
    env = dict(os.environ, PYTHONPATH=python_path(ROOT), **{kernel_cache.ENV: str(tmp_path / "broken")})
    code = code_break + """
import json, mlx.core as mx
from rvqstore import RVQKVCache, cache_append, kernel_cache
c = RVQKVCache((2, 2))
k = mx.random.normal((1, 2, 64, 128)).astype(mx.float16)
c.update_and_fetch(k, k)
mx.eval(c.state, c.attend_on_codes(mx.random.normal((1, 8, 1, 128)).astype(mx.float16), scale=0.1))
print(json.dumps([kernel_cache.stats, cache_append.disabled()]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    st, disabled = json.loads(r.stdout.strip().splitlines()[-1])
    assert st["compiled"] == 0 and st["loaded"] == 0 and st["jit_launches"] > 0 and disabled == {}
