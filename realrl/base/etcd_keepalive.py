"""One lease keep-alive stream per etcd client (name_resolve's `keepalive_ttl`).

pyetcd's `refresh_lease` opens a new gRPC stream for every refresh; each
costs etcd a stream set up and torn down, and the client as much again.
`LeaseKeepAliveStream` keeps one LeaseKeepAlive stream open and writes every
refresh of its repository's leases to it: a request goes in, the refreshing
thread reads its answer back. A timer cancels the stream when no answer came
within the timeout; a stream that fails, ends or was cancelled so makes the
refresh raise (the keep-alive loop counts a miss, as it did for a failed
refresh), and the next refresh opens a new stream. (No thread sits reading
the stream between refreshes: grpc's blocking read wakes ten times a second.)
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
        self._call = None
        self._expired = None  # the call a timer cancelled

    def refresh(self, lease_id: int, timeout: float) -> int:
        """Refreshes the lease; returns its TTL in seconds (<= 0: the lease is
        gone: expired or revoked). Raises TimeoutError when no answer came
        within `timeout` s, ConnectionError when the stream failed or ended."""
        from pyetcd.etcdrpc import LeaseKeepAliveRequest

        with self._lock:
            if self._call is None:
                self._open()
            call = self._call
            timer = threading.Timer(timeout, self._expire, args=(call,))
            timer.daemon = True
            timer.start()
            try:
                self._requests.put(LeaseKeepAliveRequest(ID=lease_id))
                answer = next(call)
            except StopIteration:
                self._reset()
                raise ConnectionError("etcd lease keep-alive stream ended") from None
            except Exception as e:  # grpc.RpcError: cancelled by the timer, etcd gone
                self._reset()
                if self._expired is call:
                    raise TimeoutError(f"etcd lease keep-alive: no answer within {timeout:g}s") from None
                raise ConnectionError(f"etcd lease keep-alive stream failed: {e}") from None
            finally:
                timer.cancel()
            if self._expired is call:  # (the timer fired as the answer came: the stream is cancelled)
                self._reset()
            if answer.ID != lease_id:  # (one request at a time on the stream: not expected)
                self._reset()
                raise ConnectionError(f"etcd lease keep-alive: answer for lease {answer.ID}, asked {lease_id}")
            return answer.TTL

    def close(self) -> None:
        with self._lock:
            self._reset()

    def _open(self) -> None:
        requests: queue.SimpleQueue = queue.SimpleQueue()

        def outgoing():
            while (request := requests.get()) is not None:
                yield request

        self._call = self._client.leasestub.LeaseKeepAlive(outgoing(), metadata=self._client.metadata)
        self._requests = requests

    def _expire(self, call) -> None:
        self._expired = call
        call.cancel()

    def _reset(self) -> None:
        call, requests = self._call, self._requests
        self._call = self._requests = None
        if requests is not None:
            requests.put(None)  # ends the request iterator
        if call is not None:
            call.cancel()
