"""The model after `runtime_for_model`, used as transformers users do (found by a probe): its own DynamicCache and
plain `generate` (a sliding window too) give the stock model's logits; a TieredCache is refused where its past
would not be read (another attention), where its KV would be filed under other positions or tokens (explicit
positions, the base model called directly), and for the cache operations it cannot do; under torch.compile its
host work runs eagerly and the tokens are the stock model's."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

from tests.models import build, pair
from tierkv.config import load_config
from tierkv.integrations.hf import TieredCache, forward_kwargs, restore_attention, runtime_for_model

CONFIG = {"cache": {"block_tokens": 4}, "tiers": [{"kind": "cpu", "capacity_bytes": "16MiB"}]}


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_the_models_own_cache_after_runtime_for_model_gives_the_stock_logits():
    model, ref = build("llama", num_heads=4, num_kv_heads=2, seed=0)
    runtime_for_model(model, load_config(CONFIG, env={}))
    x = ids(40)
    logits = []
    for m in (model, ref):
        cache = DynamicCache(config=m.config)
        m(x[:, :30], past_key_values=cache, use_cache=True)  # then several new tokens after cached ones
        logits.append(m(x[:, 30:], past_key_values=cache, use_cache=True).logits)
    assert (logits[0] - logits[1]).abs().max().item() < 1e-5


@torch.no_grad()
def test_a_sliding_window_models_plain_generate_after_runtime_for_model_is_the_stock_one():
    config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                           sliding_window=16, eos_token_id=None, bos_token_id=None)
    model, ref = pair(MistralForCausalLM, config, seed=0)
    runtime_for_model(model, load_config(CONFIG, env={}))
    x = ids(40)
    assert model.generate(x, max_new_tokens=6, do_sample=False).tolist() == \
        ref.generate(x, max_new_tokens=6, do_sample=False).tolist()


@torch.no_grad()
def test_a_tiered_cache_under_another_attention_is_refused():
    model, _ = build("llama", num_heads=4, num_kv_heads=2, seed=0)
    runtime = runtime_for_model(model, load_config(CONFIG, env={}))
    restore_attention(model)
    x = ids(20)
    cache = TieredCache(runtime, x[0].tolist())
    with pytest.raises(ValueError, match="the model's attention is 'sdpa'"):
        model(x, **forward_kwargs(model, cache))


@torch.no_grad()
def test_a_tiered_cache_run_by_a_model_runtime_for_model_never_prepared_is_refused_and_files_nothing():
    """A model of the same shape, other weights, never given to runtime_for_model: no guard hook runs for it, so
    the cache itself refuses (it had attended only the new tokens and filed its KV under the prompt's blocks in
    the runtime's tiers, which a later request of the prepared model reused: wrong tokens for both)."""
    model, ref = build("llama", num_heads=4, num_kv_heads=2, seed=0)
    other, _ = build("llama", num_heads=4, num_kv_heads=2, seed=5)
    runtime = runtime_for_model(model, load_config(CONFIG, env={}))
    x = ids(41)
    cache = TieredCache(runtime, x[0].tolist())
    with pytest.raises(ValueError, match="not prepared by runtime_for_model"):
        other.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False, past_key_values=cache)
    cache.finish()
    cache = TieredCache(runtime, x[0].tolist())  # the prepared model: nothing of the other's was filed
    got = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False, past_key_values=cache)
    cache.finish()
    assert got.tolist() == ref.generate(x, max_new_tokens=4, do_sample=False).tolist()


@torch.no_grad()
def test_kv_at_other_positions_or_of_other_tokens_is_never_filed_under_the_prompts_blocks():
    model, _ = build("llama", num_heads=4, num_kv_heads=2, seed=0)
    runtime = runtime_for_model(model, load_config(CONFIG, env={}))
    prompt = ids(40)
    cache = TieredCache(runtime, prompt[0].tolist())
    with pytest.raises(ValueError, match="position_ids"):
        model(prompt, **forward_kwargs(model, cache), position_ids=torch.arange(100, 140)[None])
    other = torch.cat([torch.tensor([[1]]), prompt[:, :-1]], dim=1)
    with pytest.raises(ValueError, match="fed token"):  # through the base model, past the top-level forward
        model.model(other, **forward_kwargs(model, cache))
    model(prompt, **forward_kwargs(model, cache), position_ids=torch.arange(40)[None])  # its own positions pass
    cache.finish()


def test_cache_operations_a_tiered_cache_cannot_do_are_named():
    model, _ = build("llama", num_heads=4, num_kv_heads=2, seed=0)
    cache = TieredCache(runtime_for_model(model, load_config(CONFIG, env={})))
    assert cache.get_max_cache_shape() == -1
    for call, named in ((lambda: cache.crop(2), "cannot be cropped"), (lambda: cache.reorder_cache(None), "beam"),
                        (lambda: cache.batch_repeat_interleave(2), "num_return_sequences"),
                        (lambda: cache.batch_select_indices([0]), "batch")):
        with pytest.raises(NotImplementedError, match=named):
            call()
    cache.finish()


@torch.no_grad()
def test_under_torch_compile_the_tokens_are_the_stock_models():
    model, ref = build("llama", num_heads=4, num_kv_heads=2, seed=0)
    runtime = runtime_for_model(model, load_config(CONFIG, env={}))
    x = ids(40)
    compiled = torch.compile(model, backend="eager")
    cache = TieredCache(runtime, x[0].tolist())
    logits, tokens = compiled(x, **forward_kwargs(model, cache)).logits[0, -1], []
    for _ in range(4):
        token = logits.argmax().view(1, 1)
        tokens.append(int(token))
        logits = compiled(token, **forward_kwargs(model, cache)).logits[0, -1]
    cache.finish()
    assert tokens == ref.generate(x, max_new_tokens=4, do_sample=False)[0, 40:].tolist()
