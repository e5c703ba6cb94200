"""tierkv inside serving engines: `hf` (a transformers Cache and attention function) and `vllm`
(KV connector, hot-window plugin and attention backend, the vLLM front end; imports vLLM lazily)."""
