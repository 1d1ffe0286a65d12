"""Deprecated path: the SGU and the gMLP block moved to smlp.gmlp, the spatial weights' helpers to
smlp.spatial (this name works for one more release)."""
from .deprecation import warn_moved
from .gmlp import GMLPBlock, SpatialGatingUnit, SpatialProjection
from .spatial import causal_weight, check_length, init_spatial_, uniform_per_slice_

__all__ = ["check_length", "causal_weight", "init_spatial_", "uniform_per_slice_", "SpatialProjection",
           "SpatialGatingUnit", "GMLPBlock"]

warn_moved(__name__, "smlp.gmlp (the SGU, the gMLP block) and smlp.spatial (check_length, causal_weight, "
                     "init_spatial_, uniform_per_slice_)")
