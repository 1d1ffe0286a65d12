"""smlp-bench chaos (--chaos): a 2-rank sMLP-det training killed N times at random moments and resumed each time
ends bitwise equal to the same training uninterrupted (docs/faults.md, "Killed at random, it loses nothing"); with
--amp, in fp16 autocast with a loss scale, gradient overflows injected after every save (benchmarks/chaos_overflow)."""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from smlp_launch.fairseq_log import loaded_updates, train_fields

from .presets import BenchError, check_at_least
from .training import _plugins_dir, check_data

HELP = ("a 2-rank sMLP-det training killed --kills times at random moments (SIGKILL of a worker, SIGTERM of the job, "
        "both also inside a checkpoint write), resumed each time, against the same training uninterrupted: bitwise "
        "equal (chaos.py)")
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
NPROC = 2
# sigkill-worker: one rank (a lost node), the launcher ends the other; sigterm-job: the whole job, as SLURM's
# preemption sends it; *-in-save: the same while a rank writes a checkpoint file, the writer stopped (SIGSTOP) once
# its temporary file appears (fairseq_plugins.checkpoint_sets writes atomically) and checked still writing
KINDS = ("sigkill-worker", "sigterm-job", "sigkill-in-save", "sigterm-in-save")
IN_SAVE = ("sigkill-in-save", "sigterm-in-save")
# the one writer's temporary file of a rank shard (smlp.files.temp_name)
TEMP = re.compile(r"^\.(?P<file>checkpoint\w*?-rank-(?P<rank>\d+)\.pt)\.smlp-tmp-[0-9a-f]{16}$")
START_UP_SHARE = 0.2  # of the kills at a random moment, those that land during start-up


OUTPUT = Path("results/chaos")  # --output-dir's default


def add_arguments(p) -> None:
    p.add_argument("--kills", type=int, default=20, help="how many kills (20)")
    p.add_argument("--updates", type=int, default=60, help="training updates (60)")
    p.add_argument("--save-every", type=int, default=4, help="updates between checkpoints (4)")
    p.add_argument("--chaos-seed", type=int, default=1, help="seed of the kills' kinds and moments (1)")
    p.add_argument("--data", type=Path, default=None, help="a fairseq data-bin (default: the demo corpus)")
    p.add_argument("--output-dir", type=Path, default=None, help=f"where its record goes ({OUTPUT})")
    p.add_argument("--amp", action="store_true",
                   help="train with --amp (fp16 autocast, a loss scale, --amp-batch-retries 1) and inject gradient "
                        "overflows: the batch after each save skipped (that save written again with its routing "
                        "record), one half-way fed again (overflow_plan)")


def check_plan(kills: int, updates: int, save_every: int) -> None:
    """A chaos run that can be made: at least one kill, and room for a kill between two saves."""
    check_at_least(kills, 1, "--kills")
    if updates < 2 * save_every or save_every < 1:
        raise BenchError(f"--updates {updates} --save-every {save_every}: give --save-every >= 1 and --updates at "
                         f"least twice it, so that a kill can land between two saves")


def check_args(args) -> None:
    """`smlp-bench chaos`'s arguments, before any work: the plan, --data, and an output folder without a chaos run."""
    check_plan(args.kills, args.updates, args.save_every)
    check_data(args.data)
    out = Path(args.output_dir or OUTPUT).expanduser()
    if (out / "chaos.json").exists() or (out / "chaos").exists():
        raise BenchError(f"--output-dir {out} already holds a chaos run; choose another folder")


def plan_kinds(kills: int, rng: random.Random) -> list[str]:
    """`kills` kinds in a random order: every kind once when there is room (the first three for 3 kills: one worker
    SIGKILLed, the job SIGTERMed, a rank SIGKILLed while it writes a checkpoint), the rest drawn at random."""
    kinds = list(KINDS[:kills]) + [rng.choice(KINDS) for _ in range(kills - len(KINDS))]
    rng.shuffle(kinds)
    return kinds


