"""Long real documents with a planted fact, as chat prompts, and the all-in-memory reference answer.

Primitives: `haystack_text`, `plant`, `passkey_case`, `multikey_case`, `chat_ids`, `dense_greedy`.

The haystack is real text that ships with the OS: the GNU GPL v3 in Debian's common-licenses
(the licence permits verbatim copies; the planted sentence is added in memory only, nothing is
written), else Python's own LICENSE. Text shorter than asked for is repeated.

    case = passkey_case(tokenizer, num_tokens=4096, depth=0.5, seed=0)
    case.prompt_ids, case.question, case.answer      # the answer appears in the model's reply
"""
from __future__ import annotations

import os
import random
import sysconfig
from dataclasses import dataclass

import torch

HAYSTACKS = ("/usr/share/common-licenses/GPL-3", os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt"))
KEY_NAMES = ("apple", "river", "copper", "falcon", "maple", "violet", "harbor", "cedar")


@dataclass(frozen=True)
class Case:
    """One retrieval prompt: chat-template token ids, the question asked, the expected answer text."""

    prompt_ids: list[int]
    question: str
    answer: str
    depth: float
    source: str
    answer_prefix: str = ""

    def prompt_with_prefix(self, tokenizer) -> list[int]:
        """The prompt followed by the start of the answer ("The secret pass key is"), so a few greedy
        tokens hold the key (as RULER scores retrieval)."""
        return self.prompt_ids + tokenizer(self.answer_prefix, add_special_tokens=False)["input_ids"]


def haystack_text() -> tuple[str, str]:
    """(text, where it came from): the first readable of `HAYSTACKS`; FileNotFoundError naming them."""
    for path in HAYSTACKS:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read(), path
    raise FileNotFoundError(f"no haystack text found; looked for {', '.join(HAYSTACKS)}")


def plant(tokenizer, text: str, num_tokens: int, facts: list[tuple[float, str]]) -> str:
    """The first `num_tokens` tokens of `text` (repeated as needed) with each (depth in [0, 1], sentence)
    inserted at the paragraph or line break nearest that depth."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("plant: the haystack text is empty")
    ids = (ids * (num_tokens // len(ids) + 1))[:num_tokens]
    body = tokenizer.decode(ids)
    for depth, sentence in sorted(facts, reverse=True):  # from the end, so earlier offsets stay valid
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"plant: depth {depth} is not in [0, 1]")
        at = _break_near(body, int(depth * len(body)))
        body = f"{body[:at]}\n{sentence}\n{body[at:]}"
    return body


def _break_near(body: str, at: int) -> int:
    if at <= 0 or at >= len(body):
        return max(0, min(at, len(body)))
    before, after = body.rfind("\n", 0, at), body.find("\n", at)
    candidates = [i for i in (before, after) if i >= 0]
    return min(candidates, key=lambda i: abs(i - at)) if candidates else at


def chat_ids(tokenizer, document: str, question: str) -> list[int]:
    """The document and question as one user turn in the tokenizer's chat template, ready to answer."""
    messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def passkey_case(tokenizer, num_tokens: int, depth: float, seed: int) -> Case:
    """A five-digit pass key planted at `depth` of a `num_tokens`-token document."""
    key = str(random.Random(seed).randrange(10000, 100000))
    text, source = haystack_text()
    document = plant(tokenizer, text, num_tokens, [(depth, f"The secret pass key is {key}. Remember it.")])
    question = "What is the secret pass key mentioned in the text?"
    return Case(chat_ids(tokenizer, document, question), question, key, depth, source, "The secret pass key is")


def multikey_case(tokenizer, num_tokens: int, depth: float, seed: int, num_keys: int = 4) -> Case:
    """`num_keys` named five-digit keys spread through the document; the one at `depth` is asked for."""
    rng = random.Random(seed)
    names = rng.sample(KEY_NAMES, num_keys)
    keys = [str(rng.randrange(10000, 100000)) for _ in names]
    others = [d for d in (0.15, 0.4, 0.65, 0.9) if abs(d - depth) > 0.1][: num_keys - 1]
    facts = [(depth, f"The pass key for {names[0]} is {keys[0]}.")]
    facts += [(d, f"The pass key for {n} is {k}.") for d, n, k in zip(others, names[1:], keys[1:])]
    text, source = haystack_text()
    document = plant(tokenizer, text, num_tokens, facts)
    question = f"What is the pass key for {names[0]} mentioned in the text?"
    return Case(chat_ids(tokenizer, document, question), question, keys[0], depth, source,
                f"The pass key for {names[0]} is")


@torch.no_grad()
def greedy_continue(model, kwargs: dict, logits: torch.Tensor, max_new_tokens: int, stop_ids: set[int],
                    on_token=None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens from the prompt's last `logits` [vocab] on, one forward per token with the cache
    in `kwargs`, and each step's logits (float32, CPU); `on_token(token)` before each forward."""
    device = logits.device
    tokens, all_logits = [], []
    while True:
        all_logits.append(logits.float().cpu())
        token = int(torch.argmax(logits))
        tokens.append(token)
        if token in stop_ids or len(tokens) >= max_new_tokens:
            return tokens, all_logits
        if on_token is not None:
            on_token(token)
        logits = model(input_ids=torch.tensor([[token]], device=device), **kwargs).logits[0, -1]


@torch.no_grad()
def dense_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                 chunk_tokens: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's logits [vocab] (float32, CPU) from transformers' own attention
    (SDPA) over a DynamicCache: the all-in-memory reference. Leaves the model's attention as it found it.

    `chunk_tokens`: prefill in pieces of that many tokens (None: one forward for the prompt).
    """
    from transformers import DynamicCache

    from tierkv.integrations.hf import forward_kwargs

    device = next(model.parameters()).device
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        kwargs = forward_kwargs(model, DynamicCache(config=model.config))
        step = chunk_tokens or len(prompt_ids)
        for pos in range(0, len(prompt_ids), step):
            piece = torch.tensor([prompt_ids[pos : pos + step]], device=device)
            logits = model(input_ids=piece, logits_to_keep=1, **kwargs).logits[0, -1]
        return greedy_continue(model, kwargs, logits, max_new_tokens, stop_ids)
    finally:
        model.set_attn_implementation(previous)
