"""fairseq the way its users drive it: flags and workflows of fairseq's own recipes on our models.

Each is honoured as fairseq does it or refused in one line before any work (docs/training.md, "From fairseq
habits"): --add-bos-token, torchrun, fairseq-hydra-train with the presets' configs, --checkpoint-activations,
averaging the last saves of a shard set.
"""
from __future__ import annotations

import pytest
import torch

from fairseq_helpers import PLUGINS, TINY_TRAIN, assert_ok, run_in_process, train_losses, valid_losses


@pytest.mark.slow
def test_add_bos_token_trains_with_a_spatial_weight_one_position_longer(tiny_lm_data, tmp_path):
    """--add-bos-token puts a BOS before each 32-token block: the model is built for 33 positions, trains, and
    its checkpoint validates with the same flags (the saved model keeps its 33 positions)."""
    flags = [str(tiny_lm_data), "--user-dir", PLUGINS, "--task", "language_modeling", "--tokens-per-sample", "32",
             "--batch-size", "8", "--add-bos-token"]
    log = assert_ok(run_in_process("fairseq-train", [*flags, *TINY_TRAIN, "--arch", "smlp_lm_tiny", "--max-update",
                                                     "2", "--disable-validation", "--save-dir", str(tmp_path)]))
    assert sorted(train_losses(log)) == [1, 2], log[-2000:]
    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    spatial = {k: tuple(v.shape) for k, v in state["model"].items() if k.endswith("proj.weight") and v.dim() == 3}
    assert spatial and all(shape[-2:] == (33, 33) for shape in spatial.values()), spatial
    valid = assert_ok(run_in_process("fairseq-validate", [*flags, "--path", str(tmp_path / "checkpoint_last.pt"),
                                                          "--valid-subset", "valid"]))
    assert len(valid_losses(valid)) == 1, valid[-2000:]
