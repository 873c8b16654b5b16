"""tools/cupti_trace.py and tools/trace_step.py without a GPU: CUPTI's records as the tracer reads them (synthetic
records laid out at the offsets of cupti_activity.h 13.0), the device's busy time, and a step's summary."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import cupti_trace  # noqa: E402
import trace_step  # noqa: E402
from cupti_trace import Activity, busy_ns  # noqa: E402


def test_busy_time_is_the_union_of_overlapping_intervals():
    assert busy_ns([]) == 0
    assert busy_ns([(0, 10)]) == 10
    assert busy_ns([(5, 15), (0, 10), (20, 30)]) == 25  # unordered, overlapping, a gap
    assert busy_ns([(0, 30), (5, 10), (12, 20)]) == 30  # nested
    assert busy_ns([(0, 10), (10, 20)]) == 20  # touching


def _tracer_without_cupti():
    t = cupti_trace.Tracer.__new__(cupti_trace.Tracer)  # only the parsing: no library, no callbacks
    t._api_names = {(cupti_trace.DOMAIN_RUNTIME, 7): "cudaGraphLaunch"}
    return t


def test_records_are_read_at_cuptis_offsets():
    t = _tracer_without_cupti()
    buf = (ctypes.c_uint8 * 256)()
    base = ctypes.addressof(buf)
    name = ctypes.create_string_buffer(b"rvq_rvq_attend_mma_x")
    k = cupti_trace._KERNEL
    ctypes.c_uint32.from_address(base).value = cupti_trace.KIND_KERNEL
    ctypes.c_uint16.from_address(base + k["registers"]).value = 150
    ctypes.c_uint64.from_address(base + k["start"]).value = 1000
    ctypes.c_uint64.from_address(base + k["end"]).value = 3500
    for i, v in enumerate((344, 1, 1)):
        ctypes.c_int32.from_address(base + k["grid"] + 4 * i).value = v
    for i, v in enumerate((128, 1, 1)):
        ctypes.c_int32.from_address(base + k["block"] + 4 * i).value = v
    ctypes.c_void_p.from_address(base + k["name"]).value = ctypes.addressof(name)
    a = t._parse(base)
    assert a == Activity("kernel", "rvq_rvq_attend_mma_x", 1000, 3500, (344, 1, 1), (128, 1, 1), 150)
    assert a.us == 2.5

    ctypes.memset(base, 0, 256)
    ctypes.c_uint32.from_address(base).value = cupti_trace.KIND_MEMCPY
    ctypes.c_uint64.from_address(base + cupti_trace._COPY["bytes"]).value = 4096
    ctypes.c_uint64.from_address(base + cupti_trace._COPY["start"]).value = 10
    ctypes.c_uint64.from_address(base + cupti_trace._COPY["end"]).value = 30
    assert t._parse(base) == Activity("memcpy", "", 10, 30, nbytes=4096)

    ctypes.memset(base, 0, 256)
    ctypes.c_uint32.from_address(base).value = cupti_trace.KIND_RUNTIME
    ctypes.c_uint32.from_address(base + cupti_trace._API["cbid"]).value = 7
    ctypes.c_uint64.from_address(base + cupti_trace._API["start"]).value = 5
    ctypes.c_uint64.from_address(base + cupti_trace._API["end"]).value = 9
    assert t._parse(base) == Activity("runtime", "cudaGraphLaunch", 5, 9)

    ctypes.memset(base, 0, 256)
    ctypes.c_uint32.from_address(base).value = 99  # a kind the tracer did not ask for
    assert t._parse(base) is None


def test_a_steps_summary_counts_busy_idle_and_classes():
    acts = [
        Activity("runtime", "cudaGraphLaunch", 100, 180),
        Activity("kernel", "_ZN3mlx4core2cu11gemv_singleI6__half", 1000, 3000),
        Activity("kernel", "rvq_rvq_attend_mma_2cef", 2500, 4000),  # overlaps the gemv
        Activity("kernel", "cudnn_generated_fort_native_sdpa", 5000, 5500),  # after a gap
        Activity("memcpy", "", 6000, 6100),
        Activity("kernel", "rvq_rvq_append_inplace", 20000, 21000),  # outside the window
    ]
    r = trace_step.summarize(acts, 0, 7000, t_eval=500)
    assert r["kernels"] == 4 and r["busy_us"] == 3.6
    assert r["span_us"] == 5.1 and r["idle_in_span_us"] == 1.5  # the gaps 4000-5000 and 5500-6000
    assert r["first_kernel_us"] == 0.5 and r["tail_us"] == 0.9
    assert r["class_us"] == {"matmul": 2.0, "rvq-attend": 1.5, "sdpa": 0.5, "memcpy": 0.1}
    assert r["api_us"] == {"cudaGraphLaunch": 0.08} and r["api_count"] == {"cudaGraphLaunch": 1}
    assert trace_step.kernel_class("rvq_rvq_append_res_inplace_39e3") == "rvq-append"
    assert trace_step.kernel_class("_ZN3mlx4core2cu10copy_gg_ndI6__half") == "copy"
    assert trace_step.kernel_class("something_else") == "other"
