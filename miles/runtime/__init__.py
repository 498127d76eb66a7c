"""The actor runtime: typed async handlers behind a ZeroMQ inbox (`actor.py`), refs to call them
and streams (`refs.py`), the registry (`registry.py`) and the process that hosts one actor
(`host.py`). It knows nothing of RL: the RL actors (`miles/actors/`) and the node daemon
(`miles/node/`) are built on it.

Design decisions:
- A handler is any method whose single parameter is annotated with a `Message` subclass; the
  return annotation is the reply type. No decorators, no string dispatch: the type of the
  incoming message picks the handler, and a user's subclass adds handlers by writing methods.
  A plain `def` handler runs inline as the frame is read (cheapest: no task); an `async def` one
  gets a task of its own and may await.
- Handlers of one actor run concurrently on its event loop (an RL buffer's `get` must be able to
  wait while a `put` arrives). State is safe between awaits because the loop is single-threaded.
- `ActorRef.call(msg, timeout_s)` never hangs: it ends with the reply, a `RemoteError` (the
  handler raised), `ActorTimeout`, or `ActorDied` as soon as the connection drops. With
  `retries > 0` a call whose actor died is re-sent to the restarted incarnation (for idempotent
  messages only: the caller decides).
- A ref caches its actor's connection, so a call costs no registry round trip. When that
  connection has dropped, the next call asks the registry once: the same incarnation still alive
  means a transient drop (reconnect); anything else means the incarnation is gone, and the call
  fails at once with `ActorDied` (or, with `retries > 0`, waits for the next incarnation) instead
  of waiting out its timeout on a dead endpoint. A fresh connection whose first connect is
  refused fails the same way.
- Cancellation crosses the wire: a caller that times out or is cancelled sends a `cancel` frame,
  and the actor cancels that call's handler task; when a caller's connection is gone (probed with
  `Server.peer_alive` on every disconnect and every `peer_check_interval_s`), its calls and streams
  are cancelled too. Handlers see `asyncio.CancelledError`, so `finally` blocks clean up (an
  abandoned `Reserve` gives its slot back). Tells are not cancelled: nobody waits on them, and a
  sender may well exit right after one. Plain `def` handlers run to the end.
- Streams are bounded: at most `max_streams_per_caller` open per caller; the next `stream_open`
  gets an error reply naming the limit.
- Streams carry bulk data with credit-based flow control: the receiver grants `window` credits
  and returns one per item its handler has consumed; the sender waits when it has none. Memory on
  both sides is bounded and nothing is dropped.
- The registry is itself an actor (on the head node). Every actor registers its endpoint with an
  incarnation number and sends heartbeats; `Lookup(wait_s=...)` is the wait-for primitive.
- Event-loop lag is sampled continuously (how late a 50 ms timer fires) and exported in
  `Metrics` with call counts and refused-frame counts. Once the actor has started (set-up in
  `on_start` may block), a watchdog thread logs a warning when the loop has not ticked for
  `lag_warn_s`, while it is still stuck: the actor's name, the handlers in flight (message type,
  seconds running) and where the loop thread is. The registry warns when an actor's heartbeats
  stop (name, incarnation, seconds since the last one), and reports an actor `disconnected` (so
  lookups skip it) as soon as the connection it registered and heart-beats on is gone; `alive`
  stays the heartbeat verdict, which is what the node daemon's liveness watcher acts on.
- With CurveZMQ keys in the environment (`miles.wire.auth`) the runtime runs a ZAP handler and
  every inbox and connection is authenticated and encrypted.
"""


from miles.runtime.actor import Actor
from miles.runtime.refs import (ActorDied, ActorError, ActorRef, ActorTimeout, RemoteError, Runtime,
                                run_event_loop)
from miles.runtime.registry import Registry

__all__ = ["Actor", "ActorRef", "Runtime", "Registry", "ActorError", "ActorTimeout", "ActorDied",
           "RemoteError", "run_event_loop"]
