"""A job's keys in etcd: JSON values under one prefix, leases kept alive, every call failing
over across the cluster's members.

etcd (v3 API, through its gRPC gateway's JSON endpoints; the client is OpenStack's
``etcd3gw``) is the control plane of a job that spans several launchers (`plane`). etcd does
the consensus; this module only names the job's keys and survives the loss of a member: a
call that cannot reach one member (refused, timed out, no leader) is retried on the next,
until ``retry_s`` has passed.

Over a network that others share, use TLS: ``etcds://HOST:PORT`` talks HTTPS to an etcd
started with ``--cert-file``/``--key-file`` (and ``--client-cert-auth
--trusted-ca-file`` to refuse clients without a certificate from that CA). The client's
files come from the environment, so every launcher and ``mnemojax status`` of the job
read the same (`EtcdTLS.from_env`): ``MNEMOJAX_ETCD_CACERT`` (the CA that signed the
server's certificate; without it, the ``certifi`` bundle that ``requests`` trusts, not the
system's store), ``MNEMOJAX_ETCD_CERT`` and ``MNEMOJAX_ETCD_KEY`` (this client's
certificate and key, for client-cert auth). Any certificate of the CA etcd trusts may read
and write every job's keys on that etcd: a CA per job (or etcd's RBAC) keeps jobs apart.

Nothing here knows about workers or worlds; `plane` does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from mnemojax._src.errors import DistributedError, InvalidOptionError

logger = logging.getLogger("mnemojax")

T = TypeVar("T")

SCHEME = "etcd://"
TLS_SCHEME = "etcds://"
ROOT = "/mnemojax/"
TLS_ENV = {"cacert": "MNEMOJAX_ETCD_CACERT", "cert": "MNEMOJAX_ETCD_CERT",
           "key": "MNEMOJAX_ETCD_KEY"}


@dataclasses.dataclass(frozen=True)
class EtcdTLS:
    """The client side of TLS to etcd: files, by path (see module doc), each named in
    errors by its environment variable. Checked when made: every file is read, so a
    wrong file fails here, by name, and not as an unreachable cluster later.

    Raises:
        InvalidOptionError: a file that does not exist or is not PEM of its kind, a key
            that does not match its certificate, or a certificate without its key (or a
            key without its certificate).
    """

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self):
        for field in TLS_ENV:
            path = getattr(self, field)
            if path is not None and not os.path.isfile(path):
                raise InvalidOptionError(f"{TLS_ENV[field]}={path!r} is invalid: no such file")
        if (self.cert is None) != (self.key is None):
            given, missing = ("cert", "key") if self.cert is not None else ("key", "cert")
            raise InvalidOptionError(f"{TLS_ENV[given]} is set but {TLS_ENV[missing]} is not: "
                                     "a client certificate needs its key")
        context = ssl.create_default_context()
        try:
            if self.cacert is not None:
                context.load_verify_locations(cafile=self.cacert)
        except ssl.SSLError as e:
            raise InvalidOptionError(f"{TLS_ENV['cacert']}={self.cacert!r} is invalid: not "
                                     f"a PEM CA certificate ({e})") from e
        try:
            if self.cert is not None:
                context.load_cert_chain(self.cert, self.key)
        except ssl.SSLError as e:
            raise InvalidOptionError(
                f"{TLS_ENV['cert']}={self.cert!r} with {TLS_ENV['key']}={self.key!r} is "
                f"invalid: not a PEM certificate and its matching key ({e})") from e

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EtcdTLS:
        """Reads ``MNEMOJAX_ETCD_{CACERT,CERT,KEY}`` (an empty one is unset)."""
        env = os.environ if env is None else env
        return cls(**{field: env.get(var) or None for field, var in TLS_ENV.items()})

    @property
    def given(self) -> bool:
        return any((self.cacert, self.cert, self.key))


def parse_rdzv(url: str) -> tuple[str, tuple[tuple[str, int], ...]]:
    """``etcd://`` (HTTP) or ``etcds://`` (HTTPS) ``host:port[,host:port...]`` -> the
    protocol and the endpoints.

    Raises:
        InvalidOptionError: not that form.
    """
    for scheme, protocol in ((SCHEME, "http"), (TLS_SCHEME, "https")):
        if isinstance(url, str) and url.startswith(scheme):
            return protocol, _endpoints(url, url[len(scheme):])
    raise InvalidOptionError(f"rdzv={url!r} is invalid: expected {SCHEME}HOST:PORT[,HOST:PORT"
                             f"...] or {TLS_SCHEME}... (TLS)")


class RendezvousError(DistributedError):
    """The etcd cluster could not be reached (no member answered in time)."""


class EtcdRefusedError(RendezvousError):
    """etcd answered that the call itself is wrong or not allowed (HTTP 400, 403, 404,
    413: too many operations in a transaction, a permission, a lease it does not know):
    trying again, here or on another member, gives the same answer."""


class FencedOutError(RendezvousError):
    """etcd refused a write of a launcher whose registration is gone (its lease ended:
    the other nodes took its node for lost), or is another launcher's (`EtcdStore.fence`)."""


