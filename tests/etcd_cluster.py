"""A real etcd cluster on loopback ports for the multi-launcher tests (Debian's
``etcd-server``; `make etcd` installs it). Members are separate processes the test can kill;
every member is killed and its data directory removed when the context ends."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from mnemojax._src.distributed import transport
from mnemojax._src.distributed.launcher.etcd_store import TLS_ENV


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def require_etcd() -> str:
    """The etcd binary, or skip (with the reason and the fix)."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd is not installed (make etcd: apt-get install etcd-server)")
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        pytest.skip("the etcd3gw client is not installed (pip install mnemojax[etcd])")
    return binary


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    """A test CA and what it signed (PEM files): the server's certificate for 127.0.0.1 and
    a client's. ``env`` is what a client of the cluster sets (`EtcdTLS.from_env`)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    @classmethod
    def make(cls, directory: str) -> TLSFiles:
        import trustme

        ca = trustme.CA()
        server = ca.issue_cert("127.0.0.1", "localhost")
        client = ca.issue_cert("mnemojax-client")
        paths = {}
        for name, blob in (("ca", ca.cert_pem), ("server_cert", server.cert_chain_pems[0]),
                           ("server_key", server.private_key_pem),
                           ("client_cert", client.cert_chain_pems[0]),
                           ("client_key", client.private_key_pem)):
            paths[name] = os.path.join(directory, f"{name}.pem")
            blob.write_to_path(paths[name])
        return cls(**paths)

    def env(self, *, client_cert: bool = True) -> dict[str, str]:
        env = {TLS_ENV["cacert"]: self.ca}
        if client_cert:
            env |= {TLS_ENV["cert"]: self.client_cert, TLS_ENV["key"]: self.client_key}
        return env


class EtcdCluster:
    """``size`` members on free loopback ports. ``url`` is ``etcd://h:p,h:p,...``; with
    ``tls``, ``etcds://...``: the members serve clients over TLS and refuse any client
    without a certificate from the test CA (``--client-cert-auth``)."""

    def __init__(self, size: int = 3, *, tls: bool = False):
        self.binary = require_etcd()
        self.size = size
        self.dir = tempfile.mkdtemp(prefix="mnjx-etcd-")
        self.tls = TLSFiles.make(self.dir) if tls else None
        self._client_scheme = "https" if tls else "http"
        self.client_ports: list[int] = []
        self.peer_ports: list[int] = []
        self.url = ""
        self._pick_ports()
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self._commands: list[list[str]] = [[] for _ in range(size)]

    def start(self, timeout_s: float = 30.0, attempts: int = 3) -> None:
        """Starts every member and waits until each is healthy. A member that exits at
        start (a port taken meanwhile: free ports are racy) makes a new attempt on new
        ports; the last failure names the member and ends with its log."""
        for attempt in range(attempts):
            try:
                self._start_once(timeout_s)
                return
            except (TimeoutError, RuntimeError):
                self.stop(remove=False)
                if attempt == attempts - 1:
                    raise
                self._pick_ports()

    def _pick_ports(self) -> None:
        ports: set[int] = set()
        while len(ports) < 2 * self.size:  # distinct: the OS may hand out a port twice
            ports.add(transport.free_port())
        ordered = sorted(ports)
        self.client_ports, self.peer_ports = ordered[:self.size], ordered[self.size:]
        self.url = ("etcds://" if self.tls else "etcd://") + ",".join(
            f"127.0.0.1:{p}" for p in self.client_ports)

    def _log(self, i: int) -> str:
        try:
            with open(f"{self.dir}/m{i}.log", errors="replace") as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def _start_once(self, timeout_s: float) -> None:
        cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(self.peer_ports))
        token = f"mnjx-{self.client_ports[0]}"
        for i in range(self.size):
            shutil.rmtree(f"{self.dir}/m{i}", ignore_errors=True)
            client, peer = f"{self._client_scheme}://127.0.0.1:{self.client_ports[i]}", \
                f"http://127.0.0.1:{self.peer_ports[i]}"
            tls = [] if self.tls is None else [
                "--cert-file", self.tls.server_cert, "--key-file", self.tls.server_key,
                "--client-cert-auth", "--trusted-ca-file", self.tls.ca]
            self._commands[i] = [
                self.binary, "--name", f"m{i}", "--data-dir", f"{self.dir}/m{i}",
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", token,
                "--heartbeat-interval", "50", "--election-timeout", "500",
                "--log-level", "error", *tls]
            self._spawn(i, "wb")
        deadline = time.monotonic() + timeout_s
        for i in range(self.size):
            while not self._healthy(i):
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"etcd member m{i} exited ({proc.returncode}) at "
                                       f"start:\n{self._log(i)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd member m{i} not healthy in {timeout_s} s:\n"
                                       f"{self._log(i)}")
                time.sleep(0.1)

    def _spawn(self, i: int, mode: str) -> None:
        with open(f"{self.dir}/m{i}.log", mode) as log:  # the member keeps its copy
            self.procs[i] = subprocess.Popen(self._commands[i], stdout=subprocess.DEVNULL,
                                             stderr=log)

    def restart(self, *members: int, timeout_s: float = 30.0) -> None:
        """Starts killed members again on their data directories and ports (their WAL
        makes them rejoin the cluster as they were) and waits until each is healthy."""
        for i in members:
            self._spawn(i, "ab")
        deadline = time.monotonic() + timeout_s
        for i in members:
            while not self._healthy(i):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd member m{i} not healthy again in {timeout_s} "
                                       f"s:\n{self._log(i)}")
                time.sleep(0.1)

    def _healthy(self, i: int) -> bool:
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
            handlers.append(urllib.request.HTTPSHandler(context=context))
        opener = urllib.request.build_opener(*handlers)  # no proxy
        try:
            with opener.open(f"{self._client_scheme}://127.0.0.1:{self.client_ports[i]}/health",
                             timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (the cluster keeps a quorum with one of three gone)."""
        proc = self.procs[i]
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self, *, remove: bool = True) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def etcd_cluster(size: int = 3, *, tls: bool = False) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(size, tls=tls)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class CutOff:
    """One client's own way to the cluster (a TCP relay per member on loopback), that the
    test can cut and mend: a node cut off from etcd alone while the others reach it.
    ``url`` names the relays; `cut` closes them and every connection through them, `mend`
    listens again on the same ports. Ended (threads and sockets) at `close`."""

    def __init__(self, cluster: EtcdCluster):
        self._targets = list(cluster.client_ports)
        self._ports = [transport.free_port() for _ in self._targets]
        scheme = "etcds://" if cluster.tls else "etcd://"
        self.url = scheme + ",".join(f"127.0.0.1:{p}" for p in self._ports)
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._open = False
        self.mend()

    def mend(self) -> None:
        with self._lock:
            self._open = True
            for port, target in zip(self._ports, self._targets, strict=True):
                listener = socket.socket()
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", port))
                listener.listen(16)
                self._sockets.append(listener)
                threading.Thread(target=self._accept, args=(listener, target),
                                 daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self._open = False
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    close = cut

    def _accept(self, listener: socket.socket, target: int) -> None:
        while True:
            try:
                inbound, _ = listener.accept()
            except OSError:  # cut
                return
            try:
                outbound = socket.create_connection(("127.0.0.1", target), timeout=2)
            except OSError:
                inbound.close()
                continue
            with self._lock:
                if not self._open:
                    inbound.close()
                    outbound.close()
                    return
                self._sockets += [inbound, outbound]
            for a, b in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
