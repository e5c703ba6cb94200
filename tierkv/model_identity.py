"""What a KV block's address says about the model that computed it.

Primitives: `ModelIdentity`, `model_identity` (a loaded torch model), `WeightsWatch`, `config_fields`,
`checkpoint_identity` (weight files on disk, for engines whose weights live in other processes),
`weights_digest`, `files_digest`.

Two runs may share a block only when the same weights computed it. A block's address (see
`tierkv.blocks`) starts from `ModelIdentity.key`, which holds:

    name     the configured `model.name`
    source   where the model came from (a checkpoint path, `_name_or_path`, or the class name)
    weights  a digest of every parameter's and buffer's name, shape, dtype and a fixed strided
             sample of its bytes, plus the model config's fields that can change the KV (`config_fields`:
             not token ids, cache / output flags, generation defaults, names) (so two random inits of one
             shape, or one changed layer, give different digests); for files: name, size and sampled bytes

The sample is at most `SAMPLE_ELEMENTS` evenly spaced elements per tensor, gathered on the
tensor's device and copied to the host in one transfer, so an 8B model costs a few hundred
small reads, not 16 GB of hashing. A change that touches no sampled element (one weight of a
large matrix) is not seen: the digest guards against other models and re-initialised or
fine-tuned layers, not against single-bit edits.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import weakref
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("tierkv.model_identity")
SAMPLE_ELEMENTS = 4096  # per tensor, evenly spaced, first and last included
PROBE_ELEMENTS = 64  # per parameter, on every WeightsWatch.check (about 5 ms for a 135M-parameter model on a CPU)
FILE_SAMPLES = 16  # reads per weight file, evenly spaced, head and tail included
FILE_SAMPLE_BYTES = 64 << 10
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# config fields that cannot change the keys and values a forward computes (so editing one after a runtime was
# made keeps its blocks valid): token ids, output / cache flags, generation defaults, names and versions, the
# output head's tying and labels, init and loss settings; dtype is the weights' own (digested with each tensor).
# Every other field counts, known or not: rope settings, norms' eps, activations, shapes, windows, structure.
_CONFIG_SKIP = frozenset({
    "transformers_version", "torch_dtype", "dtype", "architectures", "name_or_path", "tokenizer_class", "prefix",
    "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id",
    "mask_token_id", "unk_token_id", "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens",
    "begin_suppress_tokens", "forced_decoder_ids", "use_cache", "output_attentions", "output_hidden_states",
    "output_router_logits", "return_dict", "return_dict_in_generate", "output_scores", "tie_word_embeddings",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "remove_invalid_values",
    "exponential_decay_length_penalty", "id2label", "label2id", "num_labels", "problem_type", "finetuning_task",
    "task_specific_params", "initializer_range", "init_std", "router_aux_loss_coef",
})


@dataclass(frozen=True)
class ModelIdentity:
    """The parts of a block address that name the model; `key` joins them."""

    name: str
    source: str
    weights: str | None  # hex digest; None when only names are known (KVRuntime given a plain model id)
    digest_s: float = field(default=0.0, compare=False)  # seconds spent computing `weights`

    @property
    def key(self) -> str:
        return json.dumps([self.name, self.source, self.weights])

    def stats(self) -> dict:
        return {"name": self.name, "source": self.source, "weights_fingerprint": self.weights,
                "fingerprint_s": self.digest_s}


def model_identity(model: torch.nn.Module, name: str, source: str | None = None) -> ModelIdentity:
    """The identity of a loaded model: configured `name`, `source` (default: the config's
    `_name_or_path`, else the class name) and `weights_digest(model)`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"config key 'model.name': got {name!r}; must be a non-empty string")
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"model_id: got {type(source).__name__}; expected a string naming where the model came from")
    config = getattr(model, "config", None)
    source = os.fspath(source) if source else (getattr(config, "_name_or_path", "") or type(model).__name__)
    start = time.perf_counter()
    digest = weights_digest(model)
    return ModelIdentity(name, source, digest, time.perf_counter() - start)