def _endpoints(url: str, rest: str) -> tuple[tuple[str, int], ...]:
    endpoints = []
    for part in rest.rstrip("/").split(","):
        parsed = urllib.parse.urlsplit(f"//{part.strip()}")
        try:
            port = parsed.port
        except ValueError:
            port = None
        if not parsed.hostname or port is None:
            raise InvalidOptionError(f"rdzv={url!r} is invalid: {part!r} is not HOST:PORT")
        endpoints.append((parsed.hostname, port))
    return tuple(endpoints)


def _client_errors() -> tuple[type[BaseException], ...]:
    from etcd3gw import exceptions
    return (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
            exceptions.InternalServerError, exceptions.Etcd3Exception)


# The HTTP reasons of etcd's answers that no retry changes (`EtcdRefusedError`; etcd3gw
# keeps the reason as the exception's argument).
_REFUSALS = {("Bad Request",), ("Forbidden",), ("Not Found",), ("Request Entity Too Large",)}


def _describe(exc: BaseException | None) -> str:
    """An etcd3gw error with its text (kept in ``detail_text``: ``str()`` is empty)."""
    if exc is None:
        return "no attempt"
    detail = getattr(exc, "detail_text", None) or str(exc)
    return f"{type(exc).__name__}: {detail[:300]}"


