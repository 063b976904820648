"""One lease keep-alive stream per etcd client (name_resolve's `keepalive_ttl`).

pyetcd's `refresh_lease` opens a new gRPC stream for every refresh; each
costs etcd a stream set up and torn down, and the client as much again.
`LeaseKeepAliveStream` keeps one LeaseKeepAlive stream open and writes every
refresh of its repository's leases to it: a request goes in, its answer is
read back within a timeout. A stream that fails, ends or does not answer in
time is cancelled and the refresh raises (the keep-alive loop counts a miss,
as it did for a failed refresh); the next refresh opens a new stream.
"""

from __future__ import annotations

import queue
import threading


class LeaseKeepAliveStream:
    """Refreshes etcd leases over one stream (thread-safe, one refresh at a time)."""

    def __init__(self, client) -> None:
        self._client = client  # a pyetcd client: its lease stub and call metadata (the auth token)
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue | None = None
        self._answers: queue.SimpleQueue | None = None
        self._call = None

    def refresh(self, lease_id: int, timeout: float) -> int:
        """Refreshes the lease; returns its TTL in seconds (<= 0: the lease is
        gone: expired or revoked). Raises TimeoutError when no answer came
        within `timeout` s, ConnectionError when the stream ended."""
        from pyetcd.etcdrpc import LeaseKeepAliveRequest

        with self._lock:
            if self._call is None:
                self._open()
            self._requests.put(LeaseKeepAliveRequest(ID=lease_id))
            try:
                answer = self._answers.get(timeout=timeout)
            except queue.Empty:
                self._reset()
                raise TimeoutError(f"etcd lease keep-alive: no answer within {timeout:g}s") from None
            if answer is None or isinstance(answer, BaseException):
                self._reset()
                raise ConnectionError(f"etcd lease keep-alive stream ended: {answer or 'closed'}")
            if answer.ID != lease_id:  # (one request at a time on a fresh stream: not expected)
                self._reset()
                raise ConnectionError(f"etcd lease keep-alive: answer for lease {answer.ID}, asked {lease_id}")
            return answer.TTL

    def close(self) -> None:
        with self._lock:
            self._reset()

    def _open(self) -> None:
        requests: queue.SimpleQueue = queue.SimpleQueue()
        answers: queue.SimpleQueue = queue.SimpleQueue()

        def outgoing():
            while (request := requests.get()) is not None:
                yield request

        call = self._client.leasestub.LeaseKeepAlive(outgoing(), metadata=self._client.metadata)

        def incoming():
            try:
                for answer in call:
                    answers.put(answer)
                answers.put(None)
            except Exception as e:  # cancelled, etcd gone: the waiting refresh says so
                answers.put(e)

        threading.Thread(target=incoming, name="name_resolve-lease-stream", daemon=True).start()
        self._requests, self._answers, self._call = requests, answers, call

    def _reset(self) -> None:
        call, requests = self._call, self._requests
        self._call = self._requests = self._answers = None
        if requests is not None:
            requests.put(None)  # ends the request iterator
        if call is not None:
            call.cancel()
