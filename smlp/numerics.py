"""Deprecated path: `router_logits` moved to smlp.routing.logits, `no_autocast` to smlp.precision
(this name works for one more release)."""
from .deprecation import warn_moved
from .precision import no_autocast
from .routing.logits import router_logits

__all__ = ["no_autocast", "router_logits"]

warn_moved(__name__, "router_logits from smlp.routing.logits, no_autocast from smlp.precision")
