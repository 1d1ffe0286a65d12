"""train.sbatch's check of SAVE_DIR before its tasks start: `python -m smlp_launch.resume_check SAVE_DIR`.

Refuses in one line (exit 2) a folder another job trains in (smlp/folder_lock.py: the line names the holder),
before any file is touched; then, holding the folder's lock, replaces a checkpoint_last that cannot be read by the
newest complete save of the same layout, through the one writer (fairseq_plugins.save_dir.repair_checkpoint_last).
"""
from __future__ import annotations

import os
import sys

from smlp import folder_lock


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m smlp_launch.resume_check SAVE_DIR", file=sys.stderr)
        return 2
    save_dir = args[0]
    if not os.path.isdir(save_dir):
        return 0  # a first start: nothing to check
    try:
        folder_lock.hold(save_dir, "train.sbatch")
    except folder_lock.FolderInUse as exc:
        print(f"[train.sbatch] error: {exc}", file=sys.stderr)
        return 2
    try:
        from smlp.third_party import quiet_imports

        quiet_imports(deepspeed=False)  # the plugins' package imports fairseq: no optimizer, no scikit-learn here
        from fairseq_plugins.errors import RefusedInput
        from fairseq_plugins.save_dir import repair_checkpoint_last

        try:
            done = repair_checkpoint_last(save_dir)
        except RefusedInput as exc:
            print(f"[train.sbatch] error: {exc}", file=sys.stderr)
            return 1
        print(f"[train.sbatch] {done}" if done else f"[train.sbatch] resuming from the checkpoints in {save_dir}",
              file=sys.stderr)
        return 0
    finally:
        folder_lock.release(save_dir)


if __name__ == "__main__":
    sys.exit(main())
