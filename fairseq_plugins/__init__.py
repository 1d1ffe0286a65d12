"""fairseq plugins for sMLP: `fairseq-train --user-dir fairseq_plugins --arch smlp_lm_tiny ...`.

Registers the models smlp_lm, gmlp_lm, moe_transformer_lm with their presets, and the criterion
smlp_lm_loss; allows torch's safe checkpoint loader to read fairseq checkpoints.
"""
from . import criterion, models  # noqa: F401  (registration)
from .checkpoints import allow_fairseq_checkpoints

allow_fairseq_checkpoints()
