#!/usr/bin/env python3
"""Resource bounds of the .rvq reader (issue 12.5 / 12.6): time and peak memory of

* opening a valid-length 16 MiB header made of ~16.7 M empty arrays under an unknown key, and
* ``verify`` (checksums + codec decode) of a file whose 1-bit dim-32768 float32 codes decode to ~32x
  their size (zstd on top of that was the issue's 1,000-1,500x case).

Each case runs in a fresh subprocess (peak RSS is per process), against the package found under
``--root`` (default: this checkout), so an older checkout can be measured the same way:

    python tools/bench_format_bounds.py [--root OLD_CHECKOUT] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASE = r'''
import json, os, resource, sys, time
sys.path.insert(0, {root!r})
import msgpack
import rvqstore.format as F
from rvqstore.format.checksum import checksum
from rvqstore.format.preamble import pack_preamble
case = {case!r}
p = {path!r}
if case == "header":
    base = dict(format_version=[1, 0], required_features=[], sections=[], n_tokens=0, layers=[],
                quantizer=None, model=None, metadata={{}})
    h = msgpack.packb(dict(base, junk=[[[]] * 65535] * 255), use_bin_type=True)
    open(p, "wb").write(pack_preamble(header_offset=64, header_length=len(h), header_checksum=checksum(h),
                                      file_length=64 + len(h)) + h)
    del h
    def run():
        try:
            F.open_rvq(p).close()
            return "opened"
        except F.FormatError as e:
            return type(e).__name__
elif case == "make":
    import mlx.core as mx
    from rvqstore import RVQCodec
    D, H, T = 32768, 4, 512
    codec = RVQCodec(D, (1, 0), use_kernels=False)
    e = codec.encode(mx.random.normal((1, H, T, D), key=mx.random.key(0)))
    secs = []
    for side in ("keys", "values"):
        secs += [F.Section(f"layers.0.{{side}}.codes1", 0, f"{{side}}.codes1", e.codes1),
                 F.Section(f"layers.0.{{side}}.scales", 0, f"{{side}}.scales", e.scales)]
    F.write_rvq(p, dict(n_tokens=T, quantizer=codec.to_header(), model=None, metadata={{}},
                        layers=[dict(index=0, kind="rvq", batch=1, n_kv_heads=H, head_dim=D, n_tokens=T,
                                     n_dense_tokens=0, key_dtype="float32", value_dtype="float32")]), secs,
                compress="none")
    sys.exit(0)
else:  # verify the file "make" wrote, in a fresh process
    from rvqstore.format.quantizer import decode_layers
    def run():
        with F.open_rvq(p) as f:
            f.verify(decode=decode_layers)
        return "verified"
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
out = run()
dt = time.perf_counter() - t
print(json.dumps(dict(case=case, outcome=out, seconds=dt, file_bytes=os.path.getsize(p),
                      peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      rss_before_mib=rss0 / 1024)))
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    results = {}
    tmp = tempfile.mkdtemp()
    amp = os.path.join(tmp, "amp.rvq")
    subprocess.run([sys.executable, "-c", CASE.format(root=args.root, case="make", path=amp)], check=True,
                   timeout=600)
    for case in ("header", "verify"):
        runs = []
        for _ in range(args.repeat):
            path = amp if case == "verify" else os.path.join(tmp, "header.rvq")
            r = subprocess.run([sys.executable, "-c", CASE.format(root=args.root, case=case, path=path)],
                               capture_output=True, text=True, timeout=600)
            if r.returncode:
                print(r.stderr[-2000:], file=sys.stderr)
                return 1
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        results[case] = dict(outcome=runs[0]["outcome"], file_bytes=runs[0]["file_bytes"],
                             median_seconds=statistics.median(x["seconds"] for x in runs),
                             median_peak_rss_mib=statistics.median(x["peak_rss_mib"] for x in runs),
                             rss_before_mib=statistics.median(x["rss_before_mib"] for x in runs))
        print(case, json.dumps(results[case]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
