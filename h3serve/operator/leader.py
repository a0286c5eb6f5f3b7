"""Leader election on a coordination.k8s.io/v1 Lease, as controller-runtime and client-go do it.

Every operator replica runs kopf (watches, liveness); only the holder of the Lease reconciles. A replica takes the
Lease when it is free or its holder stopped renewing it for `duration` seconds, renews it every `renew` seconds, and
gives it up on a clean exit (the next replica takes over at once). A leader that cannot renew before its Lease
expires exits the process: another replica may already hold the Lease, and two never reconcile at once.

Expiry is judged by the waiting replica's own monotonic clock, from when it last saw the Lease record change (as
client-go's `observedTime`), never by comparing the holder's `renewTime` with the local wall clock: a stand-by
whose clock runs ahead would otherwise take a live leader's Lease.

Writes are fenced by the term: `term` is the Lease's leaseTransitions when this replica took it, and `check(term)`
(called before every write of a reconcile that began in that term) refuses once the replica saw another holder in
the Lease, could not renew for `duration - renew` seconds (measured from when the renewal was sent), or holds a
later term than the pass began in.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from typing import Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("h3serve.operator")


class LostLease(RuntimeError):
    """A write refused: this replica no longer holds the term the pass began in."""

LEASE_NAME = "h3serve-operator"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Leader:
    def __init__(self, namespace: str, identity: str, duration: float = 15.0, renew: float = 5.0,
                 on_elected: Callable[[], None] | None = None, name: str = LEASE_NAME,
                 clock: Callable[[], dt.datetime] = _now, api_client: client.ApiClient | None = None,
                 on_lost: Callable[[], None] = lambda: os._exit(1)):
        self.namespace, self.identity, self.name = namespace, identity, name
        self.duration, self.renew = duration, renew
        self.on_elected, self.on_lost = on_elected, on_lost
        self._clock, self._api_client = clock, api_client  # the wall clock only stamps the Lease for readers
        self._observed: tuple | None = None  # the Lease record last seen, and when (time.monotonic())
        self._observed_at = 0.0
        self.elected = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_renew = 0.0  # time.monotonic() when the last successful renewal was sent
        self.term: int | None = None  # the Lease's leaseTransitions when this replica took it

    # -- public ---------------------------------------------------------------------------------------------------
    def start(self) -> "Leader":
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()
        return self

    def is_leader(self) -> bool:
        # a stand-by may take over `duration` after it saw the last renewal; stop well before that
        return self.elected.is_set() and time.monotonic() - self._last_renew < self.duration - self.renew

    def check(self, term: int | None) -> None:
        """Raise LostLease unless this replica leads, in `term`."""
        if not self.is_leader() or self.term != term:
            raise LostLease(f"leader election: {self.identity} no longer holds Lease {self.namespace}/{self.name} "
                            f"in term {term} (now {self.term if self.is_leader() else 'none'}); write refused")

    def stop(self) -> None:
        """Stop renewing and hand the Lease back (a clean shutdown: the next replica needs not wait it out)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.renew + 5)
        if self.elected.is_set():
            try:
                lease = self._api().read_namespaced_lease(self.name, self.namespace)
                if lease.spec.holder_identity == self.identity:
                    lease.spec.holder_identity = None
                    lease.spec.renew_time = None
                    lease.spec.acquire_time = None
                    self._api().replace_namespaced_lease(self.name, self.namespace, lease)
                    log.info("leader election: released Lease %s/%s", self.namespace, self.name)
            except ApiException as e:
                log.warning("leader election: could not release the Lease: %s", e.reason)
            self.elected.clear()
            self.term = None

    # -- the loop -------------------------------------------------------------------------------------------------
    def _api(self) -> client.CoordinationV1Api:
        return client.CoordinationV1Api(self._api_client)

    def _run(self) -> None:
        log.info("leader election: %s waits for Lease %s/%s", self.identity, self.namespace, self.name)
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                ok = self._try_acquire_or_renew()
            except Exception as e:  # noqa: BLE001 - the API server may be briefly away; the expiry check decides
                log.warning("leader election: %s", e)
                ok = False
            if ok is None:  # another replica holds the Lease though this one led: deposed, stop at once
                self._lose("Lease %s/%s is held by another replica")
                return
            if ok:
                self._last_renew = sent
                if not self.elected.is_set():
                    log.info("leader election: %s is the leader (Lease %s/%s)", self.identity, self.namespace,
                             self.name)
                    self.elected.set()
                    if self.on_elected is not None:
                        self.on_elected()
            elif self.elected.is_set() and time.monotonic() - self._last_renew >= self.duration - self.renew:
                # cannot prove the Lease is still ours before another replica may take it: stop now
                self._lose("lost Lease %s/%s")
                return
            self._stop.wait(self.renew if self.elected.is_set() else min(self.renew, 2.0))

    def _lose(self, what: str) -> None:
        log.error("leader election: " + what + "; exiting so that a single replica reconciles", self.namespace,
                  self.name)
        self.elected.clear()
        self.term = None
        self.on_lost()

    def _try_acquire_or_renew(self) -> bool | None:
        """True: this replica holds the Lease now; False: another does (or a race); None: another took it from this
        leader."""
        api, now = self._api(), self._clock()
        try:
            lease = api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            body = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                                  spec=client.V1LeaseSpec(holder_identity=self.identity,
                                                          lease_duration_seconds=int(self.duration),
                                                          acquire_time=now, renew_time=now, lease_transitions=0))
            try:
                api.create_namespaced_lease(self.namespace, body)
                self.term = 0
                return True
            except ApiException as e2:
                if e2.status == 409:  # another replica created it first
                    return False
                raise
        spec = lease.spec
        holder = spec.holder_identity
        record = (holder, spec.renew_time, spec.acquire_time, spec.lease_transitions)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        expired = (not holder or
                   time.monotonic() - self._observed_at > (spec.lease_duration_seconds or self.duration))
        if holder != self.identity and not expired:
            return None if self.elected.is_set() else False
        if holder != self.identity:
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
            spec.acquire_time = now
            spec.holder_identity = self.identity
        spec.lease_duration_seconds = int(self.duration)
        spec.renew_time = now
        try:
            api.replace_namespaced_lease(self.name, self.namespace, lease)  # resourceVersion: optimistic lock
            self.term = spec.lease_transitions or 0
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise
