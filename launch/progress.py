"""smlp-launch's progress on a terminal: rank 0's log read line by line, a bar over the updates.

On a terminal the launcher reads rank 0's output instead of letting it through (smlp_launch.local): every line
goes to LOG_DIR/rank0.log, the training lines (`train_inner`) move a bar over --max-update with the loss and
words/s (tqdm adds the rate and the time left), and every other line (validation, checkpoints, warnings,
errors) is printed above the bar, as smlp-demo shows its training. Elsewhere (a file, a pipe, SLURM) rank 0
writes to the console itself.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import IO

from .fairseq_log import train_fields, valid_fields

__all__ = ["Progress"]


class Progress:
    """Feed it rank 0's lines (`feed`), or let it read them from a stream in a thread (`follow`)."""

    def __init__(self, total: int | None, log_path: Path, out: IO):
        from tqdm import tqdm

        self.out = out
        self.log = open(log_path, "w", encoding="utf-8")
        self.log_path = log_path
        self.bar = tqdm(total=total or None, unit="upd", desc="training", dynamic_ncols=True, file=out,
                        leave=True)
        self.thread: threading.Thread | None = None
        self.started = False

    def feed(self, line: str) -> None:
        self.log.write(line)
        self.log.flush()
        text = line.rstrip("\n")
        fields = train_fields(text)
        if fields and "num_updates" in fields:
            updates = int(float(fields["num_updates"]))
            if not self.started:  # the rate (and the time left) from the first update on, not from the start-up
                self.started = True
                self.bar.reset(total=self.bar.total)
                self.bar.initial = self.bar.n = self.bar.last_print_n = updates
            self.bar.update(updates - self.bar.n)
            shown = {k: fields[k] for k in ("loss", "wps") if k in fields}
            self.bar.set_postfix({"loss": shown.get("loss", "?"), "words/s": shown.get("wps", "?")}, refresh=True)
            return
        valid = valid_fields(text)
        if valid and "loss" in valid:
            self.bar.write(f"valid @ {valid.get('num_updates', '?')} updates: loss {valid['loss']} (base 2), "
                           f"perplexity {valid.get('ppl', '?')}", file=self.out)
            return
        if text:
            self.bar.write(text, file=self.out)

    def follow(self, stream: IO) -> None:
        def read():
            for line in stream:
                self.feed(line)

        self.thread = threading.Thread(target=read, name="rank0-progress", daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.bar.close()
        self.log.close()
