"""Batched KV-block transfers between the pinned CPU slab and the GPU slot pool.

The one place in tierkv that owns CUDA streams and events.

Primitives:
    TransferEngine   gather_h2d / scatter_d2h: many scattered blocks in one launch, no host sync
    TransferHandle   the completion of one transfer (event, num_bytes, wait/poll/synchronize)
    CopyBackend      how an engine copies (cupy kernel, batched memcpy, torch): `copy_backend`
    pin_if_cuda      pinned copy of a CPU tensor when CUDA is available
    StreamPool       named CUDA streams of one device
    EventPool        reusable CUDA events

Importing this package imports neither cupy nor triton and does not initialize CUDA.
"""

from tierkv.transfer.device import pin_if_cuda
from tierkv.transfer.engine import TransferEngine, configured_engine
from tierkv.transfer.handle import TransferHandle
from tierkv.transfer.streams import EventPool, StreamPool

__all__ = ["EventPool", "StreamPool", "TransferEngine", "TransferHandle", "configured_engine", "pin_if_cuda"]
