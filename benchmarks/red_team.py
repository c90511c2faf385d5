"""Red team: `genomelm` put through the faults a user, a cluster and a full disk bring, one row per fault: its
exit status, the last line it printed, what it left on disk and in the process table, and whether all of that
is as it should be.

    .venv/bin/python benchmarks/red_team.py [--only NAME ...] [--keep]

Each fault runs the real command line (`python -m genomelm.cli ...`) in a session of its own, on the `tiny`
preset and 512-token windows of the bundled fly genome. The disk-full faults mount small tmpfs folders, which
needs root; without it those rows say so and are skipped. `tests/test_red_team.py` runs every row and fails
on one that is not clean. Exit statuses: 0 done, 1 the machine, 2 the input, 128 + N stopped by signal N
(`genomelm.run.failures`).
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
FLY = ROOT / "data" / "dmel_chr4.fa.gz"
RECORD = "NC_004353.4"
WAIT_S = 240.0  # the longest any one command may take


@dataclass
class Row:
    """One fault's outcome; `problems` says what was not as it should be (empty: clean)."""

    fault: str
    code: int | None = None
    last_line: str = ""
    disk: str = ""
    processes: str = "none"
    problems: list[str] = field(default_factory=list)
    skipped: str = ""

    @property
    def clean(self) -> bool:
        return not self.problems

    def expect(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)


