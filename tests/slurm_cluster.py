"""A real single-node SLURM cluster for tests, from Debian's ``slurm-wlm`` and ``munge``.

The session fixture :func:`slurm_cluster` installs the packages when they are missing
(as root, with ``apt-get``), then starts, in the foreground and owned by this process:

- ``munged`` as the ``munge`` user, with ``/etc/munge/munge.key`` and a private socket;
- ``slurmctld`` and ``slurmd`` from a private ``slurm.conf`` on free ports;

every file of theirs (config, state, spool, pid files, logs, munge socket) in a new
``/tmp/ranklog-slurm-*`` directory. It resumes the node and runs a one-task smoke job.
At the end it cancels what is still queued, stops every daemon it started, by pid (also
when a test failed), and removes the directory. Clients find the cluster through
``SLURM_CONF``: run them with :meth:`SlurmCluster.env`.

If SLURM cannot be installed or started, the tests that use the fixture are skipped with
the reason, or fail with the daemons' log tails when ``$CI`` is set.

Run ``python -m tests.slurm_cluster`` to start a cluster by hand and print its ``SLURM_CONF``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .conftest import python_env

__all__ = ["SlurmCluster", "SlurmUnavailable", "slurm_cluster", "start_cluster"]

PACKAGES = ("slurm-wlm", "munge")
COMMANDS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue")
MUNGE_KEY = Path("/etc/munge/munge.key")
PARTITION = "debug"
#: CPUs the node declares (SlurmdParameters=config_overrides lets it exceed the real count).
NODE_CPUS = 8
#: Seconds between SIGTERM and SIGKILL when a job is cancelled or requeued.
KILL_WAIT = 5
#: Seconds a requeued job waits before it may start again (slurm.conf AuthInfo cred_expire).
CRED_EXPIRE = 10


class SlurmUnavailable(Exception):
    """SLURM could not be installed or started here; the message says why."""


@dataclass
class SlurmCluster:
    """A running single-node cluster; every daemon is a child of this process, and every
    file it writes is under ``root`` (removed by :meth:`stop`)."""

    root: Path
    conf: Path
    node: str
    partition: str = PARTITION
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    # -- clients -----------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for SLURM clients and jobs: this cluster's config, the venv first
        on PATH, ranklog importable, and nothing SLURM-ish inherited from outside."""
        env = {
            k: v
            for k, v in python_env().items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_"))
        }
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env.update(extra)
        return env

    def run(
        self, *args: str, check: bool = True, timeout: float = 30, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster (text output captured)."""
        proc = subprocess.run(
            list(args),
            env=env or self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}\n"
                + self.log_tails()
            )
        return proc

    def sbatch(self, script: str | os.PathLike[str], *args: str, env: dict[str, str]) -> int:
        """Submit ``script`` with sbatch options ``args``; returns the job id."""
        out = self.run("sbatch", "--parsable", *args, str(script), env=env).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ...); empty once purged."""
        proc = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if proc.returncode != 0:
            return {}
        fields: dict[str, str] = {}
        for tok in proc.stdout.split():
            key, sep, value = tok.partition("=")
            if sep:
                fields[key] = value
        return fields

    def wait_job(
        self, job_id: int, states: Sequence[str], timeout: float = 120, poll: float = 0.5
    ) -> dict[str, str]:
        """Wait until the job's state is one of ``states``; its fields then."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(poll)
        raise AssertionError(
            f"job {job_id} never reached {'/'.join(states)} in {timeout:.0f}s: {info}\n"
            + self.log_tails()
        )

    def log_tails(self, lines: int = 25) -> str:
        """The last lines of every daemon's log, for failure messages."""
        out = []
        for name, path in sorted(self.logs.items()):
            main = self.logs.get(name.removesuffix(" (stdout)"))
            if name.endswith(" (stdout)") and main is not None and _nonempty(main):
                continue  # the same lines as the daemon's own log
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError as exc:
                text = [f"(unreadable: {exc})"]
            out.append(f"--- {name} ({path})\n" + "\n".join(text))
        return "\n".join(out)

    # -- lifecycle ---------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], *, user: str | None = None) -> None:
        log = self.root / f"{name}.out"
        self.logs.setdefault(f"{name} (stdout)", log)
        with open(log, "ab") as fh:
            self.procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=user,
                group=user,
                extra_groups=[] if user else None,
                env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
            )

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{name} exited with {proc.returncode}")

    def stop(self) -> None:
        """Cancel the jobs still queued, then stop the daemons this cluster started, by pid
        (SIGTERM, SIGKILL after 15 s); an interrupt half-way still stops every one."""
        try:
            self._cancel_jobs()
        finally:
            self._stop_daemons()

    def _cancel_jobs(self) -> None:
        ctld = self.procs.get("slurmctld")
        if ctld is None or ctld.poll() is not None:
            return
        with contextlib.suppress(Exception):
            ids = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
            if not ids:
                return
            self.run("scancel", *ids, check=False, timeout=10)
            deadline = time.monotonic() + KILL_WAIT + 15
            while time.monotonic() < deadline:
                if not self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split():
                    return
                time.sleep(0.5)

    def _stop_daemons(self) -> None:
        order = [self.procs[n] for n in ("slurmd", "slurmctld", "munged") if n in self.procs]
        try:
            for proc in order:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=15)
        finally:
            for proc in order:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)
            shutil.rmtree(self.root, ignore_errors=True)


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


