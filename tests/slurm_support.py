"""A real one-node Slurm cluster for the tests: the session fixture `slurm_cluster` (import it into a test
module with `from slurm_support import slurm_cluster`). It uses Debian's `slurm-wlm` and `munge` as
installed (`apt-get install -y slurm-wlm munge`, which .ci/run does as root), writes its own slurm.conf
(free loopback ports, no accounting, state, spool and logs under the run's temp folder), starts munged
when none answers, then slurmctld and slurmd, and waits until the node is idle and the scheduler has run
(its first pass comes about 3 s after slurmctld starts; a job submitted earlier waits for it). Where the packages are
missing, the user is not root (slurmd must be) or the node does not come up, a test that takes it skips
with one line saying why.

pytest-xdist (`make test` runs two workers, `--dist worksteal`): each worker has its own session, so the
fixture coordinates through the folder that all workers of a run share (`slurm/` beside the workers'
base temps) under an `fcntl.flock`: the first worker that needs the cluster starts it and writes its
state (daemon pids, ports, who uses it) to `slurm/state.json`; a later worker finds it up and joins. At
its session end a worker leaves, and the last user to leave (workers that died are pruned) stops
slurmd and slurmctld, and munged when the fixture started it; so no worker stops the cluster under
another one's test. A worker that finds a start failed skips with the same reason without retrying.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

PARTITION = "debug"
INSTALL_HINT = "apt-get install -y slurm-wlm munge"
SLURM_TOOLS = ("sbatch", "sinfo", "slurmctld", "slurmd")
MUNGE_TOOLS = ("munged", "munge")
SBIN_FOLDERS = ("/usr/sbin", "/sbin", "/usr/local/sbin")
MUNGE_RUN = Path("/run/munge")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_PIDFILE = MUNGE_RUN / "munged.pid"

UP_WITHIN = 30.0  # seconds for slurmctld and slurmd to show the node idle and schedule
MUNGE_WITHIN = 10.0  # seconds for a started munged to answer
LOCK_WITHIN = 120.0  # seconds to wait for another worker that is starting or stopping the cluster
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL


@dataclass
class SlurmCluster:
    """The running cluster. `env` holds only what a subprocess needs on top of its environment to
    reach it (SLURM_CONF, the fixture's slurm.conf); `environ()` is os.environ with it."""

    partition: str
    conf: Path
    folder: Path
    node: str
    bin: Path  # the folder of sbatch, sinfo, squeue, srun
    sbin: Path  # the folder of slurmctld and slurmd
    env: dict[str, str] = field(default_factory=dict)

    def environ(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def run(self, args: list[str], timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm command (`sbatch`, `squeue`, ...) against this cluster, output captured as text."""
        kwargs.setdefault("env", self.environ())
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of slurmctld's and slurmd's logs, for a failing test's message."""
        return "\n".join(f"{path.name}: {line}" for path in self._logs() for line in _tail(path, lines))

    def _logs(self) -> list[Path]:
        return [self.folder / name for name in ("slurmctld.log", "slurmd.log")]


# --------------------------------------------------------------------------------------------
# What this machine has


def find_tool(name: str) -> str | None:
    """A Slurm or munge program on PATH or in the sbin folders (not on a plain user's PATH)."""
    found = shutil.which(name)
    if found:
        return found
    for folder in SBIN_FOLDERS:
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def missing_reason() -> str | None:
    """One line saying why this machine cannot start the cluster, or None when it can."""
    missing = [name for name in SLURM_TOOLS + MUNGE_TOOLS if find_tool(name) is None]
    root = os.geteuid() == 0
    if missing:
        how = INSTALL_HINT if root else f"as root: {INSTALL_HINT}"
        return f"slurm: {', '.join(missing)} not installed (Debian: {how}; .ci/run does it)"
    if not root:
        return f"slurm: the test cluster runs slurmd, which needs root; this is uid {os.geteuid()}"
    if find_tool("runuser") is None:
        return "slurm: runuser (util-linux) not found, needed to start munged as the munge user"
    return None


def _tail(path: Path, lines: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _last_log_line(folder: Path) -> str:
    """The last line each daemon logged (its log file, else what it printed before opening that)."""
    found = []
    for name in ("slurmctld", "slurmd"):
        last = (_tail(folder / f"{name}.log", 1) or _tail(folder / f"{name}.out", 1) or ["(no log)"])[0]
        found.append(f"{name}: {last.strip()}")
    return "; ".join(found)


def _alive(pid: int | None, marker: str) -> bool:
    """Whether `pid` runs (not a zombie) a command whose command line contains `marker`."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z" and marker in cmdline


def process_key(pid: int) -> str:
    """`pid:start time` of a running process: a pid that the system reuses later gets another key."""
    try:
        return f"{pid}:{Path(f'/proc/{pid}/stat').read_text().rpartition(')')[2].split()[19]}"
    except (OSError, IndexError):
        return f"{pid}:gone"


def _free_ports(count: int) -> list[int]:
    """Ports free on this machine now (all bound at once, so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in socks]


# --------------------------------------------------------------------------------------------
# munge


def munge_answers() -> bool:
    """Whether a munged answers on the default socket (`munge -n` needs it to make a credential)."""
    munge = find_tool("munge")
    try:
        return munge is not None and subprocess.run([munge, "-n"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_munged() -> int | None:
    """Start munged as the munge user when none answers; its pid when this started it, else None."""
    if munge_answers():
        return None
    MUNGE_RUN.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_RUN, "munge", "munge")
    if not MUNGE_KEY.exists():  # the Debian package makes one; a hand-made image may lack it
        mungekey = find_tool("mungekey")
        create = [mungekey, "--create"] if mungekey else [find_tool("create-munge-key") or "create-munge-key"]
        subprocess.run(["runuser", "-u", "munge", "--", *create], capture_output=True, timeout=30, check=False)
    # munged forks into the background once it is ready and writes its pid file.
    result = subprocess.run(
        ["runuser", "-u", "munge", "--", find_tool("munged") or "munged"], capture_output=True, text=True, timeout=30
    )
    deadline = time.monotonic() + MUNGE_WITHIN
    while not munge_answers():
        if time.monotonic() > deadline:
            said = (result.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"slurm: munged did not answer within {MUNGE_WITHIN:.0f} s (munged: {said})")
        time.sleep(0.2)
    try:
        return int(MUNGE_PIDFILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# --------------------------------------------------------------------------------------------
# slurmctld and slurmd

# Popen objects of the daemons this worker started, so that it reaps them when it stops them.
_STARTED: dict[int, subprocess.Popen] = {}


def node_line() -> str:
    """The node as `slurmd -C` sees this machine (its first line: NodeName=... CPUs=... RealMemory=...)."""
    result = subprocess.run([find_tool("slurmd") or "slurmd", "-C"], capture_output=True, text=True, timeout=30)
    first = (result.stdout.strip().splitlines() or [""])[0]
    if result.returncode != 0 or not first.startswith("NodeName="):
        said = (result.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"slurm: `slurmd -C` did not describe this node ({said})")
    return first


def write_conf(folder: Path, node: str, ctld_port: int, slurmd_port: int) -> Path:
    """slurm.conf for one node on loopback: root runs both daemons, no accounting, no cgroups."""
    node_name = node.split()[0].partition("=")[2]
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(
        f"""# Written by tests/slurm_support.py for one pytest run.
ClusterName=gptforge-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
KillWait=5
SchedulerParameters=batch_sched_delay=0
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName={PARTITION} Nodes={node_name} Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


def _slurm_output(args: list[str], env: dict[str, str]) -> str:
    """What a Slurm client command printed, or '' when it failed (slurmctld not answering yet)."""
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=10, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""


def node_state(env: dict[str, str]) -> str:
    """The node's state as sinfo says it (`idle`, `down*`, ...), or '' when slurmctld does not answer."""
    return _slurm_output([find_tool("sinfo") or "sinfo", "-h", "-N", "-p", PARTITION, "-o", "%T"], env)


def scheduler_ran(env: dict[str, str]) -> bool:
    """Whether slurmctld's main scheduler has run once: it first does about 3 s after slurmctld starts,
    and a job submitted before waits for it. True when sdiag's report has no such count to read."""
    report = _slurm_output([find_tool("sdiag") or "sdiag"], env)
    cycles = re.search(r"Main schedule statistics.*?Total cycles:\s*(\d+)", report, re.S)
    return cycles is None or int(cycles.group(1)) > 0


def start_daemons(folder: Path, conf: Path, env: dict[str, str]) -> dict[str, int]:
    """slurmctld and slurmd in the foreground of their own processes (children of this worker);
    their pids once sinfo shows the node idle and the scheduler has run. Skips, stopping them, when that
    does not happen within UP_WITHIN."""
    pids: dict[str, int] = {}
    for name, extra in (("slurmctld", ["-c"]), ("slurmd", [])):
        with open(folder / f"{name}.out", "w") as out:  # what they say before their log file opens
            proc = subprocess.Popen(
                [find_tool(name) or name, "-D", *extra, "-f", str(conf)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        _STARTED[proc.pid] = proc
        pids[name] = proc.pid
    deadline = time.monotonic() + UP_WITHIN
    state = ""
    while True:
        state = node_state(env)
        if state == "idle" and scheduler_ran(env):
            return pids
        dead = [name for name, pid in pids.items() if not _alive(pid, str(conf))]
        if dead or time.monotonic() > deadline:
            stop_daemons(pids, str(conf))
            why = (
                f"{' and '.join(dead)} exited"
                if dead
                else f"not ready within {UP_WITHIN:.0f} s (node: {state or 'no answer'})"
            )
            pytest.skip(f"slurm: test cluster did not come up: {why}; {_last_log_line(folder)}")
        time.sleep(0.25)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def stop_daemons(pids: dict[str, int], marker: str) -> None:
    """SIGTERM, then SIGKILL after STOP_GRACE seconds, each daemon still running `marker`."""
    running = [pid for pid in pids.values() if _alive(pid, marker)]
    for pid in running:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    while any(_alive(pid, marker) for pid in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in running:
        if _alive(pid, marker):
            _signal(pid, signal.SIGKILL)
    for pid in pids.values():  # reap the ones this worker started (another worker's are not its children)
        proc = _STARTED.pop(pid, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE)


# --------------------------------------------------------------------------------------------
# Sharing one cluster between xdist workers


def shared_folder(tmp_path_factory) -> Path:
    """`slurm/` in the folder all xdist workers of this run share (a single process: its own base temp).
    Short on purpose: slurmd makes unix sockets in its spool folder, whose paths may not exceed 107 bytes."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold the cluster's lock: one worker at a time starts, joins, leaves or stops it."""
    with open(folder / "lock", "w") as lock:
        deadline = time.monotonic() + LOCK_WITHIN
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.skip(f"slurm: another pytest worker held {folder / 'lock'} for over {LOCK_WITHIN:.0f} s")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_state(folder: Path) -> dict:
    try:
        return json.loads((folder / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def write_state(folder: Path, state: dict) -> None:
    tmp = folder / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(folder / "state.json")


def cluster_of(folder: Path, state: dict) -> SlurmCluster:
    sbin = Path(find_tool("slurmctld") or "/usr/sbin/slurmctld").parent
    bin_folder = Path(find_tool("sbatch") or "/usr/bin/sbatch").parent
    conf = Path(state["conf"])
    return SlurmCluster(
        partition=PARTITION,
        conf=conf,
        folder=folder,
        node=state["node"],
        bin=bin_folder,
        sbin=sbin,
        env={"SLURM_CONF": str(conf)},
    )


def join(folder: Path) -> SlurmCluster:
    """Join the running cluster, or start it (munged too when none answers) when none is up."""
    me = process_key(os.getpid())
    with locked(folder):
        state = read_state(folder)
        if state.get("status") == "failed":
            pytest.skip(state["reason"])
        conf = state.get("conf", "")
        up = state.get("status") == "up" and all(_alive(pid, conf) for pid in state.get("pids", {}).values())
        if not up:
            if state.get("pids"):  # what is left of a cluster that died or half stopped
                stop_daemons(state["pids"], conf)
            reason = missing_reason()
            if reason:
                pytest.skip(reason)  # not recorded: each worker says it for itself
            state = {"status": "starting", "users": [], "munged_pid": state.get("munged_pid")}
            try:
                started_munged = start_munged()
                if started_munged:
                    state["munged_pid"] = started_munged
                node = node_line()
                ctld_port, slurmd_port = _free_ports(2)
                conf_path = write_conf(folder, node, ctld_port, slurmd_port)
                env = {**os.environ, "SLURM_CONF": str(conf_path)}
                started_at = time.monotonic()
                pids = start_daemons(folder, conf_path, env)
            except pytest.skip.Exception as skip:
                if _alive(state.get("munged_pid"), "munged"):  # no user will be left to stop it
                    stop_daemons({"munged": state["munged_pid"]}, "munged")
                write_state(folder, {**state, "status": "failed", "reason": str(skip.msg), "munged_pid": None})
                raise
            state.update(
                status="up",
                conf=str(conf_path),
                node=node.split()[0].partition("=")[2],
                ports=[ctld_port, slurmd_port],
                pids=pids,
                starter=me,
                up_seconds=round(time.monotonic() - started_at, 2),
            )
        state["users"] = sorted({*state.get("users", []), me})
        write_state(folder, state)
        return cluster_of(folder, state)


def leave(folder: Path) -> None:
    """This worker is done with the cluster; the last user stops it (and munged, if it started that)."""
    me = process_key(os.getpid())
    with locked(folder):
        state = read_state(folder)
        # Workers that died without leaving count no more.
        users = [key for key in state.get("users", []) if key != me and process_key(int(key.split(":")[0])) == key]
        state["users"] = users
        if not users and state.get("status") == "up":
            stop_daemons(state.get("pids", {}), state.get("conf", ""))
            if _alive(state.get("munged_pid"), "munged"):
                stop_daemons({"munged": state["munged_pid"]}, "munged")
            state.update(status="stopped", pids={}, munged_pid=None)
        write_state(folder, state)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    """A one-node Slurm cluster (partition `debug`) shared by the run's workers; see the module's docstring."""
    folder = shared_folder(tmp_path_factory)
    cluster = join(folder)
    try:
        yield cluster
    finally:
        leave(folder)