class WeightsWatch:
    """Notices that a model's weights changed after its blocks' addresses were fixed (an in-place update such
    as `load_state_dict` or a merged adapter, or a replaced parameter): `check` raises ValueError then, so a
    runtime never files the new weights' KV under the old weights' addresses, nor serves the old KV to them.
    Each check digests PROBE_ELEMENTS evenly spaced elements of every parameter (a write through `p.data` moves
    no version counter); when the parameters' identities or version counters moved, the full digest decides,
    and unchanged values pass. A write touching none of the probed elements of any parameter goes unseen.
    A config field that can change the KV (`config_fields`: rope, norms' eps, shapes...) edited since is refused
    by name; others (token ids, use_cache, tie_word_embeddings, generation defaults) may change freely."""

    def __init__(self, model: torch.nn.Module):
        self._model = weakref.ref(model)
        self._config = config_fields(getattr(model, "config", None))
        self._state = _versions(model)
        self._digest = weights_digest(model, buffers=False)  # buffers (rotary caches) may change in forwards
        self._probe = weights_digest(model, buffers=False, samples=PROBE_ELEMENTS)

    def check(self) -> None:
        model = self._model()
        if model is None:
            return
        _check_config(self._config, config_fields(getattr(model, "config", None)))
        state = _versions(model)
        changed = weights_digest(model, buffers=False, samples=PROBE_ELEMENTS) != self._probe
        if not changed and state != self._state:
            changed = weights_digest(model, buffers=False) != self._digest
        if changed:
            raise ValueError("the model's weights changed after tierkv's runtime was made for it (updated in place or "
                             "replaced): its blocks are addressed by the old weights; make a new TieredLLM (or "
                             "runtime_for_model) for the new ones")
        self._state = state


def _check_config(before: dict, now: dict) -> None:
    """ValueError naming the config fields that changed (only those that can change the KV: `config_fields`)."""
    if now != before:
        keys = sorted(k for k in {*before, *now} if before.get(k) != now.get(k))
        raise ValueError(f"the model's config changed after tierkv's runtime was made for it ({', '.join(keys)}), "
                         "which changes the keys and values it computes: its blocks are addressed by the old config; "
                         "make a new TieredLLM (or runtime_for_model) for the new one")


def _versions(model: torch.nn.Module) -> tuple:
    return tuple((id(p), p._version) for p in model.parameters())


@torch.no_grad()
def weights_digest(model: torch.nn.Module, *, buffers: bool = True, samples: int | None = None) -> str:
    """blake2b over the model config and every parameter (and buffer): name, shape, dtype and up to
    `samples` (default SAMPLE_ELEMENTS) evenly spaced elements' bytes. Deterministic across processes and devices."""
    h = hashlib.blake2b(digest_size=16)
    h.update(_config_blob(getattr(model, "config", None)))
    tensors = sorted([*model.named_parameters(), *(model.named_buffers() if buffers else ())], key=lambda item: item[0])
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    order: list[tuple[torch.device, int, int]] = []  # (device, index in its list, bytes)
    for name, tensor in tensors:
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        if tensor.device.type == "meta" or tensor.numel() == 0:
            h.update(b"meta" if tensor.device.type == "meta" else b"empty")
            continue
        sample = _sample_bytes(tensor, samples or SAMPLE_ELEMENTS)
        group = by_device.setdefault(tensor.device, [])
        order.append((tensor.device, len(group), sample.numel()))
        group.append(sample)
    host = {device: torch.cat(group).cpu() for device, group in by_device.items()}  # one copy per device
    offsets = {device: 0 for device in host}
    for device, _, num_bytes in order:
        start = offsets[device]
        h.update(host[device][start : start + num_bytes].numpy().tobytes())
        offsets[device] = start + num_bytes
    return h.hexdigest()


def _sample_bytes(tensor: torch.Tensor, samples: int) -> torch.Tensor:
    """Up to `samples` (>= 2) evenly spaced elements of `tensor` as uint8 [n * itemsize], same device."""
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n > samples:
        index = (torch.arange(samples, dtype=torch.int64) * (n - 1) // (samples - 1)).to(flat.device)
        flat = flat.index_select(0, index)
    flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).reshape(-1)


