"""Loading the plugin: the guard, idempotent registration, refusal leaves vLLM untouched.

The guard and patching tests use stand-in modules and classes; the registration tests import
the installed vLLM in this process (no engine) and patch it, as ``register()`` does in every
vLLM process.
"""

from __future__ import annotations

import types

import pytest

import replicas.vllm_plugin as plugin
from replicas.vllm_plugin import guard, patching
from replicas.vllm_plugin.guard import Target

PATCHED = (
    ("vllm.v1.engine.core", "EngineCore", "preprocess_add_request"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "get_computed_blocks"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_get_prompt_logprobs_dict"),
    ("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs"),
    ("vllm.v1.engine.logprobs", "LogprobsProcessor", "from_new_request"),
    ("vllm.v1.engine.logprobs", "LogprobsProcessor", "_update_prompt_logprobs"),
    ("vllm.entrypoints.launchers.api_server", "entry", "init_app_state"),
)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_supported_versions_pass(version):
    assert guard.check_version(version) == ""


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "dev"])
def test_other_versions_are_refused_with_a_reason(version):
    assert f"vLLM {version} is not a version" in guard.check_version(version)


def test_guard_reports_missing_symbols_signatures_and_source():
    assert "not found" in guard.check_targets((Target("json", "no_such_function"),))
    assert "not found" in guard.check_targets((Target("no_such_module_xyz", "f"),))
    assert "has parameters" in guard.check_targets((Target("json", "dumps", ("obj",)),))
    assert guard.check_targets((Target("json", "dumps", ("obj", "..."),),)) == ""
    assert "no longer contains" in guard.check_targets((Target("json", "dumps", None, ("no such line",)),))
    assert guard.check_targets((Target("json", "dumps", None, ("def dumps(",)),)) == ""
    fields = {"replicas.vllm_plugin.support:Support": ("active", "nope")}
    assert "lacks field(s) ['nope']" in guard.check_fields(fields)


def test_wrap_is_idempotent_and_restorable():
    class Owner:
        def f(self, x):
            return x

        @classmethod
        def g(cls, x):
            return x

    def plus_one(original):
        return lambda *args: original(*args) + 1

    mark = patching.checkpoint()
    assert patching.wrap(Owner, "f", plus_one) and patching.wrap(Owner, "g", plus_one)
    assert not patching.wrap(Owner, "f", plus_one)  # a second register() changes nothing
    assert Owner().f(1) == 2 and Owner.g(1) == 2
    assert patching.is_wrapped(Owner, "f") and patching.is_wrapped(Owner, "g")
    patching.restore_since(mark)
    assert Owner().f(1) == 1 and Owner.g(1) == 1 and not patching.is_wrapped(Owner, "f")


def test_a_refused_guard_installs_nothing(monkeypatch):
    import vllm

    from replicas.vllm_plugin import admission, cache_lookup, metrics

    calls = []
    for module in (admission, cache_lookup):
        monkeypatch.setattr(module, "install", lambda: calls.append("install"))
    monkeypatch.setattr(vllm, "__version__", "0.0.1")
    monkeypatch.setattr(plugin, "_result", None)
    plugin.register()
    assert plugin.registration_result().startswith("vLLM 0.0.1 is not a version")
    assert calls == []
    gauge = metrics._get_gauge()
    samples = {s.labels["reason"]: s.value for s in gauge.collect()[0].samples}
    assert samples == {"plugin refused: " + plugin.registration_result(): 0.0}


def test_register_patches_the_installed_vllm_once(monkeypatch):
    import importlib

    assert guard.check_all(importlib.import_module("vllm").__version__) == ""
    monkeypatch.setattr(plugin, "_result", None)
    plugin.register()
    plugin.register()
    assert plugin.registration_result() == ""
    for module, owner, name in PATCHED:
        cls = getattr(importlib.import_module(module), owner)
        assert patching.is_wrapped(cls, name), f"{owner}.{name}"
        original = getattr(vars(cls)[name], "__func__", vars(cls)[name])
        inner = getattr(original, patching.ORIGINAL_ATTR)
        assert not hasattr(inner, patching.ORIGINAL_ATTR), f"{owner}.{name} wrapped twice"
    core = importlib.import_module("vllm.v1.engine.core").EngineCore
    assert isinstance(vars(core)["rollout_router_scoring_cap_status"], types.FunctionType)
