"""Generate the tiny Llama checkpoint (weights + byte-level BPE tokenizer + chat template).

The output is a normal Hugging Face folder that ``vllm serve`` and ``transformers`` load.
Generation is idempotent: a folder whose ``rollout_router_spec.json`` matches the spec is
reused as is. Run ``python -m replicas.tiny_model --help``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

CORPUS = Path(__file__).with_name("corpus.txt")
SPEC_FILE = "rollout_router_spec.json"
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the generated model. ``seed`` fixes the weights (a different seed is a
    different checkpoint, used to test weight updates); the tokenizer depends only on the
    corpus and ``vocab_size``."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 16384
    head_dim: int | None = None
    """Per-head width; ``None`` is Hugging Face's default, ``hidden_size // num_attention_heads``."""

    @classmethod
    def wide(cls, hidden_size: int, seed: int = 0) -> "TinyModelSpec":
        """A wider variant for benchmarks: 64-dim heads and a Llama-like 2.75x MLP, so per-token
        cost is dominated by the linear layers (as in production models) rather than attention,
        which dominates in the 128-wide default. ``hidden_size`` must be a multiple of 64."""
        if hidden_size < 64 or hidden_size % 64:
            raise ValueError(f"hidden_size must be a positive multiple of 64, got {hidden_size}")
        heads = hidden_size // 64
        return cls(seed=seed, hidden_size=hidden_size, intermediate_size=hidden_size * 11 // 4,
                   num_attention_heads=heads, num_key_value_heads=heads)

    @classmethod
    def teacher_shaped(cls, seed: int = 0) -> "TinyModelSpec":
        """A benchmark model whose attention-to-linear cost ratio is a production teacher's.

        Per layer and prompt row, attention costs ``4 * heads * head_dim`` FLOPs per attended key
        and the linear layers cost about ``2 * parameters`` FLOPs. For Qwen3-32B (the seed 000
        teacher: 64 layers, 64 heads of 128, 32B parameters) that ratio is 2.1 MFLOP / 64 GFLOP,
        about 3.3e-5 per key; for this spec (hidden 512, one 64-wide head, MLP 2048, 2 layers)
        it is 256 / 6.6 MFLOP, about 3.9e-5. So on the seed's shapes attention takes about the
        share of a prefill it takes on the real teacher (a few percent at 3,500 keys), where the
        128-wide default spends most of its time in attention. 14 MFLOP per row: the 512-wide
        :meth:`wide` model's cost."""
        return cls(seed=seed, hidden_size=512, intermediate_size=2048, num_attention_heads=1,
                   num_key_value_heads=1, head_dim=64)


_SHAPE_TAGS = {"hidden_size": "h", "intermediate_size": "i", "num_hidden_layers": "l",
               "num_attention_heads": "a", "num_key_value_heads": "kv", "head_dim": "d", "vocab_size": "v"}


def default_model_dir(spec: "TinyModelSpec" = TinyModelSpec()) -> Path:
    """``$ROLLOUT_ROUTER_CACHE/models/tiny-llama-seed{seed}`` (default cache ``~/.cache/rollout-router``).
    Sizes that differ from the default spec are named in the folder, e.g.
    ``tiny-llama-h512-i1408-a8-kv8-seed0`` for :meth:`TinyModelSpec.wide` ``(512)``."""
    root = Path(os.environ.get("ROLLOUT_ROUTER_CACHE", Path.home() / ".cache" / "rollout-router"))
    default = TinyModelSpec()
    shape = "".join(f"-{tag}{getattr(spec, field)}" for field, tag in _SHAPE_TAGS.items()
                    if getattr(spec, field) != getattr(default, field))
    return root / "models" / f"tiny-llama{shape}-seed{spec.seed}"


def _spec_record(spec: TinyModelSpec) -> dict:
    """What ``rollout_router_spec.json`` holds: the spec's fields, unset optional ones left out
    (so folders written before a field existed still match)."""
    return {k: v for k, v in asdict(spec).items() if v is not None}


def _train_tokenizer(spec: TinyModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS.read_text(encoding="utf-8")
    tok.train_from_iterator([line for line in text.splitlines() if line], trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_model(spec: TinyModelSpec, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        **({"head_dim": spec.head_dim} if spec.head_dim is not None else {}),
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    # A wider init than the default 0.02 so logits are not all uniform: the model then
    # has preferences, and logprob comparisons in tests are meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model


def ensure_tiny_model(out_dir: Path | None = None, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Create the tiny model under ``out_dir`` unless an identical one is there; return its path.

    Raises ``OSError`` if the folder cannot be written.
    """
    out = Path(out_dir) if out_dir is not None else default_model_dir(spec)
    want = _spec_record(spec)
    marker = out / SPEC_FILE
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = _train_tokenizer(spec)
    tokenizer.save_pretrained(tmp)
    _build_model(spec, tokenizer).save_pretrained(tmp, safe_serialization=True)
    (tmp / SPEC_FILE).write_text(json.dumps(want, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
