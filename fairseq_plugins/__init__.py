"""fairseq plugins for sMLP: `fairseq-train --user-dir fairseq_plugins --arch smlp_lm_tiny ...`.

Registers the models smlp_lm, gmlp_lm, moe_transformer_lm with their presets (`models`), and the
criterion smlp_lm_loss (`criterion`), then applies our patches to fairseq through `patches`, the one
list of them in order (checkpoint loading, rank-shard sets, what a run loads, data checks, ranks under
torchrun, presets under fairseq-hydra-train, --zero-sharding os, mixed precision, generation, evaluation
logging): each with what it fixes.
"""
from . import criterion, models  # noqa: F401  (registration)
from .patches import apply_patches

apply_patches()