# -- installation ------------------------------------------------------------------------


def _missing_commands() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c, path=_sbin_path()) is None]


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


def _which(cmd: str) -> str:
    path = shutil.which(cmd, path=_sbin_path())
    if path is None:
        raise SlurmUnavailable(f"{cmd} not found")
    return path


def install_packages() -> None:
    """``apt-get install -y slurm-wlm munge`` (``apt-get update`` and again on failure).

    Services are kept from starting during the install (a temporary ``policy-rc.d`` if
    there is none): only the fixture starts daemons, and it starts its own.
    """
    missing = _missing_commands()
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            f"SLURM is not installed ({', '.join(missing)} missing) and installing it needs "
            "root and apt-get: apt-get install -y slurm-wlm munge"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    policy = Path("/usr/sbin/policy-rc.d")
    created_policy = False
    if not policy.exists():
        policy.write_text(
            "#!/bin/sh\n# ranklog tests: no service starts during apt-get\nexit 101\n"
        )
        policy.chmod(0o755)
        created_policy = True
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    try:
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            subprocess.run(
                ["apt-get", "update", "-q"], env=env, capture_output=True, text=True, timeout=600
            )
            proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as exc:
        raise SlurmUnavailable(f"apt-get timed out: {exc}") from None
    finally:
        if created_policy:
            policy.unlink(missing_ok=True)
    if proc.returncode != 0 or _missing_commands():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed:\n{tail}")


