"""smlp-consolidate: merge a checkpoint's rank shards into one file (`fairseq_plugins.checkpoints.consolidate`),
for evaluation on any world size that divides the number of experts; with --num-update-checkpoints N (or
--num-epoch-checkpoints N) average the last N saves of a save directory into one file, each save merged first
(`fairseq_plugins.averaging`: what fairseq's scripts/average_checkpoints.py does for one-file saves).

Started without DeepSpeed (no optimizer is built) and without third-party import warnings (smlp/third_party.py),
which must be settled before the plugin package imports fairseq. The output is checked before the shards are
read: a path under a file, an unwritable folder, or an existing file that smlp-consolidate did not write (a
training checkpoint) is refused; missing folders of --out are created."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from smlp.third_party import quiet_imports

PROG = "smlp-consolidate"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Merge the per-rank expert shards (X-rank-R.pt) of a checkpoint X.pt into X.pt holding all "
                    "experts, for evaluation on any world size that divides the number of experts.")
    parser.add_argument("checkpoint",
                        help="checkpoint name without the rank suffix, e.g. checkpoints/checkpoint_best.pt; with "
                             "--num-update-checkpoints / --num-epoch-checkpoints, the save directory")
    parser.add_argument("--out", help="where to write (default: the checkpoint name itself; missing folders are "
                                      "created; required when averaging)")
    average = parser.add_mutually_exclusive_group()
    average.add_argument("--num-update-checkpoints", type=int, metavar="N",
                         help="average the last N numbered saves of the directory (checkpoint_<epoch>_<update>, from "
                              "--save-interval-updates), as fairseq's scripts/average_checkpoints.py")
    average.add_argument("--num-epoch-checkpoints", type=int, metavar="N",
                         help="average the last N end-of-epoch saves of the directory (checkpoint<epoch>)")
    return parser


def consolidate_main(argv: Sequence[str] | None = None) -> int:
    from fairseq_plugins.checkpoints import consolidate, shard_paths
    from smlp_eval.files import check_output_path

    parser = build_parser()
    args = parser.parse_args(argv)
    n, kind = ((args.num_update_checkpoints, "update") if args.num_update_checkpoints is not None else
               (args.num_epoch_checkpoints, "epoch"))
    if n is not None and not args.out:
        parser.error(f"--num-{kind}-checkpoints averages saves into a new file: give it with --out (e.g. --out "
                     f"{args.checkpoint.rstrip('/')}/averaged.pt)")
    try:
        check_output_path(args.out or args.checkpoint, "--out" if args.out else "the checkpoint")
        if n is not None:
            from fairseq_plugins.averaging import average_last

            saves = average_last(args.checkpoint, n, args.out, kind)
            print(f"wrote {args.out} (the average of {', '.join(os.path.basename(s) for s in saves)})")
            return 0
        out = consolidate(args.checkpoint, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(shard_paths(args.checkpoint))} shards merged)")
    return 0


def main() -> None:
    quiet_imports(deepspeed=False)
    sys.exit(consolidate_main())


if __name__ == "__main__":
    main()
