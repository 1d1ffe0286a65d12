"""The binarizing step of smlp-prepare-data: `fairseq-preprocess` on the encoded splits, and the check that
fairseq wrote exactly the sentencepiece ids (read back with fairseq's own reader).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from smlp_eval.text import DataPrepError, load_binarized

from .corpus import SPLITS

# `fairseq-preprocess` itself, except that logging is set up after fairseq is imported: importing
# fairseq here imports deepspeed, which installs a WARNING-level root handler first, so fairseq's
# own logging.basicConfig does nothing and its INFO lines (sizes, "% replaced by <unk>") vanish.
_PREPROCESS_MAIN = (
    "import logging, sys\n"
    "from smlp.third_party import quiet_imports\n"
    "quiet_imports(deepspeed=False)\n"  # binarizing needs no optimizer
    "from fairseq_cli.preprocess import cli_main\n"
    "logging.basicConfig(format='%(asctime)s | %(levelname)s | %(name)s | %(message)s',"
    " level=logging.INFO, stream=sys.stdout, force=True)\n"
    "sys.argv[0] = 'fairseq-preprocess'\n"
    "cli_main()\n"
)


def _fairseq_preprocess_cmd() -> list[str]:
    return [sys.executable, "-c", _PREPROCESS_MAIN]


def run_fairseq_preprocess(work: Path, dest: Path, srcdict: Path, workers: int) -> None:
    cmd = _fairseq_preprocess_cmd() + [
        "--only-source", "--task", "language_modeling", "--dataset-impl", "mmap",
        "--srcdict", str(srcdict), "--destdir", str(dest), "--workers", str(max(1, workers)),
        "--trainpref", str(work / "train.spm"), "--validpref", str(work / "valid.spm"),
        "--testpref", str(work / "test.spm"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    with open(dest / "preprocess.log", "a", encoding="utf-8") as f:   # fairseq leaves it empty
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise DataPrepError(f"fairseq-preprocess failed (exit {proc.returncode}):\n{tail}")


def _mmap_digest(prefix: Path):
    """(sentence sizes, sha256 of the little-endian int32 id stream) of a binarized split."""
    from smlp.third_party import quiet_imports

    quiet_imports()  # fairseq's reader: this process's first fairseq import, without DeepSpeed's warnings
    ds = load_binarized(prefix)
    if ds is None:
        raise DataPrepError(f"fairseq-preprocess wrote no {prefix}.bin/.idx")
    digest = hashlib.sha256()
    if (stream := _id_stream(ds)) is not None:
        digest.update(stream.astype("<i4").tobytes())
    else:
        for i in range(len(ds)):
            digest.update(ds[i].numpy().astype("<i4").tobytes())
    # a copy: ds.sizes is a view of the index file's mmap, which fairseq closes when ds is collected (reading the view
    # after this function returned was a segmentation fault: check_binarized's error message sums it)
    return ds.sizes.copy(), digest.hexdigest()


def _id_stream(ds):
    """Every sentence's ids in order as one array, read from the reader's own buffer when its sentences lie end to
    end in it (what fairseq's builder writes): the same bytes as reading sentence by sentence, without a Python
    step per sentence (146k of them in the demo corpus: seconds). None when the reader is not laid out that way."""
    import numpy as np

    index, buffer = getattr(ds, "_index", None), getattr(ds, "_bin_buffer", None)
    pointers, dtype = getattr(index, "_pointers", None), getattr(index, "dtype", None)
    if buffer is None or pointers is None or dtype is None:
        return None
    sizes, itemsize = np.asarray(ds.sizes, dtype=np.int64), np.dtype(dtype).itemsize
    ends = np.cumsum(sizes) * itemsize
    if len(sizes) and (int(pointers[0]) != 0 or not np.array_equal(np.asarray(pointers[1:]), ends[:-1])):
        return None
    return np.frombuffer(buffer, dtype=dtype, count=int(sizes.sum()))


def check_binarized(tmp: Path, counts: dict, digests: dict[str, str]) -> None:
    """fairseq's ids must be exactly the sentencepiece ids (+ </s> per line): compare the streams,
    read back with fairseq's own reader."""
    for s in SPLITS:
        sizes, got = _mmap_digest(tmp / s)
        if len(sizes) != counts[s]["sentences"] or got != digests[s]:
            raise DataPrepError(f"fairseq-preprocess wrote {len(sizes)} sentences / {int(sizes.sum())} "
                                f"tokens for {s} that differ from the sentencepiece ids "
                                f"({counts[s]['sentences']} / {counts[s]['fairseq_tokens']}); this is a bug")
