"""Prompts as users hand them over, turned into text or lists of token ids, or refused.

Primitives: `normalize_prompts` (what `generate()` accepts, for every backend), `token_ids`
(one prompt's ids, checked), `PromptError`.

Accepted, as one prompt or a batch of them:

    "text"                                  one text prompt (the backend tokenizes it)
    [1, 2, 3] / (1, 2, 3)                   one prompt: Python ints, numpy integers, 0-d int tensors
    tensor [n] / ndarray [n]                one prompt: any integer dtype (not bool), any device
    tensor [b, n] / ndarray [b, n]          a batch of b prompts of n tokens
    {"input_ids": ..., "attention_mask": ...}   a tokenizer's BatchEncoding or a dict: input_ids
                                            as any of the above; positions whose mask is 0 (padding) are dropped
    ["text", [1, 2], tensor [n], ...]       a batch of any of the one-prompt forms

Refused before any work, with `PromptError` naming the request and the token: None, bytes,
empty prompts or batches, bools, floats, strings where ids are due, tensors of float or bool
dtype or of 0 or more than 2 dimensions, negative ids and ids >= the vocabulary size.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


MAX_TOKEN_ID = 1 << 63  # exclusive; the bound when the vocabulary size is not known


class PromptError(ValueError, TypeError):
    """A prompt `generate()` cannot run; a ValueError and a TypeError, whichever a caller catches."""


def normalize_prompts(prompts: Any, *, vocab_size: int | None, text_error: str | None = None) -> list[str | list[int]]:
    """`prompts` (any accepted form, see the module doc) -> one entry per request: text, or a list of
    token ids checked against [0, vocab_size) (vocab_size None: only >= 0). text_error: None when text
    is accepted, else the reason it is not (raised for a text prompt)."""
    if isinstance(prompts, Mapping):
        batch = _from_encoding(prompts)
    elif isinstance(prompts, (torch.Tensor, np.ndarray)):
        batch = _array_rows(prompts, "prompts")
    elif isinstance(prompts, str):
        batch = [prompts]
    elif isinstance(prompts, (list, tuple)):
        if not prompts:
            raise PromptError("prompts: got an empty list; give a prompt (text or token ids) or a batch of them")
        batch = [prompts] if _is_scalar(prompts[0]) else list(prompts)
    else:
        raise PromptError(f"prompts: got {type(prompts).__name__}; expected text, a list of token ids, an integer "
                          "tensor or array [n] or [batch, n], a tokenizer's output, or a list of those")
    out: list[str | list[int]] = []
    for index, prompt in enumerate(batch):
        if isinstance(prompt, str):
            if text_error is not None:
                raise PromptError(f"request {index}: {text_error}")
            if not prompt:
                raise PromptError(f"request {index}: the prompt is empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer can take it
                raise PromptError(f"request {index}: the text is not valid Unicode at character {exc.start} "
                                  f"({prompt[exc.start:exc.end]!r}: {exc.reason})") from None
            out.append(prompt)
        else:
            out.append(token_ids(prompt, index=index, vocab_size=vocab_size))
    return out


def token_ids(prompt: Any, *, index: int = 0, vocab_size: int | None = None) -> list[int]:
    """One prompt's token ids as Python ints in [0, vocab_size); `index` names the request in errors.
    prompt: a list or tuple of integers, or an integer tensor or array [n] (any device)."""
    where = f"request {index}"
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        if prompt.ndim != 1:
            raise PromptError(f"{where}: got a {prompt.ndim}-D {type(prompt).__name__} of shape {tuple(prompt.shape)}; "
                              "one prompt is 1-D [n] (a batch is a 2-D tensor or a list of prompts)")
        ids = _integer_array(prompt, where, vocab_size)
        _check_range(ids, where, vocab_size)
        return ids.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise PromptError(f"{where}: got {type(prompt).__name__}; a prompt is text or a sequence of token ids")
    if all(type(t) is int for t in prompt):  # the common case, checked without a conversion per token
        ids = list(prompt)
    else:
        ids = [_token(t, where, pos) for pos, t in enumerate(prompt)]
    if not ids:
        raise PromptError(f"{where}: the prompt is empty")
    limit = MAX_TOKEN_ID if vocab_size is None else vocab_size
    if min(ids) < 0 or max(ids) >= limit:
        pos = next(p for p, t in enumerate(ids) if not 0 <= t < limit)
        raise PromptError(_range_message(where, pos, ids[pos], limit))
    return ids


def _is_scalar(value: Any) -> bool:
    """A token-like scalar (int, float, bool, a 0-d tensor or array): its list is one prompt."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim == 0
    return isinstance(value, (int, float, np.number, np.bool_))


def _token(value: Any, where: str, pos: int) -> int:
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
                and value.dtype != torch.bool:
            return int(value.item())
        if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
            return int(value)
    elif isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    raise PromptError(f"{where}: token {pos} is {value!r} ({type(value).__name__}); token ids are integers")


