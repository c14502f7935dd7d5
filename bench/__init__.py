"""Workloads, the demo, and benchmarks that compare rollout-router with baselines on real vLLM."""
