"""Text handling shared by data preparation, evaluation and generation: reading a data folder's
binarized text back (the routing-prefix fill of partial prediction, sMLP section 3.2.1)."""
from __future__ import annotations

import os

from smlp_launch.data import Encoder, load_binarized

__all__ = ["routing_prefix_fill"]


def routing_prefix_fill(encoder: Encoder, positions: int) -> tuple[list[int], str]:
    """(tokens, where from): the last `positions` tokens of the data folder's valid split (test,
    train if it has none), read with fairseq's own reader. They end with the </s> of a line end."""
    if positions <= 0:
        return [], ""
    folder = encoder.data_dir
    for split in ("valid", "test", "train"):
        prefix = os.path.join(str(folder), split)
        ds = load_binarized(prefix, encoder.dictionary) if folder is not None else None
        if ds is None or int(ds.sizes.sum()) < positions:
            continue
        out: list[int] = []
        for i in range(len(ds) - 1, -1, -1):  # from the end: a few sentences suffice
            out = ds[i].tolist() + out
            if len(out) >= positions:
                return out[-positions:], prefix
    raise FileNotFoundError(
        f"the model routes on its first {positions} positions and prompts shorter than that are preceded by "
        f"real text from the data folder, but {folder} has no binarized valid/test/train split with "
        f"{positions} tokens; pass --data-dir with the binarized data folder, or --prefix-fill eos to fill "
        f"with </s> (a prefix the router never saw in training)")
