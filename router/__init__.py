"""The aiohttp front door: OpenAI-compatible API, proxying and streaming, metrics.

It holds no routing logic: each request is parsed into a `cache_policy.types.RequestView`,
`cache_policy` decides, and this package carries the decision out.
"""
