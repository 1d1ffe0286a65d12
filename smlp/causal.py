"""Deprecated path: the causal spatial products moved to smlp.spatial, `explicit_spatial` to
smlp.flop_forms (this name works for one more release)."""
from .deprecation import warn_moved
from .flop_forms import explicit_spatial
from .spatial import BLOCK, causal_product, causal_product_rows, default_block, executed_pairs, masked_dense_product

__all__ = ["BLOCK", "causal_product", "causal_product_rows", "default_block", "executed_pairs", "explicit_spatial",
           "masked_dense_product"]

warn_moved(__name__, "smlp.spatial (explicit_spatial: smlp.flop_forms)")
