"""The tree the multi-process checkpoint tests save and load (shared by the test and the
worker processes): integer-valued float32 so that Partial(sum) splits are exact."""

import numpy as np

VALUES = {
    "w": (np.arange(13 * 6, dtype=np.float32).reshape(13, 6) * 7) % 23 - 11,  # uneven over 2, 4 and 8
    "b": np.arange(10, dtype=np.float32) - 3,
    "e": (np.arange(9 * 5, dtype=np.int32).reshape(9, 5) * 3) % 17,
}
# name -> (mesh, placements) on the grid (2 x 4: dp, tp) or the line (8: x) mesh
SAVE_LAYOUTS = {"w": ("grid", "S(0),S(1)"), "b": ("grid", "P,S(0)"), "e": ("line", "S(1)")}
LOAD_LAYOUTS = {"w": ("line", "S(1)"), "b": ("grid", "(tp,dp)"), "e": ("grid", "R,S(0)")}
# plain (non-DTensor) leaves: optax's step count, replicated on the grid mesh, and an array
# split over both processes (dp rows), saved whole once and read by every process
PLAIN = {"count": np.int32(11), "rows": np.arange(8 * 3, dtype=np.float32).reshape(8, 3)}
PLAIN_SPECS = {"count": (), "rows": ("dp",)}
