"""The bodies of ``/admin/weights`` (folder form) and ``/admin/weights/{begin,commit,abort}``.

Folder form, ``POST /admin/weights``::

    {"version": 7, "weights_path": "/ckpt/step-7",   # required
     "policy": "keep+salt",       # flush | keep | salt | keep+salt        (router.weight_update_policy)
     "mode": "rolling",           # rolling | all                         (router.weight_update_mode)
     "pause_mode": "wait",        # wait | keep | abort                   (router.weight_update_pause_mode)
     "drain_timeout_s": 600,      # in-flight work gets this long first   (router.weight_update_drain_s)
     "preempt_running": true,     # flush: the reset may preempt kept streams (router.flush_preempt_running)
     "replicas": ["replica-0"]}   # default: every replica not serving `version` in rotation

Two-phase (weights pushed by the trainer), all targets at once::

    begin   {"version", "policy", "pause_mode", "drain_timeout_s", "preempt_running", "replicas",
             "transfer": "none" | "vllm",          # vllm: /start_weight_update + /finish_weight_update
             "commit_timeout_s": 600}              # aborted by the router when not committed in time
    commit  {"version", "weights_path": optional folder holding the pushed weights (later restores)}
    abort   {"version", "restore": true}           # reload the previous folder before resuming

Every parser raises BadRequest naming the field (a field the form does not take too: a misspelt
``pausemode`` once took the default silently); the folder form and ``begin`` check every field
first, then name the first invalid one in body order (a missing required field after the fields
given) in ``param``, and every invalid one in the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from cache_policy.salts import WEIGHT_UPDATE_POLICIES
from cache_policy.types import ReplicaId
from replicas.weights import PAUSE_MODES
from router.config import AppConfig
from router.errors import BadRequest

MODES = ("rolling", "all")
TRANSFERS = ("none", "vllm")


@dataclass(frozen=True)
class UpdateRequest:
    """A validated update (folder form: ``weights_path`` set; two-phase: None), defaults filled."""

    version: int
    weights_path: str | None
    policy: str
    mode: str
    pause_mode: str
    preempt_running: bool
    replicas: tuple[ReplicaId, ...] | None
    drain_timeout_s: float = 600.0
    transfer: str = "none"
    commit_timeout_s: float = 600.0


def parse_update(body: dict[str, Any], cfg: AppConfig, known: list[ReplicaId], current: int | None) -> UpdateRequest:
    """``POST /admin/weights``: a folder reload."""
    return _common(body, cfg, known, current, {"weights_path": lambda: _folder(body)})[0]


def parse_begin(body: dict[str, Any], cfg: AppConfig, known: list[ReplicaId], current: int | None) -> UpdateRequest:
    """``POST /admin/weights/begin``: a push the trainer makes between begin and commit."""
    timeout = cfg.router.weight_update_commit_timeout_s
    req, values = _common(body, cfg, known, current, {
        "transfer": lambda: _choice(body, "transfer", TRANSFERS, "none"),
        "commit_timeout_s": lambda: _seconds(body, "commit_timeout_s", timeout, positive=True)})
    return UpdateRequest(**{**req.__dict__, "mode": "all", "transfer": values["transfer"],
                            "commit_timeout_s": values["commit_timeout_s"]})


def parse_commit(body: dict[str, Any]) -> tuple[int, str | None]:
    """``POST /admin/weights/commit``: the version begun, and a folder holding the weights if any."""
    _only(body, ("version", "weights_path"))
    path = body.get("weights_path")
    if path is not None and (not isinstance(path, str) or not path):
        raise BadRequest("'weights_path' must be a folder holding the pushed weights, or absent", param="weights_path")
    return version(body, None), path


def parse_abort(body: dict[str, Any]) -> tuple[int, bool]:
    """``POST /admin/weights/abort``: the version begun, and whether to reload the previous folder."""
    _only(body, ("version", "restore"))
    restore = body.get("restore", True)
    if not isinstance(restore, bool):
        raise BadRequest("'restore' must be a boolean", param="restore")
    return version(body, None), restore


def version(body: dict[str, Any], current: int | None) -> int:
    """The body's ``version``: an integer >= 0, not older than ``current``."""
    value = body.get("version")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest("'version' must be an integer >= 0", param="version")
    if current is not None and value < current:
        raise BadRequest(f"'version' {value} is older than the current version {current}", param="version")
    return value


