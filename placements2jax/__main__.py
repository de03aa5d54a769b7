"""Command line: ``python -m placements2jax <command>`` (also the ``placements2jax`` script)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _use_simulated_cpu_devices(count: int = 8) -> None:
    """On a machine without accelerators, let JAX simulate ``count`` CPU devices.

    Must run before JAX initializes its backend; on GPU/TPU hosts it changes nothing.
    """
    import jax

    jax.config.update("jax_num_cpu_devices", count)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="placements2jax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="worked examples on 8 (simulated) devices")
    args = parser.parse_args(argv)
    _use_simulated_cpu_devices()
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
