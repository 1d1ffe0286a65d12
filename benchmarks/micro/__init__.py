"""Programs that measure one thing outside the run store, each `python -m smlp_bench.micro.NAME`:

    step_breakdown  where a training step of each family goes, per rank and block, its operators and host syncs
                    (the one profiler breakdown; `smlp-bench breakdown`)
    host_syncs      the host-sync counter it and tests/test_hot_path.py use
    generation      cached decoding against full recomputation (`smlp-bench-generation`)
    eval_routing    the balanced routers' evaluation routings on a checkpoint
"""
from __future__ import annotations

import argparse
from pathlib import Path


def parser(prog: str, description: str, out: str) -> argparse.ArgumentParser:
    """A measurement's command line with the options they share: --out (its JSON record) and --threads."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(out), help=f"the JSON record (default {out})")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    return p
