#!/usr/bin/env python3
"""vLLM 0.26 + LMCache 0.5.3 CPU-offload smoke test (GPU machine).
   source .vb/on-device.sh && bash .lmb/install.sh && source .lmb/env.sh && python3 .lmb/lmcache_smoke.py
Builds the tiny random Llama of .vb/smoke.py, runs the same ~2k-token prompt twice with vLLM's
own prefix caching OFF, so the 2nd prefill must come from LMCache's CPU store (look for LMCache
'Retrieved ... tokens' / hit-token log lines) and greedy outputs must match."""
import os, sys, time
os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".vb"))
from smoke import build_model_dir  # noqa: E402

def main():
    path = build_model_dir(os.environ.get("SMOKE_MODEL_DIR", "/tmp/tiny-llama-rand"))
    from vllm import LLM, SamplingParams
    llm = LLM(model=path, enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=4096,
              enable_prefix_caching=False, attention_config={"backend": "FLASH_ATTN"},
              kv_transfer_config={"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    prompt = {"prompt_token_ids": [1] + [3 + (i * 7919) % 31000 for i in range(2047)]}
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = []
    for it in range(3):
        t = time.perf_counter()
        o = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
        print(f"[lmc-smoke] run {it}: {time.perf_counter() - t:.3f}s ids={list(o)[:8]}")
        outs.append(list(o))
    print("[lmc-smoke] outputs identical:", all(x == outs[0] for x in outs))
    print("[lmc-smoke] DONE")

if __name__ == "__main__":
    main()