def config_fields(config) -> dict:
    """The fields of a transformers config (sub-configs' too) that can change the keys and values its model
    computes: all of `config.to_dict()` but private ones and `_CONFIG_SKIP`."""
    if config is None or not hasattr(config, "to_dict"):
        return {}
    return _kept(config.to_dict())


def _kept(fields: dict) -> dict:
    return {k: _kept(v) if isinstance(v, dict) else v for k, v in fields.items()
            if not (isinstance(k, str) and k.startswith("_")) and k not in _CONFIG_SKIP}


def _config_blob(config) -> bytes:
    return json.dumps(config_fields(config), sort_keys=True, default=str).encode()


def checkpoint_identity(name: str, model: str | os.PathLike, revision: str | None = None,
                        model_id: str | None = None, cache_dir: str | os.PathLike | None = None) -> ModelIdentity:
    """The identity of a checkpoint on disk (a directory or one weight file such as a GGUF):
    configured `name`; `model_id` (a label the caller gives, if any), the absolute path and the
    revision as `source`; `files_digest` of its config and weight files. A hub id that is no local
    path is looked up in `cache_dir` (where it was downloaded) or the local hub cache; when not found
    there, it keeps its name and revision alone, and a warning says that two hosts holding other
    snapshots under that name would share blocks."""
    path = os.fspath(model)
    local = path if os.path.exists(path) else _hub_snapshot(path, revision, cache_dir)
    source = json.dumps([model_id, os.path.abspath(path) if os.path.exists(path) else path, revision])
    start = time.perf_counter()
    digest = files_digest(local) if local is not None else None
    if digest is None:
        logger.warning("tierkv: the checkpoint %r was found neither as a path nor in the hub cache%s: its blocks are "
                       "addressed by its name%s alone, so engines holding other weights under that name would share "
                       "them through a disk or Redis tier; give model.revision or a local path", path,
                       f" or {os.fspath(cache_dir)!r}" if cache_dir else "", " and revision" if revision else "")
    return ModelIdentity(name, source, digest, time.perf_counter() - start)


def _hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | os.PathLike | None = None) -> str | None:
    """The local hub-cache directory of `repo_id` at `revision` (in `cache_dir`, else the hub cache), or
    None (never downloads)."""
    try:
        from huggingface_hub import snapshot_download

        for where in ([cache_dir] if cache_dir else []) + [None]:
            try:
                return snapshot_download(repo_id, revision=revision, local_files_only=True, cache_dir=where)
            except Exception:  # not in this cache: the next
                continue
        return None
    except Exception:  # not a hub id, or no huggingface_hub: names alone
        return None


def files_digest(path: str | os.PathLike) -> str:
    """blake2b over a checkpoint's weight files (name, size, `FILE_SAMPLES` reads of
    `FILE_SAMPLE_BYTES` spread over each file) and its small JSON files, whole."""
    path = os.fspath(path)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(root, f) for root, _, names in os.walk(path) for f in names)
    h = hashlib.blake2b(digest_size=16)
    for file in files:
        rel = os.path.relpath(file, path) if file != path else os.path.basename(file)
        if file.endswith(".json") and os.path.getsize(file) <= (1 << 20):
            with open(file, "rb") as f:
                h.update(f"{rel}:json;".encode() + f.read())
        elif file.endswith(WEIGHT_FILE_SUFFIXES):
            h.update(f"{rel}:{os.path.getsize(file)};".encode() + _file_samples(file))
    return h.hexdigest()


def _file_samples(file: str) -> bytes:
    size = os.path.getsize(file)
    if size <= FILE_SAMPLES * FILE_SAMPLE_BYTES:
        with open(file, "rb") as f:
            return f.read()
    last = size - FILE_SAMPLE_BYTES
    chunks = []
    with open(file, "rb") as f:
        for i in range(FILE_SAMPLES):
            f.seek(last * i // (FILE_SAMPLES - 1))
            chunks.append(f.read(FILE_SAMPLE_BYTES))
    return b"".join(chunks)
