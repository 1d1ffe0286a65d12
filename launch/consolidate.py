"""smlp-consolidate's console entry: merge a checkpoint's rank shards into one file
(fairseq_plugins.checkpoints.consolidate_main), started without DeepSpeed (no optimizer is built) and
without third-party import warnings (smlp/third_party.py), which must be settled before the plugin
package imports fairseq."""
from __future__ import annotations

import sys

from smlp.third_party import quiet_imports


def main() -> None:
    quiet_imports(deepspeed=False)
    from fairseq_plugins.checkpoints import consolidate_main

    sys.exit(consolidate_main())


if __name__ == "__main__":
    main()
