"""The HTTP front door's connection limits: how uvicorn serves the gateway's app.

uvicorn (0.54, h11) bounds a connection only while it idles between requests (`timeout_keep_alive`) and the size
of a request's head (`h11_max_incomplete_event_size`); a connection that sends its headers one byte at a time, or
stops in the middle of its body, is held for ever, and its `limit_concurrency` counts at request time and answers
a plain-text 503, leaving every idle connection open. So the gateway serves HTTP/1.1 through `GuardedH11Protocol`,
uvicorn's h11 protocol with:

* a connection limit (`--http-max-connections`): a connection past it is answered 503 with the error object
  (retryable, `Retry-After`) and closed at once;
* a header read timeout (`--http-header-timeout-s`): a request's head must be complete within that many seconds of
  the connection opening (or of the first byte of a keep-alive connection's next request), else 408 and closed;
* a body read timeout (`--http-body-timeout-s`): while a request's body arrives, the client must send some of it
  every that many seconds, else the connection is closed (the handler sees the client gone). The clock stops while
  the server itself holds reading back (a handler not reading yet);
* keep-alive idle connections closed after `timeout_keep_alive` (5 s, uvicorn's default) as before.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from h3serve.config.stage import StageConfig

log = logging.getLogger("h3serve.gateway")

MAX_HEAD_BYTES = 64 << 10     # a request line and headers (h11's bound on an incomplete event)
KEEP_ALIVE_S = 5


def _answer(status: int, reason: str, code: str, message: str, retry_after: int | None = None) -> bytes:
    body = json.dumps({"error": {"type": "server_error" if status >= 500 else "invalid_request_error",
                                 "code": code, "message": message, "field": None, "param": None, "stage": None,
                                 "retryable": True}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"] + ([f"retry-after: {retry_after}"] if retry_after else [])
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection limit and header / body read timeouts (the module doc)."""

    max_connections = 1024
    header_timeout_s = 10.0
    body_timeout_s = 30.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    @classmethod
    def configured(cls, config: StageConfig) -> type["GuardedH11Protocol"]:
        return type("GuardedH11Protocol", (cls,), {"max_connections": config.gateway.http_max_connections,
                                                    "header_timeout_s": config.gateway.http_header_timeout_s,
                                                    "body_timeout_s": config.gateway.http_body_timeout_s})

    # -- the connection limit ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("HTTP connection from %s refused: %d open (--http-max-connections %d)",
                        self.client[0] if self.client else "?", len(self.connections) - 1, self.max_connections)
            self._refuse(_answer(503, "Service Unavailable", "stage_unavailable",
                                 f"the gateway holds {self.max_connections} HTTP connections "
                                 "(--http-max-connections); retry later", retry_after=1))
            return
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        self._cancel_body()
        super().connection_lost(exc)

    def _refuse(self, answer: bytes) -> None:
        self._cancel_head()
        self._cancel_body()
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()

    # -- header and body read timeouts ------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def _watch(self) -> None:
        """Arm or disarm the timers for what the connection waits for now."""
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.our_state is h11.IDLE and self.timeout_keep_alive_task is None:
            self._arm_head()    # (the rest of) a request's head: its clock runs from the first byte, not reset
        else:
            self._cancel_head()
        if state is h11.SEND_BODY:
            self._cancel_body()  # some of the body came: the idle clock starts again
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out)
        else:
            self._cancel_body()

    def _arm_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is not h11.IDLE or self.conn.our_state is not h11.IDLE:
            return
        self._refuse(_answer(408, "Request Timeout", "request_timeout",
                             f"the request's headers did not arrive within {self.header_timeout_s:g}s "
                             "(--http-header-timeout-s)"))

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        if self.flow is not None and self.flow.read_paused:   # the server holds reading back, not the client
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out)
            return
        log.info("HTTP request from %s: no body bytes for %gs (--http-body-timeout-s): connection closed",
                 self.client[0] if self.client else "?", self.body_timeout_s)
        self.transport.close()


def uvicorn_config(app, config: StageConfig, *, ssl_certfile: str | None = None,
                   ssl_keyfile: str | None = None) -> uvicorn.Config:
    """How the gateway's HTTP API is served: h11 through GuardedH11Protocol, the limits of `config`."""
    return uvicorn.Config(app, host=config.gateway.http_host, port=config.gateway.http_port, log_level="warning", lifespan="off",
                          access_log=False, timeout_graceful_shutdown=5, ssl_certfile=ssl_certfile,
                          ssl_keyfile=ssl_keyfile, http=GuardedH11Protocol.configured(config),
                          timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEAD_BYTES)