def plan_moment(kind: str, rng: random.Random, resumed: int, updates: int, save_every: int) -> dict:
    """Where a kill of `kind` should land in an attempt that resumed at update `resumed`: inside a write of one of
    the next two saves (a rank's numbered file, or its copy to checkpoint_last), or a random fraction of a step
    after one of the next 2K updates."""
    rank = rng.randrange(NPROC)
    saves = list(range((resumed // save_every + 1) * save_every, updates, save_every))[:2]
    if kind in IN_SAVE and saves:
        return {"save": rng.choice(saves), "rank": rank, "file": rng.choice(("numbered", "last"))}
    return {"after_update": rng.randint(resumed + 1, max(resumed + 1, min(resumed + 2 * save_every, updates - 1))),
            "step_fraction": round(rng.random(), 2), "rank": rank}


def train_args(data: Path, updates: int, save_every: int, amp: bool = False) -> list[str]:
    """fairseq-train's arguments: the tiny recipe, sMLP-det, a save every `save_every` updates, the last 2 kept;
    with `amp`, --amp and the overflow-injecting --user-dir (run it with `overflow_env`)."""
    recipe = (REPO / "configs" / "smlp_tiny.args").read_text().split()
    i = recipe.index("--max-update")
    user_dir = Path(__file__).resolve().parent / "chaos_overflow" if amp else _plugins_dir()
    return [str(data), "--user-dir", str(user_dir), *recipe[:i], *recipe[i + 2:], "--smoe-routing",
            "deterministic", "--max-update", str(updates), "--save-interval-updates", str(save_every),
            "--keep-interval-updates", "2", "--no-epoch-checkpoints", "--disable-validation", "--seed", "1",
            "--log-format", "simple", "--log-interval", "1", "--no-progress-bar",
            *(["--amp", "--amp-batch-retries", "1"] if amp else [])]


def overflow_plan(updates: int, save_every: int) -> dict[int, int]:
    """batch of the epoch (1-based) -> its overflowing passes (chaos_overflow): the batch right after every save, 2
    (with --amp-batch-retries 1 it is skipped and that save written again, holding the skipped batch's routing
    record); the batch half-way to the next save, 1 (fed again and applied)."""
    out, update, batch, skipped = {}, 0, 0, set()
    while update < updates:
        batch += 1
        if update and update % save_every == 0 and update not in skipped:
            out[batch] = 2
            skipped.add(update)
            continue
        if save_every >= 2 and update > save_every and update % save_every == save_every // 2:
            out[batch] = 1
        update += 1
    return out


def overflow_env(plan: dict[int, int]) -> dict[str, str]:
    return {"SMLP_CHAOS_OVERFLOW": ",".join(f"{b}:{n}" for b, n in sorted(plan.items()))}


class Job:
    """One `smlp-launch` of the training, its output in `log`; `worker(rank)` is that rank's process."""

    def __init__(self, args: list[str], save: Path, log: Path, env: dict | None = None):
        cmd = [str(BIN / "smlp-launch"), "--nproc", str(NPROC), "--cpu", "--threads", "1", "--grace", "5", "--",
               *args, "--save-dir", str(save)]
        self.log, self.started, self.stamps, self.lines, self._rest, self._pids = log, time.monotonic(), {}, [], "", {}
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True,
                                         env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
        self._reader = open(log, errors="replace")

    def text(self) -> str:
        self.poll()
        return "".join(self.lines)

    def poll(self) -> dict[int, float]:
        """Update -> when this tool first read its log line (monotonic seconds), for the lines logged so far."""
        *whole, self._rest = (self._rest + self._reader.read()).split("\n")
        for line in whole:
            self.lines.append(line + "\n")
            fields = train_fields(line)
            if fields and "num_updates" in fields:
                self.stamps.setdefault(int(fields["num_updates"]), time.monotonic())
        return self.stamps

    def worker(self, rank: int) -> int | None:
        if self._pids.get(rank) is None:
            for d in Path("/proc").iterdir():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
                except (OSError, ValueError, IndexError):
                    continue
                if ppid == self.proc.pid and "--distributed-rank" in argv and \
                        argv[argv.index("--distributed-rank") + 1] == str(rank):
                    self._pids[rank] = int(d.name)
                    break
        return self._pids.get(rank)

    def preempt(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)  # the launcher stops every worker with SIGTERM, as SLURM does

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise BenchError(f"the training did not end within {timeout:.0f} s; see {self.log}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _stopped(pid: int, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    with contextlib.suppress(OSError):  # the process is gone
        while time.monotonic() < deadline:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "tT":
                return True
            time.sleep(0.0005)
    return False


def _signal(pid: int | None, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if pid is not None:
            os.kill(pid, sig)


def _drive(job: Job, kind: str, moment: dict, save: Path, save_every: int, updates: int, step_s: float) -> dict | None:
    """Wait for `moment` and kill; None if the attempt ended first. Returns where the kill landed."""
    target = dict(moment)
    while job.proc.poll() is None:
        stamps = job.poll()
        last = max(stamps, default=None)
        if "save" in target:
            if last is not None and last > target["save"]:  # that save went by unseen: the next one, any file
                target = {**target, "save": target["save"] + save_every, "file": "any"}
                if target["save"] >= updates:
                    return None
            if last is None or last < target["save"] - 1:
                time.sleep(0.02)
                continue
            pid = job.worker(target["rank"])  # looked up before the write starts: a copy takes a few ms
            written = _writing(save, target, last)
            if written is None:
                time.sleep(0.001)
                continue
            _signal(pid, signal.SIGSTOP)
            if pid is None or not _stopped(pid) or not (save / written).exists():
                _signal(pid, signal.SIGCONT)  # that write ended before the stop: the next one
                continue
            if kind == "sigkill-in-save":
                _signal(pid, signal.SIGKILL)
            else:  # SIGTERM reaches the writer first, then the launcher stops the rest
                _signal(pid, signal.SIGTERM)
                job.preempt()
                _signal(pid, signal.SIGCONT)
            return {"writing": written.split(".pt.")[0] + ".pt", "victim": f"rank {target['rank']}",
                    "after_update": last}
        due = (job.started + target["start_up_s"] if "start_up_s" in target else
               stamps[target["after_update"]] + target["step_fraction"] * step_s
               if target["after_update"] in stamps else None)
        if due is None or time.monotonic() < due:
            time.sleep(0.01)
            continue
        pid = None if kind == "sigterm-job" else job.worker(target["rank"])
        if pid is None:  # the job, or a worker not started yet (an early start-up kill): the job instead
            job.preempt()
            return {"victim": "job" if kind == "sigterm-job" else "job (no worker yet)", "after_update": last}
        _signal(pid, signal.SIGKILL)
        return {"victim": f"rank {target['rank']}", "after_update": last}
    return None


def _writing(save: Path, target: dict, last: int) -> str | None:
    """The temporary file of the targeted write, if one is being written now."""
    for entry in os.scandir(save):
        m = TEMP.match(entry.name)
        if not m or int(m.group("rank")) != target["rank"]:
            continue
        name = m.group("file")
        if (target["file"] == "any" or (target["file"] == "last") == name.startswith("checkpoint_last")) and \
                (name.startswith("checkpoint_last") and last >= target["save"] or f"_{target['save']}-" in name):
            return entry.name
    return None


def _inspect(save: Path) -> tuple[list[str], list[str]]:
    """(checkpoint files that cannot be read, temporary files left) in the save directory."""
    from fairseq_plugins.shard_tags import read_shard

    names = sorted(os.listdir(save)) if save.is_dir() else []
    torn = [n for n in names if n.startswith("checkpoint") and n.endswith(".pt")
            and not read_shard(str(save / n)).readable]
    return torn, [n for n in names if TEMP.match(n)]


def _losses(text: str) -> dict[int, str]:
    return {int(f["num_updates"]): f["loss"] for f in map(train_fields, text.splitlines())
            if f and {"num_updates", "loss"} <= f.keys()}


def _loaded(text: str) -> bool:
    return "Loaded checkpoint" in text or "No existing checkpoint" in text


def _resumed(text: str) -> int:
    return (loaded_updates(text) or [0])[-1]


def _times(job: Job, step_s: float | None, start_up: float | None) -> tuple[float | None, float | None]:
    """(the median step's seconds, the start-up's) of an attempt, else the ones known before."""
    ups = sorted(job.stamps)
    gaps = sorted(job.stamps[b] - job.stamps[a] for a, b in zip(ups, ups[1:]) if b == a + 1)
    return (gaps[len(gaps) // 2] if gaps else step_s), (min(job.stamps.values()) - job.started if job.stamps
                                                        else start_up)


def run(out: Path, args: list[str], *, updates: int, save_every: int, kills: int | list[str] = 20, seed: int = 1,
        baseline: tuple[Path, str] | None = None, timeout: float = 1800, env: dict | None = None) -> dict:
    """Chaos run of the training `args` (fairseq-train's, without --save-dir; it must stop at `updates` and save
    every `save_every` updates; `env`: its extra environment) in out/chaos, compared with `baseline` (its save
    directory and rank 0's log, the same training uninterrupted), or with a baseline run here first in
    out/baseline. Returns the record."""
    from fairseq_plugins.checkpoints import save_differences

    check_plan(len(kills) if isinstance(kills, list) else kills, updates, save_every)
    rng = random.Random(seed)
    kinds = kills if isinstance(kills, list) else plan_kinds(kills, rng)
    (out / "chaos").mkdir(parents=True, exist_ok=False)
    step_s, start_up, baseline_wall = 0.5, None, None
    if baseline is None:
        (out / "baseline").mkdir()
        t0 = time.monotonic()
        base = Job(args, out / "baseline" / "ckpt", out / "baseline" / "train.log", env)
        if base.wait(timeout) != 0:
            raise BenchError(f"the uninterrupted run failed; see {base.log}")
        baseline_wall, baseline = time.monotonic() - t0, (out / "baseline" / "ckpt", base.text())
        step_s, start_up = _times(base, step_s, None)
    expected = _losses(baseline[1])

    save, events, attempts, t0 = out / "chaos" / "ckpt", [], [], time.monotonic()
    try:
        for n in range(len(kinds) + 1):
            before = set(_inspect(save)[1])
            attempts.append(job := Job(args, save, out / "chaos" / f"attempt-{n + 1:02d}.log", env))
            if n == len(kinds):
                break
            kind = kinds[n]
            if kind not in IN_SAVE and start_up and rng.random() < START_UP_SHARE:
                moment = {"start_up_s": round(rng.uniform(0.2, 1.0) * start_up, 2), "rank": rng.randrange(NPROC)}
            else:
                while job.proc.poll() is None and not _loaded(job.text()):
                    time.sleep(0.02)
                moment = plan_moment(kind, rng, _resumed(job.text()), updates, save_every)
                if kind in IN_SAVE and "save" not in moment:  # no save left before the end: the same signal
                    moment["instead_of"], kind = kind, kind.replace("-in-save", "-job" if "term" in kind else "-worker")
            landed = _drive(job, kind, moment, save, save_every, updates, step_s)
            killed_at = time.monotonic()
            if landed is None:
                break  # the attempt came to its end before the kill's moment
            code = job.wait(120)
            torn, temps = _inspect(save)
            temps = [t for t in temps if t not in before]
            landed["phase"] = ("checkpoint write" if landed.get("writing") or temps else
                               "start-up" if landed["after_update"] is None else "training")
            events.append({"kind": kind, "planned": moment, "landed": landed, "launcher_exit": code,
                           "torn_files": torn, "temp_files_left": temps, "killed_at": killed_at})
            step_s, start_up = _times(job, step_s, start_up)
        final = attempts[-1].wait(timeout)
    finally:
        for job in attempts:
            job.stop()
    chaos_wall = time.monotonic() - t0

    problems, mismatches, logged = [], [], set()
    for i, job in enumerate(attempts):
        text = job.text()
        resumed, losses = _resumed(text), _losses(text)
        logged |= set(losses)
        mismatches += [f"attempt {i + 1}, update {u}: loss {loss} (uninterrupted: {expected.get(u)})"
                       for u, loss in sorted(losses.items()) if expected.get(u) != loss]
        if losses and sorted(losses) != list(range(resumed + 1, resumed + 1 + len(losses))):
            problems.append(f"attempt {i + 1} resumed at update {resumed} and logged {sorted(losses)}")
    for i, e in enumerate(events):  # the next attempt that loaded a save, and the first back past the kill
        killed_at, later = e.pop("killed_at"), [j for j in attempts[i + 1:] if _loaded(j.text())]
        e["resumed_from"] = _resumed(later[0].text()) if later else None
        reached = e["resumed_from"] if e["landed"]["after_update"] is None else e["landed"]["after_update"]
        e["updates_redone"] = max(0, reached - e["resumed_from"]) if later else None
        back = [j.stamps[reached + 1] for j in later if reached is not None and reached + 1 in j.stamps]
        e["seconds_lost"] = round(back[0] - killed_at, 1) if back else None
        e["fell_back_to_an_older_save"] = bool(later) and "Resuming from the newest complete save" in later[0].text()
    if final != 0:
        errors = [line for line in attempts[-1].lines if ": error: " in line or "Error" in line]
        problems.append(f"attempt {len(attempts)} failed by itself (exit {final})"
                        + (f": {errors[-1].strip()[:400]}".replace(f"{out}/", "") if errors else ""))
    if logged != set(range(1, updates + 1)):
        problems.append(f"updates never logged: {sorted(set(range(1, updates + 1)) - logged)}")
    for job in attempts:
        job._reader.close()
    torn, temps = _inspect(save)
    differing = {}
    for rank, name in ((r, f"checkpoint_last-rank-{r}.pt") for r in range(NPROC)):
        differing.update({f"rank {rank}: {k}": v for k, v in save_differences(baseline[0] / name, save / name).items()}
                         if (save / name).is_file() else {f"rank {rank}": f"no {name}"})
    torn_any = sorted({t for e in events for t in e["torn_files"]} | set(torn))
    return {
        "baseline": {"wall_s": baseline_wall and round(baseline_wall, 1), "step_s": round(step_s, 3),
                     "overflows": baseline[1].count("AMP: overflow detected"),
                     "skipped": baseline[1].count("AMP: skipping this batch")},
        "chaos": {"wall_s": round(chaos_wall, 1), "attempts": [str(j.log.relative_to(out)) for j in attempts]},
        "time_lost_s": baseline_wall and round(chaos_wall - baseline_wall, 1),
        "kills": events,
        "result": {"equal": not (differing or mismatches or problems or torn_any or temps),
                   "differing": differing, "loss_mismatches": mismatches, "update_problems": problems,
                   "torn_files": torn_any, "temp_files_at_end": temps, "updates_logged": len(logged)},
    }


def summary(record: dict) -> str:
    """The record as a short markdown page (docs/benchmark/chaos/chaos.md)."""
    r, c = record["result"], record["config"]
    kinds = {k: sum(e["kind"] == k for e in record["kills"]) for k in KINDS}
    lines = [f"# Chaos run: {len(record['kills'])} kills, {c['updates']} updates, a save every {c['save_every']}", "",
             f"{c['model']}, {c['ranks']} ranks, {c['recipe']}, data {c['data']}"
             + (f", {c['precision']} with overflows injected into batches "
                f"{', '.join(f'{b} ({n} passes)' for b, n in c['overflowing_batches'].items())} of the epoch: "
                f"{record['baseline'].get('overflows')} overflows, {record['baseline'].get('skipped')} batches skipped "
                f"in the uninterrupted run" if c.get("overflowing_batches") else "")
             + ". Kills: " + ", ".join(f"{v} {k}" for k, v in kinds.items() if v) + ".", "",
             "| # | kind | landed | after update | resumed from | updates redone | seconds lost |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for i, e in enumerate(record["kills"], 1):
        writing = e["landed"].get("writing") or (e["temp_files_left"] or [""])[0].split(".pt.")[0] + ".pt"
        where = e["landed"]["phase"] + (f" ({writing})" if e["landed"]["phase"] == "checkpoint write" else "")
        cells = [e["landed"]["after_update"], e["resumed_from"], e["updates_redone"], e["seconds_lost"]]
        lines.append(f"| {i} | {e['kind']} ({e['landed']['victim']}) | {where} | "
                     + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    verdict = "bitwise equal to the uninterrupted run's" if r["equal"] else "NOT equal to the uninterrupted run's"
    lines += ["", "After update: the last update logged before the kill. Seconds lost: from the kill until training "
              "logged the update after it again (restarts, redone updates and any later kill before that).", "",
              f"Time lost: {record['time_lost_s']} s ({record['chaos']['wall_s']} s against "
              f"{record['baseline']['wall_s']} s uninterrupted). Final weights, optimizer state and logged losses: "
              f"{verdict}.", ""]
    for key in ("differing", "loss_mismatches", "update_problems", "torn_files", "temp_files_at_end"):
        if r[key]:
            items = r[key].items() if isinstance(r[key], dict) else ((x, "") for x in r[key])
            lines += [f"{key}:", *(f"- `{k}` {v}" for k, v in items), ""]
    return "\n".join(lines)


def main(args, data: Path) -> int:
    from .machine import code_identity, machine_info
    from .store import write_text

    out, updates = args.output_dir, args.updates  # checked by check_args
    print(f"== smlp-bench --chaos: {args.kills} kills, {updates} updates, a save every {args.save_every}, "
          f"output {out}", flush=True)
    plan = overflow_plan(updates, args.save_every) if args.amp else {}
    record = {"benchmark": "chaos", "config": {
        "model": "smlp_lm_tiny, --smoe-routing deterministic", "recipe": "configs/smlp_tiny.args", "ranks": NPROC,
        "updates": updates, "save_every": args.save_every, "kills": args.kills, "seed": args.chaos_seed,
        "data": data.name, "precision": "--amp --amp-batch-retries 1" if args.amp else "fp32",
        "overflowing_batches": {str(b): n for b, n in sorted(plan.items())}}, "machine": machine_info(),
        "code": code_identity()}
    record.update(run(out, train_args(data, updates, args.save_every, args.amp), updates=updates,
                      save_every=args.save_every, kills=args.kills, seed=args.chaos_seed,
                      env=overflow_env(plan) if args.amp else None))
    write_text(out / "chaos.json", json.dumps(record, indent=1) + "\n")
    write_text(out / "chaos.md", summary(record))
    print(summary(record))
    return 0 if record["result"]["equal"] else 1
