"""The transformers engine: the runtime one model uses, the KV cache of a sequence, and what runs on it.

    runtime.py       `KVRuntime`: tiers, GPU pool, transfer engine, scheduler, counters
    elastic.py       `resize_hot_window`: the GPU hot window resized at run time
    sequence.py      `SequenceKV`: one sequence's KV cache, all layers (append, attend, finish)
    prefix.py        `load_prefix`: the longest run of a prompt's blocks held in any tier, loaded
    graph_step.py    `GraphStep`: one decode step in the form a CUDA graph can replay
    decode_graph.py  `DecodeStep`: the one-token decode step replayed from one CUDA graph

The model side (transformers' cache interface) is `tierkv.integrations.hf`; the front end `tierkv.llm`.
"""