class EtcdStore:
    """The keys of job ``job`` (all under ``/mnemojax/<job>/``), JSON-valued.

    Args:
        endpoints: the cluster's client endpoints (any member serves every call).
        job: the job's id (every launcher of the job gives the same).
        timeout_s: one HTTP request's timeout.
        retry_s: how long a call keeps trying the members before `RendezvousError`.
        protocol: ``http``, or ``https`` (TLS, with ``tls``'s files).
        tls: the CA to trust and this client's certificate (``https`` only).
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], job: str, *,
                 timeout_s: float = 1.0, retry_s: float = 15.0, protocol: str = "http",
                 tls: EtcdTLS | None = None):
        if not endpoints:
            raise InvalidOptionError("rdzv has no endpoint")
        if not job or "/" in job:
            raise InvalidOptionError(f"rdzv_id={job!r} is invalid: a non-empty name without '/'")
        if protocol not in ("http", "https"):
            raise InvalidOptionError(f"protocol={protocol!r} is invalid: http or https")
        tls = tls or EtcdTLS()
        if tls.given and protocol != "https":
            raise InvalidOptionError(
                f"TLS files are given ({', '.join(v for f, v in TLS_ENV.items() if getattr(tls, f))}"
                f") but the rdzv is plain HTTP: use {TLS_SCHEME}HOST:PORT")
        import requests
        from etcd3gw.client import Etcd3Client
        self.prefix = f"{ROOT}{job}/"
        self.endpoints = tuple(endpoints)
        self._clients = []
        for h, p in self.endpoints:
            session = requests.Session()
            session.trust_env = False  # the control plane is reached directly, never by proxy
            if tls.cacert is not None:
                session.verify = tls.cacert
            if tls.cert is not None and tls.key is not None:
                session.cert = (tls.cert, tls.key)
            self._clients.append(Etcd3Client(host=h, port=p, protocol=protocol,
                                             timeout=timeout_s, api_path="/v3/",
                                             session=session))
        self._current = 0
        self._retry_s = retry_s
        self._errors = _client_errors()
        self._fence: tuple[str, int] | None = None

    @classmethod
    def from_url(cls, url: str, job: str, **kwargs: Any) -> EtcdStore:
        """The store of ``url`` (`parse_rdzv`); TLS files from the environment
        (`EtcdTLS.from_env`)."""
        protocol, endpoints = parse_rdzv(url)
        return cls(endpoints, job, protocol=protocol, tls=EtcdTLS.from_env(), **kwargs)

    def _call(self, fn: Callable[[Any], T], retry_s: float | None = None) -> T:
        """``fn(client)`` on the current member, then on the others in turn, for up to
        ``retry_s`` (default: the store's)."""
        retry_s = self._retry_s if retry_s is None else retry_s
        deadline = time.monotonic() + retry_s
        last: BaseException | None = None
        while True:
            for _ in range(len(self._clients)):
                client = self._clients[self._current]
                try:
                    return fn(client)
                except self._errors as e:
                    if e.args[:1] in _REFUSALS:
                        raise EtcdRefusedError(f"etcd refused the call: {_describe(e)}") from e
                    last = e
                    self._current = (self._current + 1) % len(self._clients)
            if time.monotonic() > deadline:
                raise RendezvousError(f"no etcd member of {list(self.endpoints)} served "
                                      f"the call within {retry_s:.1f} s (down, out of reach, "
                                      f"or without a quorum): {_describe(last)}") from last
            time.sleep(0.1)

    def key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    # -- values -------------------------------------------------------------------------------
    def fence(self, key: str, lease: int) -> None:
        """From now on every write of this store commits only while ``key`` is held under
        ``lease`` (this launcher's registration), and raises `FencedOutError` otherwise: a
        launcher that etcd took for lost while it was cut off cannot write once it
        reaches etcd again (a review: its evictions of the others' healthy workers, made
        from its stale mirror, landed then and ended the job the others went on with), nor
        can it once a launcher of the same rank registered in its place."""
        self._fence = (key, lease)

    def _fenced(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
                retry_s: float | None = None) -> dict[str, Any]:
        """One transaction of ``compare`` (and the fence, once set) then ``success``; the
        reply. Every write goes through it, fenced or not.

        Raises:
            FencedOutError: the fence's compare failed.
        """
        from etcd3gw.utils import _encode
        fence = []
        if self._fence is not None:
            key, lease = self._fence
            fence = [{"key": _encode(key), "result": "EQUAL", "target": "LEASE",
                      "lease": lease}]
        txn = {"compare": compare + fence, "success": success,
               "failure": [{"request_range": {"key": _encode(self._fence[0])}}]
               if self._fence is not None else []}
        reply = self._call(lambda c: c.transaction(txn), retry_s)
        if not reply.get("succeeded", False) and self._fence is not None:
            held = reply.get("responses", [{}])[-1].get("response_range", {}).get("kvs", [])
            if not held or int(held[0].get("lease", 0)) != self._fence[1]:
                raise FencedOutError(
                    f"etcd refuses this launcher's writes: {self._fence[0]} is "
                    f"{'gone' if not held else 'held under another lease'} (this node was "
                    "taken for lost)")
        return reply

    def put(self, key: str, value: Any, *, lease: int | None = None,
            retry_s: float | None = None) -> None:
        """Puts ``key`` (under ``lease``), within the fence (`fence`)."""
        from etcd3gw.utils import _encode
        payload: dict[str, Any] = {"key": _encode(key), "value": _encode(json.dumps(value))}
        if lease is not None:
            payload["lease"] = lease
        self._fenced([], [{"request_put": payload}], retry_s)

    def create(self, key: str, value: Any, *, unless: Sequence[str] = (),
               lease: int | None = None, also: Mapping[str, Any] | None = None) -> bool:
        """Puts ``key`` (and the keys of ``also``) only if neither it nor any key of
        ``unless`` exists, in one transaction, within the fence (`fence`); True if this
        call created it.

        A transaction retried on another member after a timeout may have committed the
        first time: when it then fails, the key is read back, and a value equal to
        ``value`` counts as this call's (give values a nonce where that matters).
        """
        from etcd3gw.utils import _encode
        puts = []
        for k, v in {key: value, **(also or {})}.items():
            put: dict[str, Any] = {"key": _encode(k), "value": _encode(json.dumps(v))}
            if lease is not None and k == key:
                put["lease"] = lease
            puts.append({"request_put": put})
        compare = [{"key": _encode(k), "result": "EQUAL", "target": "CREATE",
                    "create_revision": 0} for k in (key, *unless)]
        if self._fenced(compare, puts).get("succeeded", False):
            return True
        return self.get(key) == json.loads(json.dumps(value))

    def get(self, key: str) -> Any | None:
        values = self._call(lambda c: c.get(key))
        return json.loads(values[0]) if values else None

    def items(self, sub: str = "") -> dict[str, Any]:
        """Every key under the job's prefix + ``sub`` -> its value; keys without the job's
        prefix. One consistent read (one revision)."""
        rows = self._call(lambda c: c.get_prefix(self.prefix + sub))
        out = {}
        for value, meta in rows:
            key = meta["key"]
            key = key.decode() if isinstance(key, bytes) else str(key)
            try:
                out[key[len(self.prefix):]] = json.loads(value)
            except ValueError:  # not ours: left alone
                continue
        return out

    def delete(self, key: str) -> None:
        """Deletes ``key``, within the fence (`fence`)."""
        from etcd3gw.utils import _encode
        self._fenced([], [{"request_delete_range": {"key": _encode(key)}}])

    # -- leases -------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        reply = self._call(lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": ttl_s,
                                                                             "ID": 0}))
        return int(reply["ID"])

    def keepalive(self, lease: int, *, retry_s: float | None = None) -> int:
        """Renews ``lease``; its new TTL, or -1 once it has expired."""
        reply = self._call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease}),
                           retry_s)
        return int(reply.get("result", {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self._call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease}))


