"""Head-to-head: this router against vllm-router and sglang-router on simulated replicas over HTTP.

``python -m bench.h2h`` (see ``bench.h2h.cli``). Replicas: ``bench.h2h.server`` (the simulator's
engine model behind vLLM's HTTP API); routers: ``bench.h2h.routers``; traffic: ``bench.h2h.drive``
(workloads) and ``bench.h2h.latency`` (router-added latency).
"""
