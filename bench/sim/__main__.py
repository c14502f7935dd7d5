"""Entry point: ``python -m bench.sim --help``."""

from bench.sim.cli import main

if __name__ == "__main__":
    main()
