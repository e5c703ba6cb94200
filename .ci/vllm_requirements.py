"""Print vLLM's own requirements minus the ones that would replace the CPU torch build or need a
GPU; .ci/run installs them after `pip install --no-deps vllm` so `import vllm` works on CPU."""
import importlib.metadata
import re

SKIP = {"torch", "torchaudio", "torchvision", "xformers", "flashinfer-python", "flashinfer-cubin", "nvidia-cutlass-dsl",
        "triton", "ray", "cupy-cuda12x", "quack-kernels", "deep-gemm", "tilelang", "torchcodec", "pynvvideocodec",
        "nvidia-cudnn-frontend", "nvtx", "fastsafetensors", "tokenspeed-mla", "humming-kernels"}

for requirement in importlib.metadata.requires("vllm") or []:
    if "extra ==" in requirement:
        continue
    name = re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")
    if name not in SKIP:
        print(requirement)
