"""The routing-prefix fill of partial prediction (sMLP section 3.2.2), read from a data folder.

A partial-prediction model predicts nothing from its first P positions (the routing prefix), so a
prompt that ends before position P is left-filled with the last P tokens of real text: the data
folder's binarized valid split (test, or train, if it has none), read with fairseq's own reader
and ending at a line end. fairseq-generate / fairseq-interactive (generation_patches.py),
smlp-zeroshot and smlp-generate fill with it; `smlp.generation.fill_prefix` places the fill.
"""
from __future__ import annotations

import os

__all__ = ["routing_prefix_fill"]


def routing_prefix_fill(dictionary, folder, positions: int) -> tuple[list[int], str]:
    """(tokens, where from): the last `positions` tokens of the binarized data in `folder` (None: no
    folder), as ids of the fairseq `dictionary`. They end with the </s> of a line end."""
    if positions <= 0:
        return [], ""
    from fairseq.data import data_utils

    for split in ("valid", "test", "train"):
        prefix = os.path.join(str(folder), split)
        ds = data_utils.load_indexed_dataset(prefix, dictionary) if folder is not None else None
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