def _ensure_munge_key() -> pwd.struct_passwd:
    try:
        munge = pwd.getpwnam("munge")
    except KeyError:
        raise SlurmUnavailable("there is no munge user (the munge package creates it)") from None
    if not MUNGE_KEY.exists():
        MUNGE_KEY.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(MUNGE_KEY.parent, munge.pw_uid, munge.pw_gid)
        fd = os.open(MUNGE_KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(1024))
    st = MUNGE_KEY.stat()
    if st.st_uid != munge.pw_uid:
        os.chown(MUNGE_KEY, munge.pw_uid, munge.pw_gid)
    if st.st_mode & 0o077:
        MUNGE_KEY.chmod(0o400)
    return munge


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _write_conf(root: Path, node: str, munge_socket: Path) -> Path:
    ctld_port, slurmd_port = _free_ports(2)
    (root / "ctld").mkdir()
    (root / "slurmd").mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        f"""\
# Written by tests/slurm_cluster.py: one node, everything under {root}.
ClusterName=ranklogtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (120 s).
AuthInfo=socket={munge_socket},cred_expire={CRED_EXPIRE}
CredType=cred/munge
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/slurmd
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: track processes through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Schedule often: a requeued job becomes eligible without any event that would wake it.
SchedulerParameters=sched_interval=1,bf_interval=1
# The node may declare more CPUs than the machine has.
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={KILL_WAIT}
InactiveLimit=0
MinJobAge=600
JobRequeue=1
MailProg=/bin/true
NodeName={node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN
PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
    )
    return conf


def _wait(what: str, ready: Callable[[], bool], cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        cluster._check_alive()
        if ready():
            return
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"{what} not ready after {timeout:.0f}s")
        time.sleep(0.25)


def start_cluster() -> SlurmCluster:
    """Install if needed and start munged, slurmctld and slurmd in a new private directory.

    Raises :class:`SlurmUnavailable` with the daemons' log tails; on any failure the
    daemons already started are stopped and the directory removed before it propagates.
    """
    install_packages()
    munge = _ensure_munge_key()
    node = socket.gethostname().split(".")[0]
    # A short path under /tmp, not pytest's tmp dir: that one is root-only (munged runs as
    # munge and must reach its socket) and may be deep (slurmstepd puts unix sockets, at
    # most 108 bytes of path, in SlurmdSpoolDir).
    root = Path(tempfile.mkdtemp(prefix="ranklog-slurm-"))
    root.chmod(0o755)
    munge_dir = root / "munge"
    munge_dir.mkdir(mode=0o755)
    os.chown(munge_dir, munge.pw_uid, munge.pw_gid)
    munge_socket = munge_dir / "munge.socket"
    conf = _write_conf(root, node, munge_socket)
    cluster = SlurmCluster(root=root, conf=conf, node=node)
    cluster.logs.update(
        {
            "munged": munge_dir / "munged.log",
            "slurmctld": root / "slurmctld.log",
            "slurmd": root / "slurmd.log",
        }
    )
    try:
        cluster._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                f"--socket={munge_socket}",
                f"--key-file={MUNGE_KEY}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            user="munge",
        )
        munge_cmd, unmunge_cmd = _which("munge"), _which("unmunge")

        def munge_ok() -> bool:
            if not munge_socket.exists():
                return False
            cred = subprocess.run(
                [munge_cmd, "-n", f"--socket={munge_socket}"], capture_output=True, timeout=10
            )
            if cred.returncode != 0:
                return False
            back = subprocess.run(
                [unmunge_cmd, f"--socket={munge_socket}"],
                input=cred.stdout,
                capture_output=True,
                timeout=10,
            )
            return back.returncode == 0

        _wait("munged", munge_ok, cluster, 20)
        cluster._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(conf)])

        def ctld_ok() -> bool:
            ping = cluster.run("scontrol", "ping", check=False, timeout=10)
            return "UP" in ping.stdout

        _wait("slurmctld", ctld_ok, cluster, 40)
        cluster._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(conf), "-N", node])

        def node_state() -> str:
            out = cluster.run("sinfo", "-h", "-N", "-n", node, "-o", "%T", check=False)
            return out.stdout.strip().lower()

        def node_idle() -> bool:
            state = node_state()
            if state.startswith(("down", "drain", "fail")):
                cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
            return state == "idle"

        _wait("the node (idle)", node_idle, cluster, 60)
        smoke = cluster.run(
            "srun", "-N1", "-n1", "-t", "1", "echo", "ranklog-slurm-ok", check=False, timeout=60
        )
        if "ranklog-slurm-ok" not in smoke.stdout:
            raise SlurmUnavailable(f"a one-task srun failed: {smoke.stdout}{smoke.stderr}")
    except BaseException as exc:
        tails = cluster.log_tails()
        cluster.stop()
        if isinstance(exc, SlurmUnavailable | OSError | subprocess.SubprocessError):
            raise SlurmUnavailable(f"{exc}\n{tails}") from exc
        raise
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running single-node SLURM cluster (installed and started here, stopped at the end)."""
    try:
        cluster = start_cluster()
    except SlurmUnavailable as exc:
        msg = f"no SLURM cluster: {exc}"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    try:
        yield cluster
    finally:
        cluster.stop()


def _main() -> None:
    cluster = start_cluster()
    print(f"export SLURM_CONF={cluster.conf}   # Ctrl-C stops the cluster", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    _main()