class LeaseKeeper:
    """Keeps one lease alive from a daemon thread (renewed every third of its TTL).

    ``on_lost()`` runs once when the lease is gone: etcd answered that it expired (every
    key attached to it is gone, and the owner must act as if dead), or no member answered
    for ``outage_s`` (at least the TTL). While no member answers, the lease is not taken
    for lost before that: a leader elected after an outage of the whole cluster renews
    every lease it holds (etcd's lessor promotion), so a cluster restarted after longer
    than the TTL still holds the lease; a launcher cut off alone finds it expired once it
    reaches etcd again, the others having taken its node for lost meanwhile.
    """

    def __init__(self, store: EtcdStore, ttl_s: int, *,
                 on_lost: Callable[[], None] | None = None, outage_s: float = 0.0):
        self.store, self.ttl_s = store, ttl_s
        self.outage_s = max(float(ttl_s), outage_s)
        self.lease = store.grant(ttl_s)
        self.lost = False
        self.why = ""  # (once lost: etcd said it expired, or no member answered)
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mnemojax-etcd-lease",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        renewed = time.monotonic()
        told = 0.0  # (how long etcd had been silent when that was last logged)
        while not self._stop.wait(self.ttl_s / 3):
            answered = False
            try:
                alive = self.store.keepalive(self.lease, retry_s=self.ttl_s / 3) > 0
                answered = True
            except EtcdRefusedError:  # (a lease etcd does not know: ended)
                alive, answered = False, True
            except RendezvousError as e:
                silent = time.monotonic() - renewed
                if not told or silent >= told + 10:
                    logger.warning("etcd lease %x not renewed for %.1f s; this launcher "
                                   "goes on until etcd answers, at most %.0f s: %s",
                                   self.lease, silent, self.outage_s, e)
                    told = silent
                alive = silent < self.outage_s
            else:
                if alive and told:
                    logger.warning("etcd lease %x renewed after %.1f s without etcd",
                                   self.lease, time.monotonic() - renewed)
                if alive:
                    renewed, told = time.monotonic(), 0.0
            if not alive:  # expired, or etcd out of reach for the whole outage bound
                self.why = ("etcd says its lease ended (the other nodes took it for lost)"
                            if answered else f"no etcd member answered for "
                            f"{time.monotonic() - renewed:.0f} s (--etcd-outage-s "
                            f"{self.outage_s:.0f})")
                logger.error("etcd lease %x given up: %s", self.lease, self.why)
                self.lost = True
                if self._on_lost is not None:
                    self._on_lost()
                return

    def close(self, *, revoke: bool = True) -> None:
        """Stops renewing; ``revoke`` deletes the lease's keys now (not at its expiry)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if revoke and not self.lost:  # (a lost lease has nothing left to revoke)
            try:
                self.store.revoke(self.lease)
            except RendezvousError as e:
                logger.warning("etcd lease %x not revoked: %s", self.lease, e)
