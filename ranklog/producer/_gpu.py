"""GPU sampling: one daemon thread per host appends :class:`~ranklog.schemas.Gpu` events.

Sources: ``nvml`` (nvidia-ml-py; a reading a board lacks is None); ``ray`` (NeMo RL's way:
``http://<NodeManagerAddress>:<MetricsExportPort>/metrics`` of alive ``ray.nodes()``, gram
in MiB whatever the HELP line says; host memory kept as :class:`HostMemory`); ``auto`` (nvml
if it sees a GPU, else ray if initialised, else nothing: logged once, no thread). A failing
source is retried after 2x, 4x, ... up to 10x the interval and warned about once; nothing is
raised into training. A source that works but sees no GPU (a GPU-less Ray node) is logged once
and kept sampling. Steps stay None: the shipper aligns samples by stream position.
One process per host samples: see :func:`elect_sampler`.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import logging
import math
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple, Protocol, TypeAlias

from ranklog.errors import ConfigError, ExtraMissingError, RanklogWarning
from ranklog.schemas import HOST_INDEX, Gpu

__all__ = ["GpuSampler", "GpuSource", "HostMemory", "NvmlSource", "RaySource", "elect_sampler"]

log = logging.getLogger("ranklog")

GPU_SOURCES: Final = ("auto", "nvml", "ray")
MIB: Final = 1024 * 1024
MAX_BACKOFF: Final = 10.0  # times the interval
_GPU_SERIES: Final = ("ray_node_gpus_utilization", "ray_node_gram_used", "ray_node_gram_available")
Sample: TypeAlias = tuple[str, dict[str, str], float]  # Prometheus: name, labels, value


class GpuSource(Protocol):
    """What the sampler calls: ``sample()`` every interval, ``close()`` once at the end."""

    name: str

    def sample(self) -> list[Gpu]: ...
    def close(self) -> None: ...


class HostMemory(NamedTuple):
    """A node's host memory as Ray exports it (bytes); the ``Gpu`` event has no field for it."""

    host: str
    used: int | None
    total: int | None


