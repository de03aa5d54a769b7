"""The state dict the torch checkpoint bridge test writes with torch and reads with us."""

import ml_dtypes
import numpy as np

PLACEMENTS = {"w": ("S0", "S1"), "b": ("R", "S0"), "e": ("S1", "R")}  # on torch's (2, 2) mesh (dp, tp)


def full_values() -> dict[str, np.ndarray]:
    return {
        "w": (np.arange(13 * 7, dtype=np.float32).reshape(13, 7) * 0.37) % 5 - 2,  # uneven over 2 x 2
        "b": np.arange(9, dtype=np.float32) * 1.5 - 4,
        "e": ((np.arange(5 * 11, dtype=np.float32).reshape(5, 11) * 0.77) % 3).astype(ml_dtypes.bfloat16),
    }
