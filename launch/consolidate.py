"""smlp-consolidate: merge a checkpoint's rank shards into one file (`fairseq_plugins.checkpoints.consolidate`),
for evaluation on any world size that divides the number of experts.

Started without DeepSpeed (no optimizer is built) and without third-party import warnings (smlp/third_party.py),
which must be settled before the plugin package imports fairseq. The output is checked before the shards are
read: a path under a file, an unwritable folder, or an existing file that smlp-consolidate did not write (a
training checkpoint) is refused; missing folders of --out are created."""
from __future__ import annotations

import argparse
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
                        help="checkpoint name without the rank suffix, e.g. checkpoints/checkpoint_best.pt")
    parser.add_argument("--out", help="where to write (default: the checkpoint name itself; missing folders are "
                                      "created)")
    return parser


def consolidate_main(argv: Sequence[str] | None = None) -> int:
    from fairseq_plugins.checkpoints import consolidate, shard_paths
    from smlp_eval.files import check_output_path

    args = build_parser().parse_args(argv)
    try:
        check_output_path(args.out or args.checkpoint, "--out" if args.out else "the checkpoint")
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
