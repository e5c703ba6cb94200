"""tierkv under vLLM v1: a KV connector that saves every computed block to the tiers and loads
repeated prefixes back, configured from vLLM's `kv_transfer_config`.

Primitives: `kv_transfer_config`, `CONNECTOR_NAME`, `CONNECTOR_MODULE` (no vLLM import here;
`tierkv.integrations.vllm.connector` imports vLLM).
"""
from tierkv.integrations.vllm.config import CONNECTOR_MODULE, CONNECTOR_NAME, kv_transfer_config

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "kv_transfer_config"]
