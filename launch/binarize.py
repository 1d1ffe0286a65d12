"""The binarizing step of smlp-prepare-data: each split's ids written in fairseq's mmap indexed format, the files
`fairseq-preprocess --dataset-impl mmap --srcdict dict.txt` writes from the same pieces (byte for byte:
tests/test_data.py compares them), and the check that fairseq's own reader and dictionary give back exactly the
sentencepiece ids.

fairseq-preprocess would read the pieces back as text and look each one up in the dictionary, a Python step per
token: 14 of the demo build's 25 s here (two processes), for ids this pipeline already holds, since a fairseq id is
the sentencepiece id (smlp_launch.data). They are written in the integer type fairseq's own rule picks for the
dictionary's size (`best_fitting_int_dtype`), end to end, and the index by fairseq's index writer.
"""
from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

from smlp_eval.text import N_SPECIAL, DataPrepError, load_binarized

from .corpus import SPLITS


class SplitWriter:
    """PREFIX.bin and PREFIX.idx of one split, as fairseq's mmap dataset builder writes them: `add` each batch of
    sentences (their ids, </s> included), then `close` (writes the index)."""

    def __init__(self, prefix: Path, dict_size: int):
        from smlp.third_party import quiet_imports

        quiet_imports()  # fairseq's format module: this process's first fairseq import, without DeepSpeed's warnings
        from fairseq.data.indexed_dataset import best_fitting_int_dtype, data_file_path

        self.prefix, self.dtype, self.sizes = prefix, best_fitting_int_dtype(dict_size), []
        self._bin = open(data_file_path(str(prefix)), "wb")

    def add(self, sentences: list[list[int]]):
        """Writes the sentences; returns their ids end to end (the array written)."""
        import numpy as np

        ids = np.fromiter(itertools.chain.from_iterable(sentences), dtype=self.dtype)
        self._bin.write(ids.tobytes(order="C"))
        self.sizes.extend(len(s) for s in sentences)
        return ids

    def close(self) -> None:
        from fairseq.data.indexed_dataset import MMapIndexedDataset, index_file_path

        self._bin.close()
        with MMapIndexedDataset.Index.writer(index_file_path(str(self.prefix)), self.dtype) as index:
            index.write(self.sizes)


def check_dictionary(path: Path, sp) -> None:
    """fairseq's Dictionary read from dict.txt must give every piece its sentencepiece id (what the binary files
    hold) and be as long as the vocabulary."""
    from fairseq.data import Dictionary

    d, size = Dictionary.load(str(path)), sp.get_piece_size()
    wrong = [i for i in range(N_SPECIAL, size) if d.index(sp.id_to_piece(i)) != i]
    if len(d) != size or wrong:
        raise DataPrepError(f"{path} gives {len(d)} fairseq ids for {size} sentencepiece pieces"
                            + (f", piece {sp.id_to_piece(wrong[0])!r} id {d.index(sp.id_to_piece(wrong[0]))} "
                               f"instead of {wrong[0]}" if wrong else "") + "; this is a bug")


def _mmap_digest(prefix: Path):
    """(sentence sizes, sha256 of the little-endian int32 id stream) of a binarized split."""
    from smlp.third_party import quiet_imports

    quiet_imports()  # fairseq's reader: this process's first fairseq import, without DeepSpeed's warnings
    ds = load_binarized(prefix)
    if ds is None:
        raise DataPrepError(f"no {prefix}.bin/.idx was written")
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
            raise DataPrepError(f"fairseq's reader gives {len(sizes)} sentences / {int(sizes.sum())} "
                                f"tokens for {s} that differ from the sentencepiece ids "
                                f"({counts[s]['sentences']} / {counts[s]['fairseq_tokens']}); this is a bug")