def _integer_array(array: torch.Tensor | np.ndarray, where: str,
                   vocab_size: int | None = None) -> np.ndarray | torch.Tensor:
    """A 1-D integer tensor (on the CPU) or array; refuses other dtypes and empty ones."""
    if isinstance(array, torch.Tensor):
        if array.is_floating_point() or array.is_complex() or array.dtype == torch.bool:
            raise PromptError(f"{where}: a tensor of dtype {array.dtype}; token ids need an integer dtype "
                              "(e.g. torch.long)")
        if array.is_meta:
            raise PromptError(f"{where}: a tensor on the meta device holds no token ids; pass one with data")
        if array.dtype == getattr(torch, "uint64", None):  # past 2**63, .long() wraps to a negative id
            array = array.detach().cpu().numpy()  # checked below as the array it is
        else:
            array = array.detach().cpu().long()
    if isinstance(array, np.ndarray):
        if array.dtype.kind not in "iu":
            raise PromptError(f"{where}: an array of dtype {array.dtype}; token ids need an integer dtype (e.g. int64)")
        if array.dtype == np.uint64 and array.size and int(array.max()) >= MAX_TOKEN_ID:
            raise PromptError(_range_message(where, int(array.argmax()), int(array.max()),
                                             MAX_TOKEN_ID if vocab_size is None else vocab_size))
        array = array.astype(np.int64)
    if array.shape[0] == 0:
        raise PromptError(f"{where}: the prompt is empty")
    return array


def _check_range(ids: np.ndarray | torch.Tensor, where: str, vocab_size: int | None) -> None:
    """ids: int64 [n] on the CPU."""
    bad = ids < 0
    if vocab_size is not None:
        bad = bad | (ids >= vocab_size)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0][0])
        raise PromptError(_range_message(where, pos, int(ids[pos]), MAX_TOKEN_ID if vocab_size is None else vocab_size))


def _range_message(where: str, pos: int, value: int, limit: int) -> str:
    return f"{where}: token {pos} is {value}; token ids are ints in [0, {limit})"


def _array_rows(array: torch.Tensor | np.ndarray, name: str) -> list:
    if array.ndim == 1:
        return [array]
    if array.ndim == 2:
        if array.shape[0] == 0:
            raise PromptError(f"{name}: a batch of 0 prompts (shape {tuple(array.shape)})")
        return list(array)
    raise PromptError(f"{name}: got a {array.ndim}-D {type(array).__name__} of shape {tuple(array.shape)}; "
                      "expected [n] (one prompt) or [batch, n]")


def _from_encoding(encoding: Mapping) -> list:
    """A tokenizer's output (BatchEncoding or dict): its input_ids rows, padding dropped by attention_mask."""
    if "input_ids" not in encoding:
        raise PromptError(f"prompts: a mapping without 'input_ids' (keys: {sorted(map(str, encoding))}); "
                          "pass a tokenizer's output or token ids")
    ids = encoding["input_ids"]
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        rows = _array_rows(ids, "prompts['input_ids']")
    elif isinstance(ids, (list, tuple)) and ids:
        rows = [ids] if _is_scalar(ids[0]) else list(ids)
    else:
        raise PromptError(f"prompts['input_ids']: got {ids!r:.60}; expected token ids, a tensor, or a list of them")
    mask = encoding.get("attention_mask")
    if mask is None:
        return rows
    if isinstance(mask, (torch.Tensor, np.ndarray)):
        mask_rows = _array_rows(mask, "prompts['attention_mask']")
    elif isinstance(mask, (list, tuple)) and mask:
        rows_given = all(isinstance(m, (list, tuple)) or getattr(m, "ndim", 0) >= 1 for m in mask)
        mask_rows = list(mask) if rows_given else [mask]  # (a row with a bad value is named by _unpad)
    else:
        raise PromptError(f"prompts['attention_mask']: got {mask!r:.60}; expected 0s and 1s, one per input id, "
                          "as a list, a tensor, or a list of them")
    if len(mask_rows) != len(rows):
        raise PromptError(f"prompts['attention_mask']: {len(mask_rows)} rows for {len(rows)} rows of input_ids")
    return [_unpad(row, m, i) for i, (row, m) in enumerate(zip(rows, mask_rows))]


def _unpad(row, mask, index: int) -> list:
    row = row.tolist() if isinstance(row, (torch.Tensor, np.ndarray)) else list(row)
    mask = mask.tolist() if isinstance(mask, (torch.Tensor, np.ndarray)) else list(mask)
    if len(mask) != len(row) or any(m not in (0, 1) for m in mask):
        raise PromptError(f"request {index}: attention_mask must be 0s and 1s, one per input id "
                          f"({len(mask)} for {len(row)} ids)")
    kept = [pos for pos, m in enumerate(mask) if m == 1]
    if kept and kept[-1] - kept[0] + 1 != len(kept):
        hole = next(pos for pos in range(kept[0], kept[-1]) if mask[pos] == 0)
        raise PromptError(f"request {index}: attention_mask is 0 at position {hole}, between 1s; padding sits only "
                          "before or after a prompt (a masked token inside it would be dropped from the prompt)")
    for pos, (token, m) in enumerate(zip(row, mask)):
        if m == 0 and (isinstance(token, bool) or not isinstance(token, (int, np.integer))):
            raise PromptError(f"request {index}: padding token {pos} is {token!r:.40}; token ids are ints")
    return [row[pos] for pos in kept]