class NvmlSource:
    """Every GPU of this host through NVML; a reading that raises NVMLError is ``None``."""

    name = "nvml"

    def __init__(self, host: str) -> None:
        try:
            import pynvml
        except ImportError:
            raise ExtraMissingError("pynvml", "gpu") from None
        self._nv: Any = pynvml
        self.host, self._ready = host, False

    def count(self) -> int:
        """GPUs NVML sees (NVML is initialised once); raises NVMLError without a driver."""
        if not self._ready:
            self._nv.nvmlInit()
            self._ready = True
        try:
            return int(self._nv.nvmlDeviceGetCount())
        except Exception:
            self.close()  # initialise afresh next time (after a driver reload, say)
            raise

    def _get(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nv.NVMLError:
            return None

    def sample(self) -> list[Gpu]:
        nv, now = self._nv, time.time()
        out: list[Gpu] = []
        for i in range(self.count()):
            if (h := self._get(nv.nvmlDeviceGetHandleByIndex, i)) is None:
                continue  # fallen off the bus: the others are still sampled
            util = self._get(nv.nvmlDeviceGetUtilizationRates, h)
            mem = self._get(nv.nvmlDeviceGetMemoryInfo, h)
            temp = self._get(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            power = self._get(nv.nvmlDeviceGetPowerUsage, h)
            raw = self._get(nv.nvmlDeviceGetName, h) or ""
            name = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            used, total = (None, None) if mem is None else (int(mem.used), int(mem.total))
            util = None if util is None else float(util.gpu)
            temp = None if temp is None else float(temp)
            power = None if power is None else power / 1000.0  # mW
            out.append(Gpu(now, self.host, i, util, used, total, temp, power, None, name))
        return out

    def close(self) -> None:
        if self._ready:
            self._ready = False
            with contextlib.suppress(Exception):
                self._nv.nvmlShutdown()


class RaySource:
    """GPUs from Ray's metrics agents: this node (one sampler per host) or the ``cluster``'s."""

    name = "ray"

    def __init__(
        self,
        *,
        scope: Literal["local", "cluster"] = "local",
        timeout: float = 2.0,
        host_memory: bool = False,
    ):
        try:
            import ray
        except ImportError:
            raise ExtraMissingError("ray", "ray") from None
        import urllib.request  # here: it costs ~30 ms to import

        self._ray: Any = ray
        self.scope, self.timeout = scope, timeout
        #: also sample each node's memory, as a Gpu event of index HOST_INDEX (NeMo RL's
        #: ``ray/node.N.mem_gb``)
        self.with_host_memory = host_memory
        self.host_memory: list[HostMemory] = []  # of the last sample
        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open

    def endpoints(self) -> list[tuple[str, str]]:
        """(NodeManagerAddress, metrics URL) of every alive node in scope."""
        ray = self._ray
        if not ray.is_initialized():
            raise ConfigError("the Ray GPU source needs ray.init() in this process")
        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]
        if self.scope == "local":
            me = ray.get_runtime_context().get_node_id()
            nodes = [n for n in nodes if n.get("NodeID") == me]
        out = []
        for n in nodes:
            addr = str(n["NodeManagerAddress"])
            netloc = f"[{addr}]" if ":" in addr else addr
            out.append((addr, f"http://{netloc}:{int(n['MetricsExportPort'])}/metrics"))
        return out

    def sample(self) -> list[Gpu]:
        """GPUs of every node that answers; raises only when none of them does."""
        gpus, memory, errors = list[Gpu](), list[HostMemory](), list[Exception]()
        targets = self.endpoints()
        for addr, url in targets:
            try:
                with self._open(url, timeout=self.timeout) as resp:
                    text = resp.read(64 * MIB).decode("utf-8", "replace")
                g, m = node_metrics(parse_prometheus(text), addr)
            except Exception as exc:  # OSError, ValueError (not Prometheus text)
                errors.append(exc)
                log.debug("ranklog: cannot read Ray metrics at %s: %s", url, exc)
                continue
            gpus += g
            memory += m
        if errors and len(errors) == len(targets):
            raise errors[0]
        self.host_memory = memory
        if self.with_host_memory:
            ts = time.time()
            gpus += [Gpu(ts, m.host, HOST_INDEX, mem_used=m.used, mem_total=m.total,
                         name="host memory") for m in memory]  # fmt: skip
        return gpus

    def close(self) -> None: ...


def node_metrics(samples: Iterable[Sample], addr: str) -> tuple[list[Gpu], list[HostMemory]]:
    """Gpu events per ``ip`` label and ``GpuIndex`` (older Rays' per-node sums are ignored)."""
    ts = time.time()
    gpus: dict[tuple[str, int], dict[str, Any]] = {}
    hosts: dict[str, dict[str, float]] = {}
    for name, labels, value in samples:
        host = labels.get("ip") or addr
        if name in ("ray_node_mem_used", "ray_node_mem_total"):
            hosts.setdefault(host, {})[name] = value
        elif name in _GPU_SERIES and (index := labels.get("GpuIndex", "")).isdigit():
            rec = gpus.setdefault((host, int(index)), {"name": labels.get("GpuDeviceName", "")})
            rec[name] = value
    events = []
    for (host, i), rec in sorted(gpus.items()):
        util, used, avail = (_real(rec.get(k)) for k in _GPU_SERIES)
        total = None if used is None or avail is None else round((used + avail) * MIB)
        used_b = None if used is None else round(used * MIB)
        events.append(Gpu(ts, host, i, util, used_b, total, name=rec["name"]))
    memory = [
        HostMemory(h, _bytes(v.get("ray_node_mem_used")), _bytes(v.get("ray_node_mem_total")))
        for h, v in sorted(hosts.items())
    ]
    return events, memory


def _real(v: float | None) -> float | None:
    """A finite, non-negative reading, else None (Ray reports -1 for an unknown utilisation)."""
    return v if v is not None and math.isfinite(v) and v >= 0 else None


def _bytes(v: float | None) -> int | None:
    return None if (r := _real(v)) is None else round(r)


_VALUE = r"[-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|(?i:nan|inf))"
_LINE = re.compile(rf"\s*([a-zA-Z_:][\w:]*)(?:\{{(.*)\}}\s*|\s+)({_VALUE})(?:\s+-?\d+)?\s*", re.A)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_ESCAPE = re.compile(r"\\(.)")


def parse_prometheus(text: str) -> Iterator[Sample]:
    """Samples of Prometheus text: prometheus_client's parser when installed, else ours."""
    try:
        parser: Any = importlib.import_module("prometheus_client.parser")
    except ImportError:
        return parse_prometheus_text(text)
    return (
        (s.name, dict(s.labels), float(s.value))
        for fam in parser.text_string_to_metric_families(text)
        for s in fam.samples
    )


def parse_prometheus_text(text: str) -> Iterator[Sample]:
    """Text format 0.0.4 (comments, escaped labels, NaN/+Inf); ValueError on a bad line."""
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if (m := _LINE.fullmatch(line)) is None:
            raise ValueError(f"line {lineno} is not a Prometheus sample: {line[:200]!r}")
        labels: dict[str, str] = {}
        body, pos = m[2] or "", 0
        while body[pos:].strip():
            if (lm := _LABEL.match(body, pos)) is None:
                raise ValueError(f"line {lineno}: bad labels {body[:200]!r}")
            labels[lm[1]] = _ESCAPE.sub(lambda e: "\n" if e[1] == "n" else e[1], lm[2])
            pos = lm.end()
        yield m[1], labels, float(m[3])  # float() reads NaN, +Inf, -Inf


def open_source(source: str, host: str) -> GpuSource | None:
    """``nvml``/``ray`` (ExtraMissingError without its package) or ``auto`` (None: nothing)."""
    if source == "nvml":
        return NvmlSource(host)
    if source == "ray":
        return RaySource()
    if source != "auto":
        raise ConfigError(f"gpu source must be one of {GPU_SOURCES}, got {source!r}")
    with contextlib.suppress(Exception):  # no pynvml, no driver
        nvml = NvmlSource(host)
        if nvml.count() >= 1:
            return nvml
        nvml.close()
    with contextlib.suppress(Exception):  # no ray
        ray = RaySource()
        if ray._ray.is_initialized():
            return ray
    return None


def backoff(interval: float, failures: int) -> float:
    """Seconds to wait after ``failures`` consecutive failures: 2x, 4x, ... up to 10x."""
    return interval * min(2.0**failures, MAX_BACKOFF) if failures else interval


class GpuSampler:
    """A daemon thread calling ``append(Gpu(...))`` for each GPU every ``interval`` seconds."""

    def __init__(
        self,
        append: Callable[[Gpu], None],
        *,
        source: str | GpuSource = "auto",
        interval: float = 10.0,
        host: str | None = None,
    ) -> None:
        if not (isinstance(interval, int | float) and math.isfinite(interval) and interval > 0):
            raise ConfigError(f"gpu interval must be a positive number, got {interval!r}")
        self.interval = float(interval)
        self.host = host or socket.gethostname()
        self._append = append
        self._source = open_source(source, self.host) if isinstance(source, str) else source
        self.source_name: str = "none" if self._source is None else self._source.name
        self.failures = self.appended = 0  # failures: consecutive ones
        self._warned = self._started = self._said_empty = False
        self._stop = threading.Event()
        self._lock = threading.Lock()  # held while appending: stop() waits for it
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling (the first sample at once); with nothing to sample, say so and stop."""
        if self._started:
            return
        self._started = True
        if self._source is None:
            log.info("ranklog: no GPU to sample on %s (no NVML device, no Ray)", self.host)
            return
        self._thread = threading.Thread(
            target=self._loop, args=(self._source,), name="ranklog-gpu", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread; nothing is appended after this returns (unless it timed out)."""
        self._stop.set()
        if self._lock.acquire(timeout=timeout):  # bounded: a signal handler may call this
            self._lock.release()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def _loop(self, src: GpuSource) -> None:
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    events = src.sample()
                    with self._lock:
                        if self._stop.is_set():
                            return
                        for ev in events:
                            self._append(ev)
                            self.appended += 1
                except Exception as exc:
                    self.failures += 1
                    log.debug("ranklog: GPU sampling (%s) failed: %r", self.source_name, exc)
                    if not self._warned:
                        self._warned = True
                        msg = f"GPU sampling ({self.source_name}) failed: {exc!r}; will retry"
                        warnings.warn(f"ranklog: {msg}", RanklogWarning, stacklevel=1)
                else:
                    if self.failures:
                        log.info("ranklog: GPU sampling (%s) works again", self.source_name)
                    self.failures = 0
                    if not events and not self._said_empty:  # a GPU-less Ray node, say
                        self._said_empty = True
                        msg = "ranklog: %s reports no GPU on %s (yet); sampling goes on"
                        log.info(msg, self.source_name, self.host)
                delay = backoff(self.interval, self.failures)
                self._stop.wait(max(0.0, delay - (time.monotonic() - t0)))
        finally:
            with contextlib.suppress(Exception):
                src.close()


def _proc(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of a process from /proc, None without an entry."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), fields[19].decode()
    except (OSError, IndexError):
        return None


def _alive(holder: str) -> bool:
    """Whether the process a lock names lives on this host (the same one: same start time)."""
    pid_s, _, start = holder.partition(" ")
    if not pid_s.isdigit() or int(pid_s) == 0:
        return False
    with contextlib.suppress(PermissionError):
        try:
            os.kill(int(pid_s), 0)
        except ProcessLookupError:
            return False
    st = _proc(int(pid_s))  # None: no /proc (or hidden): trust kill(pid, 0)
    return st is None or (st[0] not in ("Z", "X") and start in ("?", st[1]))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None


@contextlib.contextmanager
def _host_lock(spool: Path, host: str) -> Iterator[tuple[Path, str]]:
    """The lock file and this process's "pid starttime", with the host's elections serialised
    by ``flock`` on ``<host>.guard`` (where flock is refused, O_EXCL alone decides creation).
    """
    lock = Path(spool) / "gpu" / (re.sub(r"[^A-Za-z0-9._-]", "_", host) + ".lock")
    st = _proc(os.getpid())
    lock.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    fd = os.open(lock.with_suffix(".guard"), os.O_RDWR | os.O_CREAT, 0o640)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield lock, f"{os.getpid()} {st[1] if st else '?'}"
    finally:
        os.close(fd)


def elect_sampler(spool: Path, host: str, local_rank: int | None) -> bool:
    """Whether this process samples ``host``'s GPUs: exactly one process per host says True.

    Local rank 0 does when local ranks are known; else the holder of ``SPOOL/gpu/<host>.lock``
    ("pid starttime", created O_EXCL). A stale lock (dead pid, or a reused one: the start time
    differs) is replaced by renaming a fresh file onto it and reading it back.
    """
    if local_rank is not None:
        return local_rank == 0
    try:
        with _host_lock(spool, host) as (lock, me):
            for _ in range(3):
                try:
                    fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
                except FileExistsError:
                    holder = _read(lock)
                    if holder is None:
                        continue  # released meanwhile
                    if holder == me or _alive(holder):  # "": died between create and write
                        return holder == me
                    tmp = lock.with_name(f"{lock.name}.{os.getpid()}.tmp")
                    tmp.write_text(me + "\n")
                    os.replace(tmp, lock)  # take the stale lock over, then check
                    return _read(lock) == me
                with os.fdopen(fd, "w") as f:
                    f.write(me + "\n")
                return True
    except OSError as exc:
        warnings.warn(f"ranklog: no GPU sampling on {host}: {exc}", RanklogWarning, 2)
    return False


def release_election(spool: Path, host: str) -> None:
    """Remove this process's lock for ``host`` (at close) so another process may sample."""
    with contextlib.suppress(OSError), _host_lock(spool, host) as (lock, me):
        if _read(lock) == me:
            lock.unlink()
