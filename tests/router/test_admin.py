"""``POST /admin/weights`` body validation and defaults (no vLLM)."""

from __future__ import annotations

import pytest

from cache_policy.types import ReplicaId
from router.admin import parse_update
from router.config import AppConfig
from router.errors import BadRequest

IDS = [ReplicaId("replica-0"), ReplicaId("replica-1")]


def test_defaults_come_from_the_router_config():
    cfg = AppConfig().replace(router={"weight_update_policy": "salt", "weight_update_mode": "all",
                                      "weight_update_pause_mode": "keep", "flush_preempt_running": False})
    req = parse_update({"version": 3, "weights_path": "/ckpt/3"}, cfg, IDS, current=2)
    assert (req.version, req.weights_path, req.policy, req.mode, req.pause_mode, req.preempt_running,
            req.replicas) == (3, "/ckpt/3", "salt", "all", "keep", False, None)


def test_per_update_overrides_and_a_replica_subset():
    body = {"version": 2, "weights_path": "/ckpt/2", "policy": "flush", "mode": "rolling", "pause_mode": "abort",
            "preempt_running": True, "replicas": ["replica-1", "replica-1"]}
    req = parse_update(body, AppConfig(), IDS, current=2)  # the same version again: a retry
    assert (req.policy, req.mode, req.pause_mode, req.preempt_running, req.replicas) == \
        ("flush", "rolling", "abort", True, ("replica-1",))


@pytest.mark.parametrize("body,param", [
    ({"version": True, "weights_path": "/c"}, "version"),
    ({"version": 1, "weights_path": "/c"}, "version"),  # older than the current version 2
    ({"version": 3, "weights_path": ""}, "weights_path"),
    ({"version": 3, "weights_path": "/c", "preempt_running": "yes"}, "preempt_running"),
    ({"version": 3, "weights_path": "/c", "replicas": []}, "replicas"),
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(BadRequest) as err:
        parse_update(body, AppConfig(), IDS, current=2)
    assert err.value.param == param


@pytest.mark.parametrize("body,param,named", [
    ({"version": 3, "policy": "bogus"}, "policy", ["'policy' must be one of", "'weights_path'"]),  # path missing
    ({"version": 3, "weights_path": "/c", "policy": "bogus"}, "policy", ["'policy' must be one of"]),
    ({"policy": "bogus", "version": -1, "weights_path": "/c"}, "policy", ["'policy'", "'version'"]),
    ({"weights_path": "", "mode": "canary", "version": 3}, "weights_path", ["'weights_path'", "'mode'"]),
])
def test_the_first_invalid_field_is_named_and_every_one_listed(body, param, named):
    with pytest.raises(BadRequest) as err:
        parse_update(body, AppConfig(), IDS, current=2)
    assert (err.value.status, err.value.param) == (400, param), err.value.message
    message = err.value.message
    assert [message.find(text) for text in named] == sorted(message.find(text) for text in named)
    assert all(text in message for text in named) and message.count("; ") == len(named) - 1, message


def test_begin_names_the_first_invalid_field_in_body_order():
    from router.weights.requests import parse_begin

    with pytest.raises(BadRequest) as err:
        parse_begin({"version": 4, "transfer": "nccl", "policy": "bogus"}, AppConfig(), IDS, current=3)
    assert (err.value.status, err.value.param) == (400, "transfer")
    assert err.value.message.startswith("'transfer' must be one of") and "; 'policy' must be one of" in err.value.message


def test_router_config_checks_the_new_knobs():
    with pytest.raises(ValueError, match="weight_update_policy"):
        AppConfig().replace(router={"weight_update_policy": "salted"})
    with pytest.raises(ValueError, match="weight_update_mode"):
        AppConfig().replace(router={"weight_update_mode": "canary"})
    with pytest.raises(ValueError, match="admission_default_max_tokens"):
        AppConfig().replace(router={"admission_default_max_tokens": 0})


def test_drain_defaults_follow_the_pause_mode():
    cfg = AppConfig().replace(router={"weight_update_drain_s": 120.0})
    wait = parse_update({"version": 3, "weights_path": "/c", "pause_mode": "wait"}, cfg, IDS, current=2)
    keep = parse_update({"version": 3, "weights_path": "/c", "pause_mode": "keep"}, cfg, IDS, current=2)
    given = parse_update({"version": 3, "weights_path": "/c", "pause_mode": "abort", "drain_timeout_s": 5}, cfg, IDS,
                         current=2)
    assert (wait.drain_timeout_s, keep.drain_timeout_s, given.drain_timeout_s) == (120.0, 0.0, 5.0)


def test_two_phase_bodies():
    from router.weights.requests import parse_abort, parse_begin, parse_commit

    cfg = AppConfig().replace(router={"weight_update_commit_timeout_s": 30.0, "weight_update_mode": "rolling"})
    begin = parse_begin({"version": 4, "transfer": "vllm", "replicas": ["replica-0"]}, cfg, IDS, current=3)
    assert (begin.weights_path, begin.mode, begin.transfer, begin.commit_timeout_s, begin.replicas) == \
        (None, "all", "vllm", 30.0, ("replica-0",))
    assert parse_commit({"version": 4}) == (4, None) and parse_commit({"version": 4, "weights_path": "/c"}) == (4, "/c")
    assert parse_abort({"version": 4}) == (4, True) and parse_abort({"version": 4, "restore": False}) == (4, False)
    for parse, body, param in [(parse_commit, {"version": 4, "weights_path": ""}, "weights_path"),
                               (parse_abort, {"version": 4, "restore": "yes"}, "restore"),
                               (parse_commit, {}, "version")]:
        with pytest.raises(BadRequest) as err:
            parse(body)
        assert err.value.param == param
    for body, param in [({"version": 4, "transfer": "nccl"}, "transfer"), ({"version": 4, "commit_timeout_s": 0},
                                                                            "commit_timeout_s"),
                        ({"version": 4, "drain_timeout_s": -1}, "drain_timeout_s")]:
        with pytest.raises(BadRequest) as err:
            parse_begin(body, cfg, IDS, current=3)
        assert err.value.param == param


def test_router_config_checks_the_update_knobs():
    for name, value in [("max_staleness", -1), ("weight_update_drain_s", -1), ("weight_update_commit_timeout_s", 0)]:
        with pytest.raises(ValueError, match=name):
            AppConfig().replace(router={name: value})


@pytest.mark.parametrize("form, body, param", [
    ("update", {"version": 3, "weights_path": "/c", "pausemode": "abort"}, "pausemode"),
    ("update", {"version": 3, "weights_path": "/c", "transfer": "vllm"}, "transfer"),  # begin's, not the folder form's
    ("begin", {"version": 3, "weights_path": "/c"}, "weights_path"),  # commit's, not begin's
    ("commit", {"version": 3, "restore": False}, "restore"),
    ("abort", {"version": 3, "weights_path": "/c"}, "weights_path"),
])
def test_a_field_the_form_does_not_take_is_refused_not_ignored(form, body, param):
    # a misspelt field silently took its default (a fresh attacker's pause_mode typo ran "wait")
    from router.weights.requests import parse_abort, parse_begin, parse_commit

    parse = {"update": lambda b: parse_update(b, AppConfig(), IDS, current=2),
             "begin": lambda b: parse_begin(b, AppConfig(), IDS, current=2),
             "commit": parse_commit, "abort": parse_abort}[form]
    with pytest.raises(BadRequest) as err:
        parse(body)
    assert (err.value.status, err.value.param) == (400, param) and "not a field" in err.value.message
