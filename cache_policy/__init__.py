"""Pure routing and cache decisions for rollout-router.

Nothing in this package performs I/O, reads the clock or imports aiohttp, ray, vllm,
redis or asyncio: callers pass snapshots in and carry the returned decisions out.
"""
