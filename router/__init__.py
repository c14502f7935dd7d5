"""The aiohttp front door: OpenAI-compatible API, proxying and streaming, metrics.

It holds no routing logic: each request is parsed into a `cache_policy.types.RequestView`,
`cache_policy` decides, and this package carries the decision out.
"""

DISTRIBUTION = "rollout-router"


def package_version() -> str:
    """This package's version, from its installed metadata (``"unknown"`` when it is not installed,
    e.g. run from a checkout with ``PYTHONPATH``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"
