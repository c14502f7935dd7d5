"""The generated model's specs and folders (replicas/tiny_model/generate.py)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from cache_policy.scoring import PrefillCost
from replicas.tiny_model import TinyModelSpec, default_model_dir, ensure_tiny_model
from replicas.tiny_model.generate import SPEC_FILE


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_ROUTER_CACHE", str(tmp_path))
    return tmp_path / "models"


def test_folder_names_carry_every_size_that_differs_from_the_default(cache_root):
    assert default_model_dir() == cache_root / "tiny-llama-seed0"
    assert default_model_dir(TinyModelSpec(seed=1)) == cache_root / "tiny-llama-seed1"
    assert default_model_dir(TinyModelSpec.wide(512)) == cache_root / "tiny-llama-h512-i1408-a8-kv8-seed0"
    assert default_model_dir(TinyModelSpec.teacher_shaped()) == cache_root / "tiny-llama-h512-i2048-a1-kv1-d64-seed0"


def test_wide_rejects_a_width_that_is_not_whole_heads():
    with pytest.raises(ValueError, match="hidden_size"):
        TinyModelSpec.wide(100)


def test_teacher_shaped_attention_share_is_a_32b_teachers():
    """The docstring's claim, from the two models' sizes: attention FLOPs per key over linear
    FLOPs per row within 25% of Qwen3-32B's (64 layers, hidden 5120, 64 heads of 128, 8 KV
    heads, MLP 25600, vocab 151936), where the 128-wide default is over 20x off."""

    def ratio(cost: PrefillCost) -> float:
        return cost.attention_flops_per_key / cost.linear_flops

    qwen = ratio(PrefillCost.llama(5120, 25600, 64, 64, 8, 151936, head_dim=128))
    assert qwen == pytest.approx(3.28e-5, rel=0.01)
    s = TinyModelSpec.teacher_shaped()
    vocab = 1130  # what the byte-level BPE reaches on the corpus
    teacher = ratio(PrefillCost.llama(s.hidden_size, s.intermediate_size, s.num_hidden_layers,
                                      s.num_attention_heads, s.num_key_value_heads, vocab, s.head_dim))
    assert 0.8 < teacher / qwen < 1.25
    d = TinyModelSpec()
    tiny = ratio(PrefillCost.llama(d.hidden_size, d.intermediate_size, d.num_hidden_layers,
                                   d.num_attention_heads, d.num_key_value_heads, vocab))
    assert tiny / qwen > 20


def test_spec_record_leaves_unset_head_dim_out_so_existing_folders_still_match(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    record = {k: v for k, v in asdict(TinyModelSpec()).items() if k != "head_dim"}
    (out / SPEC_FILE).write_text(json.dumps(record))
    # a matching marker means the folder is reused as is: nothing else is written
    assert ensure_tiny_model(out, TinyModelSpec()) == out
    assert sorted(p.name for p in out.iterdir()) == [SPEC_FILE]


def test_teacher_shaped_folder_serves_one_64_wide_head(cache_root):
    path = ensure_tiny_model(spec=TinyModelSpec.teacher_shaped(seed=3))
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["head_dim"]) == (512, 1, 64)
    assert json.loads((path / SPEC_FILE).read_text())["head_dim"] == 64
