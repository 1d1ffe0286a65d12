"""A fairseq --user-dir for the fault tests: our plugins plus faults injected on cue (tests only).

Importing it registers everything fairseq_plugins registers, then reads these variables:

  SMLP_FAULT_A2A="victim=1,call=N,sleep=S[,restart=C]"
      On the N-th row exchange (all_to_all_single) of a run (on SLURM restart C only, when given), the victim rank
      prints
      "[fault] rank R inside all2all call N" and enters the collective, while every other rank
      sleeps S seconds before entering it: the victim is blocked inside the all2all, waiting.
  SMLP_FAULT_SLOW_SAVE="rank=1,nth=K,sleep=S[,restart=C][,rename=1]"
      The K-th checkpoint write of the rank (on SLURM restart C only, when given) prints
      "[fault] rank R slow save of update U" and sleeps S seconds before writing: a save in progress
      on that rank while the others wait for it (they name no file of a save before every rank has
      written its own). With rename=1 it sleeps later, once every rank has written its copy of that
      save to checkpoint_last, just before renaming its own: the other ranks have renamed theirs, and
      checkpoint_last is a mixed set (rank 0 at update U, this rank at the save before).
  SMLP_FAULT_STOP_ALL_REDUCE="victim=1,call=N"
      Before the N-th all-reduce fairseq itself makes (`fairseq.distributed.utils.all_reduce`: the
      gradients under legacy_ddp, the logging outputs), the victim rank prints "[fault] rank R stops
      before fairseq all-reduce N" and stops itself (SIGSTOP, a hung peer whose sockets stay open):
      the other ranks wait for it inside fairseq's own process group, not the default one.
  SMLP_FAULT_STEP_SLEEP="S[,restart=C]"
      Every training step sleeps S seconds (a bigger model, so a time limit arrives mid-run).
  SMLP_FAULT_KILL_AT_UPDATE="U"
      Every rank prints "[fault] rank R killed at update U" and kills itself (SIGKILL) as it starts the
      training step after update U: a job killed between two checkpoints.
  SMLP_FAULT_ENOSPC="nth=K[,bytes=B][,rank=R][,create=1]"
      The disk fills up: on every rank (on rank R only, when given), the K-th write of a numbered checkpoint
      (checkpoint_E_U*.pt) prints "[fault] rank R disk full while writing NAME" and raises ENOSPC once B bytes
      (default 65536) are written; with create=1 its temporary file cannot even be created (ENOSPC from open).
  SMLP_FAULT_ABORT_AT_EXIT=1
      The process aborts (SIGABRT, status 134) if it exits through the C library's exit(), after the interpreter's
      finalization, as a C++ static destructor of torch's once did after a failed run ("terminate called without
      an active exception"): a worker that failed must end with os._exit and its own status (launch/worker.py).

And, not a fault, a record for the tests of the balanced routers' prices (smlp/routing/prices.py):

  SMLP_RECORD_PRICES=DIR
      Every fold of the prices (once per optimizer step) appends a line to DIR/rankR.jsonl: for each balanced
      layer, in module order, the statistic it recorded since the last fold (pending_E1, before the
      all-reduce) and how many assignments recorded it.
"""
import errno
import os
import re
import signal
import sys
import time

import fairseq_plugins  # noqa: F401  (registers the models, installs the checkpoint hooks)


def _spec(name):
    raw = os.environ.get(name, "")
    out = {}
    for i, part in enumerate(p for p in raw.split(",") if p):
        key, _, value = part.partition("=")
        out[key if value else str(i)] = float(value if value else key)
    return out


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _this_restart(spec):
    return "restart" not in spec or int(spec["restart"]) == int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def _say(msg):
    print(f"[fault] {msg}", file=sys.stderr, flush=True)


a2a = _spec("SMLP_FAULT_A2A")
if a2a and _this_restart(a2a):
    import smlp.dispatch as dispatch

    _exchange = dispatch._exchange
    calls = [0]

    def exchange(x, out_splits, in_splits, group):
        calls[0] += 1
        if calls[0] == int(a2a["call"]):
            if _rank() == int(a2a["victim"]):
                _say(f"rank {_rank()} inside all2all call {calls[0]}")
            else:
                time.sleep(a2a["sleep"])
        return _exchange(x, out_splits, in_splits, group)

    dispatch._exchange = exchange

