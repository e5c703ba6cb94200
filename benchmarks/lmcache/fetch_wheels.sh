#!/usr/bin/env bash
# Download the wheels of the LMCache 0.5.3 bundle (on a machine with a package index), check them
# against SHA256SUMS, and assemble <repo>/.lmb/ to carry to the GPU machine (README.md here).
#   bash benchmarks/lmcache/fetch_wheels.sh [DEST=.lmb]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dest=${1:-.lmb}
mkdir -p "$dest/wheels"
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest/wheels" lmcache==0.5.3 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 uvicorn==0.55.0 \
    sortedcontainers==2.4.0 caio==0.12.10 aiofile==3.12.3 click==8.5.1 h11==0.16.0 annotated-doc==0.0.7
cp -r "$here"/README.md "$here"/SHA256SUMS "$here"/env.sh "$here"/install.sh "$here"/lmcache-cpu.yaml \
    "$here"/lmcache_smoke.py "$here"/numba_shim "$dest"/
(cd "$dest" && sha256sum -c --quiet SHA256SUMS)
du -sh "$dest"
