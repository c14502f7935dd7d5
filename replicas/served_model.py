"""What an existing vLLM server serves, as its ``GET /v1/models`` says, and where the router
finds the model's files.

vLLM answers ``{"object": "list", "data": [{"id": <served name>, "root": <the --model it
loaded: a folder or a hub name>, "max_model_len": N, ...}]}`` (``vllm/entrypoints/openai/
models/serving.py`` ``show_available_models``; LoRA adapters follow the base model). Only the
first entry, the base model, is read here.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import aiohttp

from replicas.auth import headers_for
from replicas.config import ReplicaSetConfig, StartupError

MODELS_TIMEOUT_S = 10.0
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """The base model one server serves: its served ``name``, the ``root`` it loaded from and its
    ``max_model_len`` (tokens, prompt + output; None when the answer does not give one)."""

    name: str
    root: str | None = None
    max_model_len: int | None = None


def parse_models(payload: Any) -> ServedModel | None:
    """The first model of a ``/v1/models`` answer; None when the answer holds none."""
    data = payload.get("data") if isinstance(payload, dict) else None
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None
    if first is None or not isinstance(first.get("id"), str) or not first["id"]:
        return None
    root, length = first.get("root"), first.get("max_model_len")
    return ServedModel(first["id"], root if isinstance(root, str) and root else None,
                       length if type(length) is int and length > 0 else None)


async def fetch_served_model(session: aiohttp.ClientSession, base_url: str,
                             timeout_s: float = MODELS_TIMEOUT_S) -> ServedModel | None:
    """``GET /v1/models`` of the server at ``base_url`` (with its key when this process holds
    one); None when it does not answer 200 with a model within ``timeout_s``."""
    try:
        async with session.get(f"{base_url}/v1/models", headers=headers_for(base_url),
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            return parse_models(await resp.json(content_type=None))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def agreed_block_size(what: str, reported: int, configured: int, others: Iterable[Any]) -> int:
    """The KV block size (tokens) of the server ``what``: the one its ``/metrics`` ``reported``
    (``vllm:cache_config_info``; 0 = not reported: ``configured`` is assumed, with a warning).

    ``others``: the replicas already in the set (``ReplicaEndpoint``-like: ``replica_id``,
    ``base_url``, ``block_size``). StartupError when the size differs from theirs: the prefix
    hashes (``cache_policy.hashing``) chain whole blocks, so one router needs one block size."""
    if not reported:
        logger.warning("%s reports no block_size in vllm:cache_config_info; assuming replicas.block_size %d",
                       what, configured)
    size = reported or configured
    other = next((o for o in others if o.block_size != size), None)
    if other is not None:
        raise StartupError(f"{what} has KV block size {size} but {other.replica_id} ({other.base_url}) has "
                           f"{other.block_size}: every replica behind one router must use the same block size")
    return size


def model_source(cfg: ReplicaSetConfig, roots: Sequence[str | None] = ()) -> str | None:
    """Where this machine can read the replicas' model (tokenizer, initial weights), or None.

    With ``cfg.urls`` (servers started elsewhere): the first of the servers' model ``roots``
    (``ServedModel.root``) that is a local folder, else None; nothing is generated and nothing
    of torch or vLLM is imported. Otherwise (replicas launched here): ``cfg.model`` resolved by
    ``replicas.server.resolve_model`` (a folder or a hub name; "tiny" is generated, with torch)."""
    if cfg.urls:
        return next((r for r in roots if r and Path(r).is_dir()), None)
    from replicas.server import resolve_model  # launching: this process runs vLLM's stack anyway

    return resolve_model(cfg)
