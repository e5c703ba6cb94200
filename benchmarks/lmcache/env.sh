# Source AFTER .vb/on-device.sh and .lmb/install.sh:  source .lmb/env.sh
# LMCache dir goes AFTER /tmp/vsite; install.sh only put packages there that were missing.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}${LMSITE:-/tmp/lmsite}"
# no network on the GPU box: no usage telemetry (stats.lmcache.ai)
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
# CPU offload config (read by LMCacheEngineConfig.from_env when LMCACHE_CONFIG_FILE is unset).
# Alternatively: export LMCACHE_CONFIG_FILE=$PWD/.lmb/lmcache-cpu.yaml (env vars still override).
export LMCACHE_CHUNK_SIZE=${LMCACHE_CHUNK_SIZE:-256}
export LMCACHE_LOCAL_CPU=${LMCACHE_LOCAL_CPU:-True}
export LMCACHE_MAX_LOCAL_CPU_SIZE=${LMCACHE_MAX_LOCAL_CPU_SIZE:-20}   # GB of pinned host RAM
export LMCACHE_INTERNAL_API_SERVER_ENABLED=False
