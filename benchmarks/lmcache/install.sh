#!/usr/bin/env bash
# Offline install of LMCache 0.5.3 (+ the few deps the GPU machine lacks) into a target dir.
# Run on the GPU machine AFTER `source .vb/on-device.sh` (so /tmp/vsite is on PYTHONPATH and
# already-present packages are detected and skipped, never shadowed).
# Usage:  bash .lmb/install.sh [/tmp/lmsite]      then: source .lmb/env.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dest=${1:-/tmp/lmsite}
if [ -f "$dest/.lmcache-ok" ]; then echo "[lmcache] already installed in $dest"; exit 0; fi
rm -rf "$dest" && mkdir -p "$dest"
python3 - "$here" "$dest" <<'PY'
import glob, importlib.util, os, shutil, sys, zipfile
here, dest = sys.argv[1], sys.argv[2]
# distribution (wheel file prefix) -> import name used to detect an existing install
probe = {"aiofile": "aiofile", "caio": "caio", "sortedcontainers": "sortedcontainers",
         "uvicorn": "uvicorn", "cryptography": "cryptography", "cffi": "cffi",
         "pycparser": "pycparser", "annotated_doc": "annotated_doc", "h11": "h11",
         "click": "click", "lmcache": None}  # lmcache: always install
have_crypto = importlib.util.find_spec("cryptography") is not None
for whl in sorted(glob.glob(os.path.join(here, "wheels", "*.whl"))):
    dist = os.path.basename(whl).split("-")[0]
    mod = probe.get(dist, dist)
    if dist in ("cffi", "pycparser") and not have_crypto:
        mod = None  # cryptography 50 needs cffi>=2.0: install ours alongside it
    if mod and importlib.util.find_spec(mod) is not None:
        print(f"[lmcache] skip {dist}: already importable"); continue
    zipfile.ZipFile(whl).extractall(dest)
    print(f"[lmcache] extracted {os.path.basename(whl)}")
if importlib.util.find_spec("numba") is None:
    shutil.copytree(os.path.join(here, "numba_shim", "numba"), os.path.join(dest, "numba"))
    print("[lmcache] numba not found: installed no-op numba shim (njit = identity)")
PY
touch "$dest/.lmcache-ok"
# quick check: the compiled CUDA extension must load against this torch (2.11+cu130)
PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$dest" python3 -c "
import glob, importlib.util, torch
so = glob.glob('$dest/lmcache/c_ops.cpython-*.so')[0]
spec = importlib.util.spec_from_file_location('c_ops', so)
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
print('[lmcache] native c_ops loads against torch', torch.__version__)
import lmcache.integration.vllm.vllm_v1_adapter as a
print('[lmcache] adapter import OK, device', __import__('lmcache').torch_device_type)
"
