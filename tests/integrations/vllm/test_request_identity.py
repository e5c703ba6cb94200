"""Block addresses name what besides the token ids makes a request's KV its own: another LoRA adapter,
another tenant's cache_salt, other images at the same placeholder tokens, prompt embeddings (vLLM fills
their token ids with zeros). Such requests got each other's KV through the tiers (found by a connector probe)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="pip install --no-deps vllm==0.26.0 (see .ci/run) to run the vLLM tests")

from tests.integrations.vllm.test_connector import engine, run_forward, schedule  # noqa: E402,F401
from tests.integrations.vllm.test_connector_failures import blocks_of  # noqa: E402
from tierkv.integrations.vllm.request_identity import chain_root  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData  # noqa: E402
from vllm.v1.request import Request  # noqa: E402


def request(req_id: str, prompt, **extra) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=4), None, **extra)


def save(scheduler, worker, caches, req: Request) -> None:
    """`req` computes its 70 tokens in blocks 0..4 and saves its 4 full blocks."""
    scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, blocks_of(range(5)), 0)
    step = schedule(request("shape", [1] * req.num_prompt_tokens), list(range(5)), 0)  # an embeddings request has
    step.scheduled_new_reqs = [NewRequestData.from_request(req, (list(range(5)),))]  # no token ids to shape it
    step.num_scheduled_tokens = {req.request_id: req.num_prompt_tokens}
    meta = scheduler.build_connector_meta(step)
    assert [len(span.block_ids) for span in meta.saves] == [4]
    run_forward(worker, caches, meta)
    scheduler.request_finished(req, list(range(5)))
    worker.store.poll(wait=True)


def adapter(name: str, int_id: int) -> LoRARequest:
    return LoRARequest(name, int_id, f"/nonexistent/{name}")


@pytest.mark.parametrize("saved, other, same", [
    ({"lora_request": adapter("a", 1)}, {"lora_request": adapter("b", 2)}, {"lora_request": adapter("a", 3)}),
    ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}, {"cache_salt": "tenant-a"}),
    ({}, {"cache_salt": "tenant-b"}, {}),
    ({"lora_request": adapter("a", 1)}, {}, {"lora_request": adapter("a", 1)}),
])
def test_the_same_tokens_under_another_adapter_or_tenant_find_nothing(engine, saved, other, same):
    scheduler, worker, caches = engine(disk=False)
    prompt = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(8)).tolist()
    save(scheduler, worker, caches, request("a", prompt, **saved))
    assert scheduler.get_num_new_matched_tokens(request("b", prompt, **other), 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(request("c", prompt, **same), 0) == (64, False)


def test_a_token_prompt_of_zeros_finds_nothing_an_embeddings_prompt_saved(engine):
    scheduler, worker, caches = engine(disk=False)
    save(scheduler, worker, caches, request("a", None, prompt_embeds=torch.randn(70, 32)))
    assert scheduler.get_num_new_matched_tokens(request("b", [0] * 70), 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(request("c", None, prompt_embeds=torch.randn(70, 32)), 0) == (0, False)


def test_roots_name_adapter_salt_media_and_embeddings_and_nothing_else():
    """Placeholder-equal prompts with other images differ; the same image at the same place agrees; a plain
    request keeps the model's own root (its blocks stay shared with every plain request)."""
    def media(identifier: str, offset: int):
        return SimpleNamespace(identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=16))

    plain = SimpleNamespace(lora_request=None, cache_salt=None, mm_features=[], prompt_embeds=None)
    cat = SimpleNamespace(**{**vars(plain), "mm_features": [media("cat", 3)]})
    assert chain_root(plain, "fp") is None
    assert chain_root(cat, "fp") == chain_root(SimpleNamespace(**vars(cat)), "fp")
    assert len({chain_root(cat, "fp"), chain_root(SimpleNamespace(**{**vars(plain), "mm_features": [media("dog", 3)]}), "fp"),
                chain_root(SimpleNamespace(**{**vars(plain), "mm_features": [media("cat", 4)]}), "fp"),
                chain_root(cat, "other-model")}) == 4
    embeds = SimpleNamespace(**{**vars(plain), "prompt_embeds": torch.zeros(2, 4)})
    assert chain_root(embeds, "fp") != chain_root(embeds, "fp")  # each request its own: nothing shared
