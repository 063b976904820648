"""Request-reply stream: control messages between the master and the model
workers (docs/design.md §4).

`protocol` holds the messages and the socket plumbing both ends share,
`request_client` the master's end (`NameResolvingRequestClient`, driven
from its asyncio loop), `reply_server` a model worker's
(`NameResolvingReplyServer`).

Sockets. The master (`NameResolvingRequestClient`) binds one ROUTER socket
per model worker (`master_send_{i}`) and one PULL socket for all replies
(`master_recv`), and registers their addresses under
`names.request_reply_stream(exp, trial, ...)`. Each worker
(`NameResolvingReplyServer`) connects a DEALER with a random routing id to its
`master_send_{i}` and a PUSH to `master_recv`, then adds `<i>:<routing id>`
to the `barrier` subtree; the master waits until every worker is there and
sends each request to that routing id only (ROUTER_MANDATORY: never dropped,
never to another peer). A stray connection to a request socket therefore
takes no request: a PULL is refused at the ZMTP handshake (PULL cannot talk
to ROUTER), a DEALER is never addressed. Messages are `realrl.base.wire` buffers of
a `Payload` (never pickle) with one of four kinds:

    master -> worker: "request", "ack", "cancel"      worker -> master: "syn", "received", "reply"

Routing. A request names a handler: a worker index, a model-shard id string
or `"__data{dp}__"` (the head of data-parallel rank dp); the master's
`handler_routing` maps each handler to a worker index.

SYN/ACK. By default (`no_syn=True`) a worker runs a request as soon as it
arrives. With `no_syn=False` the worker answers "syn" on receipt and holds
the request; the master waits for the syn of every target worker and then
sends each an "ack", on which the worker runs it. A collective operation
(e.g. a train step with an all-reduce) therefore starts only once every
worker has the request. If a syn is missing when the timeout expires, the
master sends "cancel" to the workers that did answer, and nothing runs.

Threads on the worker side. Only the thread that calls `serve()` touches
the worker's sockets; cheap handlers run inline there, long ones one at a
time on a background thread (`reply_server`).

A handler's exception becomes an error reply (type, message, traceback); the
master raises it as `RemoteError`. Malformed messages are dropped, counted in
`n_rejected` and logged; both ends keep running. Every wait has a timeout.

Seals. In a process holding the trial's keys (docs/design.md §14) every
message is two frames, the wire buffer and its HMAC-SHA256 under the control
key of its direction (`protocol.control_seals`); a message without a valid
seal is ignored before it is decoded and counted in `n_forged`.

Lost requests. A worker confirms every request it takes: a cheap one by its
reply, a long one by "received" as it queues it (a SYN/ACK one by its syn).
A request that nobody confirms (its worker died or stalled) is warned about after `warn_after`
seconds, naming the worker and the request, and fails the call after
`receipt_timeout`; a confirmed one may run up to the call's own timeout (a
train step of a large model takes minutes), with a warning every
`RUNNING_WARN_INTERVAL` seconds.
"""
