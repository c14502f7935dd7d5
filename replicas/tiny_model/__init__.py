"""The embedded default model: a tiny random-weight Llama generated locally.

Nothing can be downloaded where this project runs, so the model is built here,
deterministically, from a fixed seed and the corpus shipped beside this file.
"""

from replicas.tiny_model.generate import TinyModelSpec, default_model_dir, ensure_tiny_model

__all__ = ["TinyModelSpec", "default_model_dir", "ensure_tiny_model"]
