"""`ember serve --register ROUTER`: a worker that joins a router by itself.

Once the server listens, a thread sends the router `POST /workers` with the worker's
advertised URL (`--advertise-url`, else `http://HOST:PORT` of --host / --port), proving
the cluster secret with the member token (`ember.cluster`), and again every
REGISTER_INTERVAL_S seconds: a router that restarted learns its workers back, and one
not up yet learns of the worker once it is. On shutdown the worker sends
`DELETE /workers/{id}`: the router drains it (no new request) while its requests in
flight finish.
"""

from __future__ import annotations

import logging
import threading

import httpx

from ember import cluster
from ember.headers import MEMBER_TOKEN_HEADER

logger = logging.getLogger("ember.server")

REGISTER_INTERVAL_S = 10.0


def advertised_url(host: str, port: int, advertise: str | None) -> str:
    """The URL a router reaches this worker at."""
    from ember.router.members import address_url, check_url

    if advertise:
        return check_url(advertise, "--advertise-url")
    if host in ("0.0.0.0", "::", ""):
        raise ValueError("--register with --host 0.0.0.0: give --advertise-url "
                         "http://ADDRESS:PORT (the address the router reaches)")  # fmt: skip
    return address_url(host, port)


class Registration:
    """The thread that keeps this worker registered with its router."""

    def __init__(self, router: str, url: str, role: str, secret: bytes | None) -> None:
        if secret is None:
            raise ValueError("--register needs $EMBER_CLUSTER_SECRET (the router's too)")
        from ember.router.members import check_url
        from ember.router.policy import Worker

        self.router = check_url(router, "--register")
        self.url, self.role = url, role
        self.headers = {MEMBER_TOKEN_HEADER: cluster.member_token(secret)}
        self.worker_id = Worker(url).id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="register", daemon=True)
        self._leaving: threading.Thread | None = None
        self.registered = False

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        body = {"url": self.url, "role": self.role}
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.is_set():
                try:
                    response = client.post(f"{self.router}/workers", json=body,
                                           headers=self.headers)  # fmt: skip
                    ok = response.status_code in (200, 201)
                    if not ok:
                        logger.warning("the router at %s refused this worker: %d %s",
                                       self.router, response.status_code, response.text[:200])  # fmt: skip
                except httpx.HTTPError as exc:
                    ok = False
                    logger.info("the router at %s is not reachable (%r)", self.router, exc)
                if ok and not self.registered:
                    logger.info("registered with the router at %s as %s", self.router, self.url)
                self.registered = ok
                self._stop.wait(REGISTER_INTERVAL_S if ok else 2.0)

    def leave_soon(self) -> threading.Thread:
        """Leaves on a thread of its own (once); the thread, to wait for."""
        if self._leaving is None:
            self._leaving = threading.Thread(target=self._leave, name="unregister", daemon=True)
            self._leaving.start()
        return self._leaving

    def _leave(self) -> None:
        """Stops registering and asks the router to drain this worker."""
        self._stop.set()
        if self._thread.ident is None:  # never started: the router never heard of it
            return
        try:
            httpx.delete(f"{self.router}/workers/{self.worker_id}", headers=self.headers,
                         timeout=2.0)  # fmt: skip
        except httpx.HTTPError as exc:
            logger.warning("could not tell the router this worker leaves (%r)", exc)
