"""Where a resume's time goes: load the file, make the caches' arrays resident, first step, second step.

On a random-weight model (tools/bench_generation.py's geometry flags), caches filled to ``--context`` and
saved once; then ``--rounds`` rounds of: ``load_prompt_cache`` (timed), ``mx.eval`` of every array the
caches hold (timed: what the load left unmaterialized or on the host), the first step (timed), a second
step (timed). mlx-lm's KVCache file the same way, for the baseline. ``--upload pinned,managed``: each
``.rvq`` file loaded both through the pinned ring (:mod:`rvqstore.device_upload`) and the regular way
(``RVQSTORE_PINNED_MB=0``), interleaved in every round (``each``: the ring with one launch per section;
``pinned@N``: with N workers); ``pinned_alloc_s``: allocating the ring alone. ``--cprofile``: one more load of each
file under cProfile. Medians; JSON to ``--json``.

    python tools/profile_resume.py --model random --context 32768 --json tools/results/profile-resume.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from rvqstore import device_upload, pinned_memory  # noqa: E402
from bench_generation import add_geometry_args, build_model, fill, geometry, load, make_caches, save, step  # noqa: E402


#: device_upload.GROUP_SHARE that makes every launch one section's (no two slots fit in a group)
ONE_PER_SECTION = 1 << 40


def _arrays(caches):
    out = []
    for c in caches:
        st = c.state
        for x in (st if isinstance(st, (list, tuple)) else [st]):
            if isinstance(x, mx.array):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                out += [y for y in x if isinstance(y, mx.array)]
    return out


def _profile_loads(files, path: Path, top: int = 35) -> None:
    """One load (and ``mx.eval`` of what it holds) of each file under cProfile, the regular upload setting."""
    import cProfile
    import io
    import pstats

    text = io.StringIO()
    for key, (arm, fpath, _, up) in files.items():
        if up == "managed":
            continue
        os.environ.pop(device_upload.ENV, None)
        mx.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        cs = load(arm, fpath)
        mx.eval(_arrays(cs))
        mx.synchronize()
        prof.disable()
        for order in ("tottime", "cumulative"):
            text.write(f"==== {key}, by {order}\n")
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(top)
        del cs
    path.write_text(text.getvalue())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "random"), default="random")
    add_geometry_args(ap)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--arms", default="kv,packed-2+2,packed-4+2")
    ap.add_argument("--compress", default="auto,none")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--upload", default="pinned", help="comma list of pinned, pinned@N, each, managed (CUDA: how "
                    "sections reach the device; pinned@N with N workers; each = the pinned ring with one launch per "
                    "section, its first version)")
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cprofile", type=Path, help="after the rounds, one more load of each file under cProfile: "
                    "its functions by own and by cumulative time, as text to this path")
    a = ap.parse_args(argv)
    model, desc = build_model(a)
    n_layers, kvh, hd = geometry(model)
    dtype = getattr(mx, a.dtype)
    files = {}
    rows = {}
    with tempfile.TemporaryDirectory(dir=a.tmp) as d:
        for arm in a.arms.split(","):
            cs = make_caches(arm, n_layers)
            fill(cs, a.context, kvh, hd, dtype)
            step(model, cs, 1)
            for comp in (["auto"] if arm == "kv" else a.compress.split(",")):
                path = os.path.join(d, f"{arm}-{comp}.{'safetensors' if arm == 'kv' else 'rvq'}")
                size = save(arm, cs, path, comp)
                for up in (["-"] if arm == "kv" else a.upload.split(",")):
                    files[f"{arm}/{comp}" + ("" if up == "-" else f"/{up}")] = (arm, path, size, up)
            del cs
        times = {k: {"load": [], "read_arrays": [], "resident": [], "step1": [], "step2": []} for k in files}
        from rvqstore.snapshot import decode as snap

        read_arrays, spent = snap.read_arrays, []

        def timed(f):  # the part of a load that reads, verifies and moves the sections (the rest builds caches)
            t = time.perf_counter()
            out = read_arrays(f)
            spent.append(time.perf_counter() - t)
            return out
        snap.read_arrays = timed
        group_share, threads = device_upload.GROUP_SHARE, device_upload.THREADS
        for r in range(a.rounds):
            for key in (list(files) if r % 2 == 0 else list(files)[::-1]):
                arm, path, _, up = files[key]
                if up == "managed":
                    os.environ[device_upload.ENV] = "0"
                else:
                    os.environ.pop(device_upload.ENV, None)
                device_upload.GROUP_SHARE = ONE_PER_SECTION if up == "each" else group_share
                device_upload.THREADS = int(up.split("@")[1]) if "@" in up else threads
                mx.synchronize()
                spent.clear()
                t0 = time.perf_counter()
                cs = load(arm, path)
                t1 = time.perf_counter()
                mx.eval(_arrays(cs))
                mx.synchronize()
                t2 = time.perf_counter()
                step(model, cs, 5 + r)
                t3 = time.perf_counter()
                step(model, cs, 6 + r)
                t4 = time.perf_counter()
                for k, v in zip(("load", "read_arrays", "resident", "step1", "step2"),
                                (t1 - t0, sum(spent), t2 - t1, t3 - t2, t4 - t3)):
                    times[key][k].append(v)
                del cs
        device_upload.GROUP_SHARE, device_upload.THREADS = group_share, threads
        if a.cprofile:
            _profile_loads(files, a.cprofile)
        for key, t in times.items():
            rows[key] = {k: round(statistics.median(v), 4) for k, v in t.items()}
            rows[key]["file_bytes"] = files[key][2]
            rows[key]["resume"] = round(rows[key]["load"] + rows[key]["resident"] + rows[key]["step1"], 4)
            print(key, rows[key], flush=True)
    os.environ.pop(device_upload.ENV, None)
    alloc = None
    if device_upload.available():
        device_upload.release()
        t0 = time.perf_counter()
        buf = pinned_memory.allocate(device_upload.max_bytes())
        alloc = round(time.perf_counter() - t0, 4)
        buf.free()
        print("pinned_alloc_s", alloc, "for", device_upload.max_bytes(), "bytes")
    out = {"model": desc, "context": a.context, "device": str(mx.default_device()), "rounds": a.rounds,
           "seconds": rows, "pinned_alloc_s": alloc, "pinned_bytes": device_upload.max_bytes()}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
