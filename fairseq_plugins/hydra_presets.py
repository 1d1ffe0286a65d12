"""fairseq-hydra-train with an architecture preset as the model's `_name` (`model: {_name: smlp_lm_tiny}`).

fairseq-train applies a preset while it parses `--arch` (the preset fills the sizes the command line leaves
unset). fairseq-hydra-train never calls it for a model registered with a dataclass: `add_defaults` fills every
field the configuration leaves out with the model's dataclass defaults (`smlp_lm`'s: 512 wide, 6 layers), so
`_name: smlp_lm_tiny` trained another model than `--arch smlp_lm_tiny`, silently. `install()` wraps
`fairseq.dataclass.initialize.add_defaults` (and fairseq_cli.train's name for it, which fairseq-hydra-train's
training calls after importing --user-dir): when the model's `_name` is a preset of one of our models, the
preset first fills the fields the configuration leaves out, as fairseq-train's parse does; fields the
configuration gives win. configs/hydra/ holds every recipe of configs/ in this form (smlp_launch.hydra_configs).
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["apply_preset", "install"]


def apply_preset(cfg) -> str | None:
    """Fill `cfg.model` (an omegaconf config) from its `_name`'s preset where it leaves a field out; returns the
    preset's name, or None when `_name` is not a preset of our models."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_NAME_REGISTRY, MODEL_DATACLASS_REGISTRY
    from omegaconf import open_dict

    from .config import FAMILIES_BY_MODEL

    model = cfg.get("model") if hasattr(cfg, "get") else None
    name = model.get("_name") if model is not None and hasattr(model, "get") else None
    if not isinstance(name, str) or ARCH_MODEL_NAME_REGISTRY.get(name) not in FAMILIES_BY_MODEL \
            or name in MODEL_DATACLASS_REGISTRY:
        return None
    given = argparse.Namespace(**{k: model[k] for k in model if k != "_name"})
    ARCH_CONFIG_REGISTRY[name](given)  # sets only what is unset, as under fairseq-train's --arch
    fields = MODEL_DATACLASS_REGISTRY[ARCH_MODEL_NAME_REGISTRY[name]].__dataclass_fields__
    with open_dict(model):
        for key, value in vars(given).items():
            if key in fields and key not in model:
                model[key] = value
    return name


def install() -> bool:
    from fairseq.dataclass import initialize

    original = initialize.add_defaults
    if getattr(original, "_smlp_presets", False):
        return False

    def add_defaults(cfg) -> None:
        apply_preset(cfg)
        return original(cfg)

    add_defaults._smlp_presets = True
    add_defaults.__wrapped__ = original
    initialize.add_defaults = add_defaults
    for module in ("fairseq_cli.train", "fairseq_cli.hydra_train"):  # their own names for it, if imported
        if module in sys.modules and getattr(sys.modules[module], "add_defaults", None) is original:
            sys.modules[module].add_defaults = add_defaults
    return True
