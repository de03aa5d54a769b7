"""Draw the figures of the docs: ``python docs/make_figures.py`` (needs matplotlib).

docs/img/rfc_layouts.png: the RFC's figure, an 8x2 tensor on a 4x2 ("dp", "tp") mesh
under several placements, blocks coloured by the ranks that hold them.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from placements2jax import Layout, init_device_mesh  # noqa: E402
from placements2jax.demo import RFC_PLACEMENTS  # noqa: E402
from placements2jax.visualize import plot  # noqa: E402


def _entry(entry: object) -> str:
    """A placement or alias entry in the command line's text syntax: S(0), (dp,tp), None."""
    return f"({','.join(entry)})" if isinstance(entry, tuple) else str(entry)


def main(out_dir: Path) -> None:
    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    layouts = [Layout.from_device_mesh(mesh)(p) for p in RFC_PLACEMENTS]
    titles = [",".join(_entry(e) for e in p) for p in RFC_PLACEMENTS]
    figure = plot(layouts, (8, 2), titles=titles, ncols=3)
    out_dir.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_dir / "rfc_layouts.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "img")
