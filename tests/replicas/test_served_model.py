"""What a wrapped server serves (``/v1/models``), where the router finds its model, and one block
size per router (``replicas.served_model``); no server needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replicas.config import ReplicaSetConfig, StartupError
from replicas.served_model import ServedModel, agreed_block_size, model_source, parse_models

VLLM_MODELS = {"object": "list", "data": [
    {"id": "qwen", "object": "model", "root": "/models/Qwen3-8B", "parent": None, "max_model_len": 32768},
    {"id": "qwen-lora", "object": "model", "root": "/loras/a", "parent": "qwen"}]}
"""The shape vLLM 0.32 answers (``show_available_models``): the base model first, then adapters."""


def test_parse_models_takes_the_base_model():
    assert parse_models(VLLM_MODELS) == ServedModel("qwen", "/models/Qwen3-8B", 32768)
    assert parse_models({"data": [{"id": "m"}]}) == ServedModel("m", None, None)
    for bad_length in (0, -1, "4096", 4096.0, True, None):
        assert parse_models({"data": [{"id": "m", "max_model_len": bad_length}]}) == ServedModel("m")
    for bad in ({}, {"data": []}, {"data": [{"root": "/x"}]}, [], "", {"data": [{"id": ""}]}):
        assert parse_models(bad) is None


def test_with_urls_only_a_local_folder_is_a_model_source(tmp_path):
    cfg = ReplicaSetConfig(urls=("http://127.0.0.1:1",))  # model stays "tiny": never generated here
    assert model_source(cfg, [None, "org/hub-name", str(tmp_path / "absent"), str(tmp_path)]) == str(tmp_path)
    assert model_source(cfg, ["org/hub-name"]) is None and model_source(cfg) is None
    launched = ReplicaSetConfig(model="org/hub-name")
    assert model_source(launched, [str(tmp_path)]) == "org/hub-name"


def test_block_sizes_must_agree(caplog):
    a = SimpleNamespace(replica_id="replica-0", base_url="http://a:1", block_size=16)
    assert agreed_block_size("urls[1] http://b:2", 16, 32, [a]) == 16
    assert agreed_block_size("urls[0] http://a:1", 0, 32, []) == 32  # not reported: the config's, warned
    assert "reports no block_size" in caplog.text
    with pytest.raises(StartupError, match=r"^urls\[1\] http://b:2 has KV block size 32 but replica-0 "
                                           r"\(http://a:1\) has 16: every replica"):
        agreed_block_size("urls[1] http://b:2", 32, 32, [a])


def test_the_shortest_reported_max_model_len_bounds_prompts_unless_the_router_sets_one():
    from router.config import AppConfig
    from router.parse import Limits

    eps = [SimpleNamespace(max_model_len=4096), SimpleNamespace(max_model_len=2048), SimpleNamespace(max_model_len=None)]
    assert Limits.of(AppConfig(), eps).max_model_len == 2048
    assert Limits.of(AppConfig(), eps).max_prompt_chars == 16 * 2048
    assert Limits.of(AppConfig(), [SimpleNamespace(max_model_len=None)]).max_model_len == 16384  # replicas.max_model_len
    assert Limits.of(AppConfig().replace(router={"max_model_len": 3000}), eps).max_model_len == 3000
