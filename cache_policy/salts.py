"""Cache salts from weight versions (DESIGN rule 4, seed 003 "The cache after a weight update").

Cached keys/values were computed by specific weights. The four policies after an update:

* ``flush``: the replicas drop their cache; no salt is needed (``None``).
* ``keep``: the cache stays and in-flight work continues on it; no salt (``None``).
* ``salt``: namespace the cache by version; every request uses the loaded version's salt,
  so it only hits blocks computed by the weights now loaded.
* ``keep+salt``: a session that started before the loaded version keeps its starting
  version's salt (continues on its existing cache); new sessions get the loaded version's.

The salt is folded into block 0 (``cache_policy.hashing``), as vLLM does with ``cache_salt``.
"""

from __future__ import annotations

from typing import Literal, get_args

WeightUpdatePolicy = Literal["flush", "keep", "salt", "keep+salt"]
WEIGHT_UPDATE_POLICIES: tuple[str, ...] = get_args(WeightUpdatePolicy)


def cache_salt_for_version(version: int | None, namespace: str = "rr") -> str | None:
    """``"<namespace>:v<version>"``, or ``None`` when ``version`` is None."""
    if version is None:
        return None
    if version < 0:
        raise ValueError(f"weight version must be >= 0, got {version}")
    if not namespace:
        raise ValueError("namespace (salt namespace) must be a non-empty string")
    return f"{namespace}:v{version}"


def choose_salt(
    policy: WeightUpdatePolicy,
    request_version: int | None,
    session_start_version: int | None,
    loaded_version: int | None,
    namespace: str = "rr",
) -> str | None:
    """The cache salt of one request under ``policy``.

    ``loaded_version`` is the version the replica serves (None if unknown: the request's
    own ``request_version`` stands in for it); ``session_start_version`` is the version
    the request's session started under (None: not a session, or its first turn).
    """
    if policy not in WEIGHT_UPDATE_POLICIES:
        raise ValueError(
            f"weight_update_policy must be one of {WEIGHT_UPDATE_POLICIES}, got {policy!r}"
        )
    if policy in ("flush", "keep"):
        return None
    current = loaded_version if loaded_version is not None else request_version
    started = session_start_version
    if policy == "keep+salt" and started is not None and current is not None and started < current:
        return cache_salt_for_version(started, namespace)
    return cache_salt_for_version(current, namespace)