def _common(body: dict[str, Any], cfg: AppConfig, known: list[ReplicaId], current: int | None,
            extra: dict[str, Callable[[], Any]]) -> tuple[UpdateRequest, dict[str, Any]]:
    """The fields every update takes, and the ``extra`` ones of its form, all checked (:func:`_checked`)."""
    r = cfg.router
    waits = body.get("pause_mode", r.weight_update_pause_mode) == "wait"
    values = _checked(body, {
        "version": lambda: version(body, current),
        "policy": lambda: _choice(body, "policy", WEIGHT_UPDATE_POLICIES, r.weight_update_policy),
        "mode": lambda: _choice(body, "mode", MODES, r.weight_update_mode),
        "pause_mode": lambda: _choice(body, "pause_mode", PAUSE_MODES, r.weight_update_pause_mode),
        "preempt_running": lambda: _flag(body, "preempt_running", r.flush_preempt_running),
        "drain_timeout_s": lambda: _seconds(body, "drain_timeout_s", r.weight_update_drain_s if waits else 0.0),
        "replicas": lambda: _replicas(body, known),
        **extra})
    req = UpdateRequest(values["version"], values.get("weights_path"), values["policy"], values["mode"],
                        values["pause_mode"], values["preempt_running"], values["replicas"], values["drain_timeout_s"])
    return req, values


def _checked(body: dict[str, Any], checks: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Every field's value from its check. When some are invalid: BadRequest whose ``param`` is
    the first invalid field in body order (a required field the body lacks comes after those it
    holds) and whose message names every invalid field, in that order."""
    values: dict[str, Any] = {}
    errors: dict[str, BadRequest] = {}
    for name in body:
        if name not in checks:  # a misspelt field would silently take its default
            errors[name] = _unknown(name, checks)
    for name, check in checks.items():
        try:
            values[name] = check()
        except BadRequest as exc:
            errors[name] = exc
    if errors:
        position = {key: i for i, key in enumerate(body)}
        names = sorted(errors, key=lambda name: position.get(name, len(position)))
        raise BadRequest("; ".join(errors[name].message for name in names), param=errors[names[0]].param)
    return values


def _unknown(name: str, fields) -> BadRequest:
    """A field the request does not take (``param`` is its name)."""
    return BadRequest(f"{name!r} is not a field of this request (it takes: {', '.join(fields)})", param=str(name))


def _only(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    """BadRequest naming the first field of ``body`` not in ``fields``."""
    for name in body:
        if name not in fields:
            raise _unknown(name, fields)


def _folder(body: dict[str, Any]) -> str:
    path = body.get("weights_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("'weights_path' must be a checkpoint folder on the replicas' machine", param="weights_path")
    return path


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


def _replicas(body: dict[str, Any], known: list[ReplicaId]) -> tuple[ReplicaId, ...] | None:
    replicas = body.get("replicas")
    if replicas is None:
        return None
    if not isinstance(replicas, list) or not replicas or any(x not in known for x in replicas):
        raise BadRequest(f"'replicas' must be a non-empty list of replica ids among {known}", param="replicas")
    return tuple(dict.fromkeys(replicas))


def _choice(body: dict[str, Any], name: str, choices: tuple[str, ...], default: str) -> str:
    value = body.get(name, default)
    if value not in choices:
        raise BadRequest(f"'{name}' must be one of {', '.join(choices)}", param=name)
    return value


def _seconds(body: dict[str, Any], name: str, default: float, positive: bool = False) -> float:
    value = body.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (positive and value == 0):
        raise BadRequest(f"'{name}' must be a number of seconds {'> 0' if positive else '>= 0'}", param=name)
    return float(value)
