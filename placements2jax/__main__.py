"""Command line: ``python -m placements2jax <command>`` (also the ``placements2jax`` script).

The commands live in :mod:`placements2jax.cli`; this entry point only makes JAX
simulate CPU devices before it starts.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .cli import main as cli_main


def _use_simulated_cpu_devices(count: int = 8) -> None:
    """On a machine without accelerators, let JAX simulate ``count`` CPU devices.

    Must run before JAX initializes its backend; on GPU/TPU hosts it changes nothing.
    When JAX has already started (an embedding program, a test), its devices stay as they
    are and a mesh larger than them is refused with a clear error.
    """
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(argv, start_jax=_use_simulated_cpu_devices)


if __name__ == "__main__":
    sys.exit(main())
