"""Start sglang-router with any policy its Rust core knows (run with the Rust routers' venv).

``python -m bench.h2h.sglang_launch POLICY [sglang-router launch flags...]``: the CLI's ``--policy``
choices (0.3.2) omit ``consistent_hashing`` and ``prefix_hash``, which ``Router.from_args`` accepts
(``sglang_router.router.policy_from_str``); the policy is set after parsing.
"""

import sys

from sglang_router.launch_router import launch_router, parse_router_args


def main(argv: list[str]) -> None:
    policy, rest = argv[0], argv[1:]
    args = parse_router_args(rest)
    args.policy = policy
    launch_router(args)


if __name__ == "__main__":
    main(sys.argv[1:])
