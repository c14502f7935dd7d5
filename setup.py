"""Build of the one C extension, ``cache_policy._native`` (the rest is in pyproject.toml).

``optional=True``: without a C compiler the package still installs and runs on the pure-Python
code the extension accelerates (``cache_policy.native.NATIVE`` is then None).
``scripts/setup.sh`` builds it in place (``build_ext --inplace``) on every run.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "cache_policy._native", ["cache_policy/_native.c"], include_dirs=["cache_policy/vendor"],
    depends=["cache_policy/vendor/xxhash.h"], extra_compile_args=["-O3"], optional=True)])