slow = _spec("SMLP_FAULT_SLOW_SAVE")
if slow and _this_restart(slow):
    from fairseq import checkpoint_utils

    _persist = checkpoint_utils.torch_persistent_save
    saves = [0]

    renaming = []  # the update whose copy to checkpoint_last waits before its rename (rename=1)

    def torch_persistent_save(obj, filename, async_write=False):
        if _rank() == int(slow["rank"]):
            saves[0] += 1
            if saves[0] == int(slow["nth"]):
                update = obj['optimizer_history'][-1]['num_updates']
                if slow.get("rename"):
                    renaming.append(update)
                else:
                    _say(f"rank {_rank()} slow save of update {update}")
                    time.sleep(slow["sleep"])
        return _persist(obj, filename, async_write=async_write)

    checkpoint_utils.torch_persistent_save = torch_persistent_save
    if slow.get("rename"):
        from fairseq_plugins import atomic_files

        _agree = atomic_files._SaveAgreement.__call__

        def agree(self, error=None):
            _agree(self, error)  # every rank has written its file
            if renaming and error is None and os.path.basename(self.path).startswith("checkpoint_last"):
                _say(f"rank {_rank()} slow save of update {renaming.pop()}")
                time.sleep(slow["sleep"])

        atomic_files._SaveAgreement.__call__ = agree

step = _spec("SMLP_FAULT_STEP_SLEEP")
if step and _this_restart(step):
    from fairseq.trainer import Trainer

    _train_step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        time.sleep(step["0"])
        return _train_step(self, *args, **kwargs)

    Trainer.train_step = train_step

stop = _spec("SMLP_FAULT_STOP_ALL_REDUCE")
if stop:
    from fairseq.distributed import utils as fairseq_distributed

    _all_reduce = fairseq_distributed.all_reduce
    reduces = [0]

    def all_reduce(tensor, group, op="sum"):
        reduces[0] += 1
        if reduces[0] == int(stop["call"]) and _rank() == int(stop["victim"]):
            _say(f"rank {_rank()} stops before fairseq all-reduce {reduces[0]}")
            os.kill(os.getpid(), signal.SIGSTOP)
        return _all_reduce(tensor, group, op=op)

    fairseq_distributed.all_reduce = all_reduce

kill = _spec("SMLP_FAULT_KILL_AT_UPDATE")
if kill:
    from fairseq.trainer import Trainer

    _step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        if self.get_num_updates() == int(kill["0"]):
            _say(f"rank {_rank()} killed at update {self.get_num_updates()}")
            os.kill(os.getpid(), signal.SIGKILL)
        return _step(self, *args, **kwargs)

    Trainer.train_step = train_step

record = os.environ.get("SMLP_RECORD_PRICES")
if record:
    import json

    from smlp.routing import prices as _prices

    _observe, _fold = _prices.RouterPrices.observe, _prices.fold_prices

    def observe(self, price_E, rows):
        self._smlp_observed = getattr(self, "_smlp_observed", 0) + 1
        return _observe(self, price_E, rows)

    def fold_prices(model, group=None, applied=None):
        layers = []
        for m in _prices.price_modules(model):
            layers.append({"pending": m.pending_E1.tolist(), "observed": getattr(m, "_smlp_observed", 0)})
            m._smlp_observed = 0
        with open(os.path.join(record, f"rank{_rank()}.jsonl"), "a") as f:
            f.write(json.dumps({"layers": layers}) + "\n")
        return _fold(model, group, applied)

    _prices.RouterPrices.observe = observe
    _prices.fold_prices = fold_prices

class FullDisk:
    """A file that takes `room` bytes, then raises ENOSPC (the part written lands, as on a real full disk);
    tests/test_checkpoint_sets.py uses it too."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            self.f.write(bytes(data[:self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


full = _spec("SMLP_FAULT_ENOSPC")
if full:
    from fairseq_plugins import atomic_files

    _atomic_write = atomic_files.atomic_write
    numbered = [0]

    def no_room_to_create(real_open, name):
        def open_(path, flags, *args, **kwargs):  # the temporary file beside `name` (mkstemp uses os.open too)
            if flags & os.O_CREAT and os.path.basename(str(path)).startswith(f".{name}.smlp-tmp-"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real_open(path, flags, *args, **kwargs)
        return open_

    def atomic_write(path, write, *args, **kwargs):
        if re.match(r"checkpoint_\d+_\d+", os.path.basename(path)):
            numbered[0] += 1
            if numbered[0] == int(full["nth"]) and int(full.get("rank", _rank())) == _rank():
                name = os.path.basename(path)
                _say(f"rank {_rank()} disk full while {'creating' if full.get('create') else 'writing'} {name}")
                room, real_fdopen, real_open = int(full.get("bytes", 65536)), os.fdopen, os.open
                if full.get("create"):
                    os.open = no_room_to_create(real_open, name)
                else:
                    os.fdopen = lambda fd, *a, **k: FullDisk(real_fdopen(fd, *a, **k), room)
                try:  # the file atomic_write opens runs out of space
                    return _atomic_write(path, write, *args, **kwargs)
                finally:
                    os.fdopen, os.open = real_fdopen, real_open
        return _atomic_write(path, write, *args, **kwargs)

    atomic_files.atomic_write = atomic_write


if os.environ.get("SMLP_FAULT_ABORT_AT_EXIT"):
    import ctypes

    libc = ctypes.CDLL(None)
    libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)  # run by exit(), not by _exit()