class Command:
    """`python -m genomelm.cli ARGS` started in its own session (its pid is its process group's id)."""

    def __init__(
        self,
        args: list[str],
        workdir: Path,
        environment: dict[str, str] | None = None,
        program: list[str] | None = None,
    ) -> None:
        self.out_path, self.err_path = workdir / "stdout.txt", workdir / "stderr.txt"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.process = subprocess.Popen(
                [*(program or [sys.executable]), "-m", "genomelm.cli", *map(str, args)],
                cwd=ROOT,
                stdout=out,
                stderr=err,
                start_new_session=True,
                env=os.environ | (environment or {}),
            )

    def wait_until(self, ready: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"the command ended first: {self.err_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("the command did not get there in time")
            time.sleep(0.1)

    def signal_group(self, signum: int) -> None:
        os.killpg(self.process.pid, signum)

    def finish(self, timeout_s: float = WAIT_S) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise

    def group(self) -> list[psutil.Process]:
        """The live (not zombie) processes of its process group."""
        found = []
        for process in psutil.process_iter(["status"]):
            try:
                if os.getpgid(process.pid) == self.process.pid and process.info["status"] != "zombie":
                    found.append(process)
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        return found

    def ranks(self) -> list[psutil.Process]:
        """The local launcher's ranks: the forkserver's children, by pid (rank 0 starts first)."""
        servers = [p for p in self.group() if "forkserver import main" in " ".join(p.cmdline())]
        return sorted((c for s in servers for c in s.children()), key=lambda p: p.pid)

    def leftovers(self, grace_s: float = 20.0) -> str:
        """What of its group is still running `grace_s` after it ended ("none" when nothing)."""
        deadline = time.monotonic() + grace_s
        while (left := self.group()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return ", ".join(f"{p.pid} {p.name()}" for p in left) or "none"

    def last_line(self) -> str:
        """The last line it printed for the user: on stdout when it ended well or stopped, else on stderr
        (progress bars left out)."""
        code = self.process.returncode
        path = self.out_path if code == 0 or (code is not None and code >= 128) else self.err_path
        lines = [line.split("\r")[-1].strip() for line in path.read_text(errors="replace").splitlines()]
        lines = [line for line in lines if line and not line.startswith(("train ", "score "))]
        return lines[-1] if lines else ""

    def tracebacks(self) -> bool:
        return "Traceback" in self.err_path.read_text(errors="replace")


class Lab:
    """A work folder with the fly data prepared once; each fault gets a folder and runs of its own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "fly"
        if not (self.data / "manifest.json").exists():
            prepare(self.data)

    def folder(self, name: str) -> Path:
        path = self.root / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def train(self, folder: Path, data: Path | None = None, **settings: Any) -> list[str]:
        values = {
            "data": data or self.data,
            "seq": 512,
            "model": "tiny",
            "run": "r",
            "runs_dir": folder / "runs",
            "wandb": "disabled",
            "warmup_steps": 1,
            "min_lr_ratio": 1.0,
            "steps": 2,
            "save_every": 2,
        } | settings
        return ["train", *(f"{key}={value}" for key, value in values.items())]


def prepare(out: Path, heldout: str = f"{RECORD}:200001-201024") -> None:
    subprocess.run(
        [sys.executable, "-m", "genomelm.cli", "data", "--fasta", FLY, "--genome", "fly", "--seq", "512"]
        + ["--train", f"{RECORD}:1-4096", "--heldout", heldout, "--out", out]
        + ["--no-progress"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )


def run_to_end(lab: Lab, folder: Path, args: list[str]) -> tuple[int, Command]:
    command = Command(args, folder)
    return command.finish(), command


def rows_of(metrics: Path) -> list[int]:
    import json

    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def listing(folder: Path) -> str:
    """The run folder's entries and its checkpoints, as the table shows them."""
    if not folder.exists():
        return "(no run folder)"
    names = sorted(p.name for p in folder.iterdir() if p.name != "failure.txt")
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir():
        names += [f"checkpoints/{p.name}" for p in sorted(checkpoints.iterdir())]
    return " ".join(names)


def flip(path: Path, count: int = 16) -> None:
    """Change `count` bytes in the middle of `path` (its size kept)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def common_checks(row: Row, command: Command, code: int, line_has: str, expected_code: int) -> None:
    row.code, row.last_line = code, command.last_line()
    row.processes = command.leftovers()
    row.expect(code == expected_code, f"exit status {code}, not {expected_code}")
    row.expect(line_has in row.last_line, f"the last line does not say {line_has!r}")
    row.expect(not command.tracebacks(), "a traceback was printed")
    row.expect(row.processes == "none", f"processes left: {row.processes}")


# ------------------------------------------------------------------------------------------------- faults
def damaged_only_checkpoint(lab: Lab, cp: int) -> Row:
    row = Row(f"the only checkpoint damaged (keep_checkpoints=1, cp={cp})")
    folder = lab.folder(f"only-damaged-cp{cp}")
    run = folder / "runs" / "r"
    assert run_to_end(lab, folder, lab.train(folder, cp=cp, keep_checkpoints=1))[0] == 0
    step = run / "checkpoints" / "step-0000002"
    victim = next(step.rglob("*.distcp" if cp > 1 else "*.safetensors"))
    flip(victim)
    code, command = run_to_end(lab, folder, lab.train(folder, cp=cp, keep_checkpoints=1, steps=4))
    common_checks(row, command, code, "every checkpoint of", 2)
    row.disk = listing(run)
    row.expect(victim.name in row.last_line, "the damaged file is not named")
    row.expect("resume=never run=" in row.last_line, "the way out is not named")
    row.expect(rows_of(run / "metrics.jsonl") == [1, 2], "metrics.jsonl lost rows")
    row.expect([p.name for p in (run / "checkpoints").iterdir()] == ["step-0000002"], "checkpoints changed")
    return row


def damaged_newest_checkpoint(lab: Lab) -> Row:
    row = Row("the newest checkpoint damaged, an older one intact")
    folder = lab.folder("newest-damaged")
    run = folder / "runs" / "r"
    assert run_to_end(lab, folder, lab.train(folder, save_every=1))[0] == 0
    flip(next((run / "checkpoints" / "step-0000002").rglob("*.safetensors")))
    code, command = run_to_end(lab, folder, lab.train(folder, save_every=1, steps=3))
    common_checks(row, command, code, "trained r: steps 1..3", 0)
    row.disk = listing(run)
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    row.expect("step-0000002.damaged" in names, "the damaged checkpoint was not set aside")
    row.expect("step-0000003" in names, "no checkpoint of the last step")
    row.expect(rows_of(run / "metrics.jsonl") == [1, 2, 3], "metrics.jsonl is not steps 1..3")
    return row


def signal_mid_run(lab: Lab, cp: int, signum: int, to_group: bool) -> Row:
    name = signal.Signals(signum).name
    target = "the process group" if to_group else ("the launcher" if cp > 1 else "the process")
    row = Row(f"{name} to {target} mid-run (cp={cp})")
    folder = lab.folder(f"{name.lower()}-{'group' if to_group else 'one'}-cp{cp}")
    run = folder / "runs" / "r"
    args = lab.train(folder, cp=cp, steps=1000, save_every=1000)
    command = Command(args, folder)
    command.wait_until(lambda: len(rows_of(run / "metrics.jsonl")) >= 2)
    if to_group:
        command.signal_group(signum)
    else:
        os.kill(command.process.pid, signum)
    code = command.finish()
    common_checks(row, command, code, f"stopped by {name} after step", 128 + signum)
    row.disk = listing(run)
    stopped = int(row.last_line.split("after step ")[1].split()[0]) if "after step " in row.last_line else -1
    row.expect((run / "checkpoints" / f"step-{stopped:07d}").is_dir(), "no checkpoint of the step it named")
    row.expect(rows_of(run / "metrics.jsonl") == list(range(1, stopped + 1)), "metrics rows past the stop")
    code, again = run_to_end(lab, folder, lab.train(folder, cp=cp, steps=stopped + 1))
    row.expect(
        code == 0 and f"steps {stopped}..{stopped + 1}" in again.last_line(), "the run did not continue"
    )
    return row


def signal_during_start_up(lab: Lab, launcher: str) -> Row:
    row = Row(f"SIGTERM during start-up ({launcher} launcher, cp=2)")
    folder = lab.folder(f"start-up-{launcher}")
    run = folder / "runs" / "r"
    command = Command(lab.train(folder, cp=2, steps=1000, launcher=launcher), folder)

    def starting() -> bool:  # the ranks are being started: the forkserver, or Ray's raylet, runs
        names = " ".join(" ".join(p.cmdline()) for p in _descendants(command.process.pid))
        return ("forkserver import main" in names) if launcher == "local" else ("raylet" in names)

    command.wait_until(starting)
    if launcher == "ray":
        time.sleep(0.5)  # Ray is starting its node
        os.kill(command.process.pid, signal.SIGTERM)  # Ray's own processes are in sessions of their own
    else:
        command.signal_group(signal.SIGTERM)
    code = command.finish()
    common_checks(row, command, code, "stopped by SIGTERM before its first step", 143)
    row.disk = listing(run)
    row.expect(not rows_of(run / "metrics.jsonl"), "it trained a step")
    row.expect(not (run / ".stop").exists(), "the stop request was left behind")
    return row


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def damaged_data(lab: Lab) -> Row:
    row = Row("a damaged data file (cp=2)")
    folder = lab.folder("damaged-data")
    data = folder / "fly-copy"
    shutil.copytree(lab.data, data)
    flip(data / "train.bin", 4)
    code, command = run_to_end(lab, folder, lab.train(folder, data=data, cp=2))
    common_checks(row, command, code, "train.bin", 2)
    row.disk = listing(folder / "runs" / "r")
    row.expect(f"--out {data}" in row.last_line, "the rebuild command does not name the folder opened")
    row.expect("(on rank" in row.last_line, "the rank is not named")
    return row


def rank_killed(lab: Lab) -> Row:
    row = Row("a rank killed by SIGKILL (cp=2)")
    folder = lab.folder("rank-killed")
    command = Command(lab.train(folder, cp=2, steps=1000, save_every=1000), folder)
    command.wait_until(lambda: len(rows_of(folder / "runs" / "r" / "metrics.jsonl")) >= 2)
    command.ranks()[1].kill()
    code = command.finish()
    common_checks(row, command, code, "exited with signal SIGKILL", 1)
    row.disk = listing(folder / "runs" / "r")
    row.expect("rank 1 of 2" in row.last_line, "the rank is not named")
    return row


def rank_stuck(lab: Lab) -> Row:
    row = Row("a rank stopped by SIGSTOP (cp=2, collective_timeout_s=10)")
    folder = lab.folder("rank-stuck")
    args = lab.train(folder, cp=2, steps=1000, save_every=1000, collective_timeout_s=10)
    command = Command(args, folder)
    command.wait_until(lambda: len(rows_of(folder / "runs" / "r" / "metrics.jsonl")) >= 2)
    command.ranks()[1].suspend()
    code = command.finish()
    common_checks(row, command, code, "rank 1 of 2 stuck", 1)
    row.disk = listing(folder / "runs" / "r")
    row.expect("stopped (SIGSTOP" in row.last_line, "the stuck rank's state is not said")
    return row


def launcher_killed(lab: Lab) -> Row:
    row = Row("kill -9 of the launcher mid-run (cp=2), then the same command again")
    folder = lab.folder("launcher-killed")
    run = folder / "runs" / "r"
    (folder / "killed").mkdir()
    command = Command(lab.train(folder, cp=2, steps=1000, save_every=2), folder / "killed")
    command.wait_until(lambda: len(rows_of(run / "metrics.jsonl")) >= 3)
    os.kill(command.process.pid, signal.SIGKILL)
    killed = time.monotonic()
    row.code = command.process.wait()
    row.processes = command.leftovers(grace_s=15.0)
    gone_s = time.monotonic() - killed
    row.expect(row.processes == "none", f"processes left: {row.processes}")
    row.expect(gone_s < 10.0, f"its processes ran on for {gone_s:.0f} s")
    saved = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    row.expect(bool(saved), "no checkpoint to continue from")
    end = max(rows_of(run / "metrics.jsonl")) + 2
    code, again = run_to_end(lab, folder, lab.train(folder, cp=2, steps=end, save_every=2))
    row.last_line = again.last_line()
    row.expect(code == 0, f"the same command again: exit status {code}")
    row.expect(f"steps {saved[-1] if saved else '?'}..{end}" in row.last_line, "it did not continue")
    row.expect(rows_of(run / "metrics.jsonl") == list(range(1, end + 1)), "metrics rows doubled or missing")
    row.expect(not again.tracebacks() and not command.tracebacks(), "a traceback was printed")
    row.disk = f"{listing(run)}; the killed run's processes gone {gone_s:.1f} s after the kill"
    return row


def windows_scored(out: str) -> int:
    """The most windows the progress bar of a scoring command's stdout has counted (tqdm's "| n/total [")."""
    return max((int(n) for n in re.findall(r"\| (\d+)/\d+ \[", out)), default=0)


def eval_launcher_killed(lab: Lab) -> Row:
    row = Row("kill -9 of a genomelm eval launcher while its ranks score (cp=2)")
    folder = lab.folder("eval-launcher-killed")
    data = folder / "fly-long-heldout"  # 64 held-out windows: scoring takes long enough to be killed
    prepare(data, heldout=f"{RECORD}:200001-232768")
    assert run_to_end(lab, folder, lab.train(folder, data=data, cp=2))[0] == 0
    args = [*lab.train(folder, data=data, cp=2), f"results_dir={folder / 'results'}", "bucket=256"]
    args[0] = "eval"
    command = Command(args, folder)
    command.wait_until(lambda: windows_scored(command.out_path.read_text(errors="replace")) >= 2)
    os.kill(command.process.pid, signal.SIGKILL)
    killed = time.monotonic()
    row.code = command.process.wait()
    row.processes = command.leftovers(grace_s=15.0)
    gone_s = time.monotonic() - killed
    row.last_line = command.err_path.read_text(errors="replace").strip().splitlines()[-1]
    row.expect(row.processes == "none", f"processes left: {row.processes}")
    row.expect(gone_s < 10.0, f"its ranks ran on for {gone_s:.0f} s")
    row.expect("its launcher (pid" in row.last_line, "no rank said its launcher was gone")
    row.expect(not (folder / "results" / "r").exists(), "results were written")
    holds = list((folder / "runs" / "r" / "checkpoints" / ".holds").glob("*"))
    row.disk = f"results: {'none' if not (folder / 'results').exists() else 'written'}; holds: {len(holds)}"
    row.disk += f" (of a dead process); gone {gone_s:.1f} s after the kill"
    return row


def blocked_checkpoint_path(lab: Lab, name: str) -> Row:
    row = Row(f"a file named checkpoints/{name} in a run resumed to step 4 (cp=2)")
    folder = lab.folder(f"blocked-{name.strip('.')}")
    run = folder / "runs" / "r"
    assert run_to_end(lab, folder, lab.train(folder, cp=2))[0] == 0
    blocker = run / "checkpoints" / name
    blocker.write_text("not a checkpoint")
    code, command = run_to_end(lab, folder, lab.train(folder, cp=2, steps=4))
    common_checks(row, command, code, f"{blocker} is a file where the run writes", 2)
    row.disk = listing(run)
    row.expect(rows_of(run / "metrics.jsonl") == [1, 2], "it trained steps it could not save")
    row.expect(blocker.read_text() == "not a checkpoint", "the file was changed")
    return row


def resumed_as_one_process(lab: Lab) -> Row:
    row = Row("a dp=2 ep=2 run resumed as one process")
    folder = lab.folder("resumed-as-one")
    run, full = folder / "runs" / "r", folder / "runs" / "full"
    assert run_to_end(lab, folder, lab.train(folder, dp=2, ep=2, run="full", steps=4))[0] == 0
    assert run_to_end(lab, folder, lab.train(folder, dp=2, ep=2))[0] == 0
    code, command = run_to_end(lab, folder, lab.train(folder, steps=4))
    common_checks(row, command, code, "trained r: steps 2..4", 0)
    row.disk = listing(run)
    said = command.err_path.read_text()
    row.expect("2 windows per optimizer step as before; grad_accum=1 -> 2" in said, "no line says the change")
    losses = [losses_of(path)[2:] for path in (run, full)]
    row.expect(
        all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(*losses, strict=True)) and len(losses[0]) == 2,
        f"steps 3-4 left the uninterrupted run's losses: {losses}",
    )
    return row


def eval_during_training(lab: Lab) -> Row:
    row = Row("genomelm eval on a run that trains and prunes every step (keep_checkpoints=1)")
    folder = lab.folder("eval-live")
    run = folder / "runs" / "r"
    (folder / "trainer").mkdir()
    settings = {"steps": 100000, "save_every": 1, "keep_checkpoints": 1}
    trainer = Command(lab.train(folder, **settings), folder / "trainer")
    trainer.wait_until(lambda: len(rows_of(run / "metrics.jsonl")) >= 2)
    args = [*lab.train(folder), f"results_dir={folder / 'results'}", "bucket=256"]
    args[0] = "eval"
    code, command = run_to_end(lab, folder, args)
    holds = sorted(p.name for p in (run / "checkpoints" / ".holds").glob("*"))
    trainer.signal_group(signal.SIGTERM)
    stopped = trainer.finish()
    common_checks(row, command, code, "figure: ", 0)
    row.disk = listing(run) + f"; holds left: {holds or 'none'}"
    row.expect(stopped == 143, f"the training run then ended {stopped}, not 143 (stopped)")
    row.expect(not holds, "eval left its hold")
    row.expect(len(rows_of(run / "metrics.jsonl")) > 2, "the run did not train on while eval ran")
    return row


def sigterm_to_eval(lab: Lab) -> Row:
    row = Row("SIGTERM to genomelm eval in one process, while it scores")
    folder = lab.folder("eval-sigterm")
    data = folder / "fly-long-heldout"  # 64 held-out windows: scoring takes long enough to be signalled
    prepare(data, heldout=f"{RECORD}:200001-232768")
    assert run_to_end(lab, folder, lab.train(folder, data=data))[0] == 0
    args = [*lab.train(folder, data=data), f"results_dir={folder / 'results'}", "bucket=256"]
    args[0] = "eval"
    command = Command(args, folder)
    command.wait_until(lambda: windows_scored(command.out_path.read_text(errors="replace")) >= 2)
    command.signal_group(signal.SIGTERM)
    code = command.finish()
    common_checks(row, command, code, "", 143)
    row.last_line = command.err_path.read_text().strip().splitlines()[-1]  # a failure's line, on stderr
    row.expect(row.last_line.startswith("genomelm eval: interrupted by SIGTERM"), "no line says it stopped")
    row.disk = listing(folder / "results" / "r")
    row.expect(not (folder / "results" / "r").exists(), "results were written")
    return row


def torchrun_rank_signalled(lab: Lab, signum: int, rank: int) -> Row:
    name = signal.Signals(signum).name
    row = Row(f"{name} to rank {rank} of a torchrun launch (cp=2, launcher=env)")
    folder = lab.folder(f"torchrun-{name.lower()}-rank{rank}")
    run, logs = folder / "runs" / "r", folder / "logs"
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
    torchrun += ["--log-dir", str(logs), "--redirects", "3", "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1"]
    args = [*lab.train(folder, cp=2, steps=1000, save_every=1000), "launcher=env"]
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = Command(args, folder, program=[*torchrun], environment=clean)
    command.wait_until(lambda: len(rows_of(run / "metrics.jsonl")) >= 2)
    ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(command.process.pid).children()}
    ranks[rank].send_signal(signum)
    row.code = command.finish()
    row.processes = command.leftovers()
    row.disk = listing(run)
    lines = {r: _rank_lines(logs, r) for r in (0, 1)}
    report = command.err_path.read_text(errors="replace")  # torchrun's report of its workers
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+) \(pid", report)]
    row.expect(row.code == 1, f"torchrun exited {row.code}, not 1 (its report of failed workers)")
    row.expect(row.processes == "none", f"processes left: {row.processes}")
    row.expect(
        not any("Traceback" in _rank_log(logs, r, "stderr") for r in (0, 1)), "a rank printed a traceback"
    )
    if signum == signal.SIGKILL:
        other = 1 - rank
        row.last_line = lines[other]
        row.expect(
            f"rank {other} of 2 lost another rank of its group" in row.last_line, "the loss is not said"
        )
    else:
        row.last_line = lines[0]
        row.expect(
            row.last_line.startswith(f"stopped by {name} after step"), "rank 0 does not say it stopped"
        )
        row.expect(sorted(codes) == [128 + signum] * 2, f"the ranks exited {codes}, not {128 + signum} each")
    row.last_line = f"[ranks exited {sorted(codes)}] {row.last_line}"
    return row


def _rank_log(logs: Path, rank: int, stream: str) -> str:
    found = sorted(logs.glob(f"*/attempt_*/{rank}/{stream}.log"))
    return found[-1].read_text(errors="replace") if found else ""


def _rank_lines(logs: Path, rank: int) -> str:
    """A torchrun rank's last line of ours: a failure's on stderr, else its stdout's."""
    err = [line for line in _rank_log(logs, rank, "stderr").splitlines() if line.startswith("genomelm ")]
    out = [line.strip() for line in _rank_log(logs, rank, "stdout").splitlines() if line.strip()]
    return (err or out or [""])[-1]


def losses_of(run: Path) -> list[float]:
    import json

    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def read_only_run_folder(lab: Lab) -> Row:
    row = Row("a read-only run folder (a tmpfs remounted read-only)")
    folder = lab.folder("read-only")
    runs = folder / "runs"
    try:
        with tmpfs(runs, "16m"):
            assert run_to_end(lab, folder, lab.train(folder))[0] == 0
            subprocess.run(["mount", "-o", "remount,ro", str(runs)], check=True)
            code, command = run_to_end(lab, folder, lab.train(folder, steps=4))
            common_checks(row, command, code, f"the run folder {runs / 'r'} cannot be written", 2)
            row.disk = listing(runs / "r")
            row.expect(rows_of(runs / "r" / "metrics.jsonl") == [1, 2], "metrics.jsonl changed")
    except PermissionError as exc:
        row.skipped = f"needs a tmpfs mount: {exc}"
    return row


@contextmanager
def tmpfs(folder: Path, size: str):
    """`folder` as a tmpfs of `size` (root only; PermissionError otherwise)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        raise PermissionError(mounted.stderr.decode().strip() or "mount failed")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def disk_full(lab: Lab, where: str) -> Row:
    row = Row(f"disk full: {where}")
    folder = lab.folder("disk-full-" + "-".join(where.replace("(", "").replace(")", "").split()[1:3]))
    runs = folder / "runs"
    size = {"the initial model (init/)": "128k", "a checkpoint (cp=2)": "1m", "a metrics append": "2m"}[where]
    try:
        with tmpfs(runs, size):
            cp = 2 if "cp=2" in where else 1
            steps = 1000 if "metrics" in where else 2
            command = Command(
                lab.train(folder, cp=cp, steps=steps, save_every=1000 if steps > 2 else 2), folder
            )
            if "metrics" in where:
                metrics = runs / "r" / "metrics.jsonl"
                command.wait_until(lambda: len(rows_of(metrics)) >= 1)
                with open(runs / "filler", "wb", buffering=0) as out:  # the disk fills while the run goes on
                    try:
                        while True:
                            out.write(b"\0" * (64 << 10))
                    except OSError:
                        pass
            code = command.finish()
            what = {
                "the initial model (init/)": "initial model",
                "a checkpoint (cp=2)": "the checkpoint needs",
            }
            common_checks(row, command, code, what.get(where, "a metrics row"), 1)
            row.disk = listing(runs / "r")
            row.expect("no space left on" in row.last_line, "the line does not say the disk is full")
            row.expect(not list((runs / "r").rglob(".tmp-*")), "a temporary folder was left")
            row.expect(" 0 B free" in row.last_line or "free)" in row.last_line, "the free space is not said")
    except PermissionError as exc:
        row.skipped = f"needs a tmpfs mount: {exc}"
    return row


BAD_SETTINGS = [
    "epochs=inf",
    "lr=inf",
    "lr=nan",
    "betas=[0.9]",
    "collective_timeout_s=inf",
    "steps=true",
    "cp=3",
]


def bad_setting(lab: Lab, setting: str) -> Row:
    row = Row(f"setting {setting}" if setting != "seq" else "seq=1024 on 512-token windows")
    folder = lab.folder(f"setting-{setting.split('=')[0]}")
    extra = ["seq=1024"] if setting == "seq" else [setting]
    code, command = run_to_end(lab, folder, [*lab.train(folder), *extra])
    common_checks(row, command, code, "genomelm train: ", 2)
    row.disk = listing(folder / "runs" / "r")
    row.expect(not (folder / "runs" / "r").exists(), "a run folder was written")
    return row


def vcf_forms(lab: Lab) -> Row:
    row = Row("genomelm variants on a plain, a gzip and a bgzip VCF")
    folder = lab.folder("vcf")
    assert run_to_end(lab, folder, lab.train(folder, steps=1, save_every=1))[0] == 0
    text = (
        "##fileformat=VCFv4.2\n##contig=<ID=4>\n#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n"
        "4\t300000\t.\tN\tA\t.\t.\t.\n"
    )
    import pysam

    plain = folder / "in.vcf"
    plain.write_text(text)
    zipped = folder / "in.gzip.vcf.gz"
    zipped.write_bytes(gzip.compress(text.encode()))
    bgzipped = folder / "in.bgzip.vcf.gz"
    pysam.tabix_compress(str(plain), str(bgzipped))
    mapping = folder / "contigs.txt"
    mapping.write_text(f"4 {RECORD}\n")
    lines = []
    for vcf in (plain, zipped, bgzipped):
        args = [*lab.train(folder, steps=1), f"results_dir={folder / ('results-' + vcf.name)}", f"vcf={vcf}"]
        args[0] = "variants"
        code, command = run_to_end(lab, folder, [*args, f"contig_map={mapping}", "skip_mismatch=true"])
        lines.append(command.last_line())
        row.expect(code == 0, f"{vcf.name}: exit status {code}: {command.last_line()}")
        row.expect(not command.tracebacks(), f"{vcf.name}: a traceback was printed")
    row.code, row.last_line = 0 if row.clean else 1, lines[-1]
    row.disk = " ".join(sorted(p.name for p in folder.glob("in.*")))
    return row


def faults() -> dict[str, Callable[[Lab], Row]]:
    """Every fault by name, in the order of the table."""
    table: dict[str, Callable[[Lab], Row]] = {
        "damaged-only-checkpoint-cp1": lambda lab: damaged_only_checkpoint(lab, 1),
        "damaged-only-checkpoint-cp2": lambda lab: damaged_only_checkpoint(lab, 2),
        "damaged-newest-checkpoint": damaged_newest_checkpoint,
        "sigterm-one-process": lambda lab: signal_mid_run(lab, 1, signal.SIGTERM, False),
        "sigint-launcher-cp2": lambda lab: signal_mid_run(lab, 2, signal.SIGINT, False),
        "sigterm-group-cp2": lambda lab: signal_mid_run(lab, 2, signal.SIGTERM, True),
        "start-up-local": lambda lab: signal_during_start_up(lab, "local"),
        "start-up-ray": lambda lab: signal_during_start_up(lab, "ray"),
        "damaged-data-cp2": damaged_data,
        "rank-killed-cp2": rank_killed,
        "rank-stuck-cp2": rank_stuck,
        "launcher-killed-cp2": launcher_killed,
        "eval-launcher-killed-cp2": eval_launcher_killed,
        "blocked-checkpoint-cp2": lambda lab: blocked_checkpoint_path(lab, "step-0000004"),
        "blocked-tmp-name-cp2": lambda lab: blocked_checkpoint_path(lab, ".tmp-step-0000004"),
        "read-only-run-folder": read_only_run_folder,
        "resumed-as-one-process": resumed_as_one_process,
        "eval-during-training": eval_during_training,
        "eval-sigterm-one-process": sigterm_to_eval,
        "torchrun-sigkill-rank1": lambda lab: torchrun_rank_signalled(lab, signal.SIGKILL, 1),
        "torchrun-sigkill-rank0": lambda lab: torchrun_rank_signalled(lab, signal.SIGKILL, 0),
        "torchrun-sigusr1-rank1": lambda lab: torchrun_rank_signalled(lab, signal.SIGUSR1, 1),
        "disk-full-init": lambda lab: disk_full(lab, "the initial model (init/)"),
        "disk-full-checkpoint-cp2": lambda lab: disk_full(lab, "a checkpoint (cp=2)"),
        "disk-full-metrics": lambda lab: disk_full(lab, "a metrics append"),
    }
    for setting in [*BAD_SETTINGS, "seq"]:
        table[f"setting-{setting}"] = lambda lab, setting=setting: bad_setting(lab, setting)
    table["vcf-forms"] = vcf_forms
    return table


def format_table(rows: list[Row]) -> str:
    lines = ["| fault | exit | last line | on disk | processes left | clean |", "|---|---|---|---|---|---|"]
    for row in rows:
        verdict = (
            "skipped: " + row.skipped
            if row.skipped
            else ("yes" if row.clean else "NO: " + "; ".join(row.problems))
        )
        last = row.last_line if len(row.last_line) <= 160 else row.last_line[:157] + "..."
        lines.append(f"| {row.fault} | {row.code} | {last} | {row.disk} | {row.processes} | {verdict} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="the faults to run, by name (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and say where it is")
    args = parser.parse_args()
    table = faults()
    names = args.only or list(table)
    work = Path(tempfile.mkdtemp(prefix="genomelm-red-team-"))
    lab = Lab(work)
    rows = []
    for name in names:
        started = time.perf_counter()
        rows.append(table[name](lab))
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print(format_table(rows))
    if args.keep:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(row.clean for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
