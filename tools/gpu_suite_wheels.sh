#!/usr/bin/env bash
# Wheels the WHOLE test suite needs on the GPU machine beyond ../shared/gpu/prepare.sh (which brings
# mlx, mlx-cuda, mlx-lm, zstandard, xxhash): pytest-xdist (the suite in ~8 min on 14 workers instead of
# >30 min serially), obstore + moto[s3] + flask (the S3 tests start a moto server on loopback there too),
# constriction (the entropy-coding tests). Two folders, each under a run's 64 MiB carry limit with .gpu/b.
# Used for tools/results/suite-gpu.txt:
#   run 1, carry [".gpu/a"]:           mkdir -p /root/stash && cp .gpu/a/* /root/stash/
#   run 2, carry [".gpu/c", ".gpu/d"]: mkdir -p /root/stash2 && cp .gpu/c/* .gpu/d/* /root/stash2/
#   run 3, carry [".gpu/b"]:           bash .gpu/b/install-on-device.sh &&
#       python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/site /root/stash2/*.whl &&
#       export PYTHONPATH=/root/site:$PWD && python3 -m pytest -q -rfE -p no:cacheprovider -n 14 > $OUT/suite.txt
set -euo pipefail
cd "$(dirname "$0")/.."
pip=${PIP:-.venv/bin/pip}
plat=(--python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux_2_28_x86_64)
mkdir -p .gpu/c .gpu/d
"$pip" download -q --no-deps "${plat[@]}" -d .gpu/c pytest-xdist execnet obstore constriction
"$pip" download -q "${plat[@]}" -d .gpu/d "moto[s3]==5.2.5" flask flask_cors
du -sh .gpu/c .gpu/d
