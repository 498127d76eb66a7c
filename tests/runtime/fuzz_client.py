"""A foreign process that throws malformed frames at actor endpoints with raw ZeroMQ sockets.

Usage: python fuzz_client.py ENDPOINT [ENDPOINT ...] > report.json
Prints {endpoint: {"sent": n, "expect_reply": [ids], "replies": {id: message}}}: the frames sent,
the call ids whose header was readable (an error reply is owed), and the error replies that came.
"""

import json
import random
import sys
import time

import msgspec
import zmq

ROUNDS = 40
BIG_FRAME_BYTES = 100 * 1024 * 1024


def header(v=1, kind="call", id=0, n_arrays=0, sender="fuzzer"):
    return msgspec.msgpack.encode([v, kind, id, sender, n_arrays])


def malformed(rng: random.Random, next_id):
    """(frames, call id owed an error reply or None), one of each kind of damage."""
    ping = msgspec.msgpack.encode({"type": "Ping"})
    i = next_id()
    yield [rng.randbytes(rng.randrange(1, 64))], None                         # random bytes
    yield [rng.randbytes(8), rng.randbytes(rng.randrange(0, 200)), rng.randbytes(4)], None
    yield [header(id=i), ping[: rng.randrange(1, len(ping))]], i              # truncated msgpack
    i = next_id()
    yield [header(id=i), msgspec.msgpack.encode({"type": "NoSuchMessage"})], i  # wrong tag
    i = next_id()
    yield [header(id=i), msgspec.msgpack.encode({"type": "X" * 4000})], i     # a huge tag
    i = next_id()
    yield [header(id=i, n_arrays=2), ping], i                                 # wrong part count
    i = next_id()
    yield [header(id=i), ping, b"stray", b"frames"], i
    i = next_id()
    yield [header(v=99, id=i), ping], i                                       # wrong version
    i = next_id()
    yield [header(id=i, n_arrays=2**40), ping], i                             # huge array count
    i = next_id()
    # msgpack that declares a 4-billion-element array but holds none
    yield [header(id=i), b"\xdd\xff\xff\xff\xff"], i
    i = next_id()
    ext = msgspec.msgpack.Ext(1, msgspec.msgpack.encode((0, "<i4", [2**31, 2**31])))
    yield [header(id=i, n_arrays=1), msgspec.msgpack.encode(
        {"type": "Sample", "tokens": ext, "response_length": 0}), b"\x00" * 8], i  # huge shape
    i = next_id()
    yield [header(kind="bogus", id=i), ping], i                               # unknown kind
    yield [msgspec.msgpack.encode([1]), ping], None                           # no kind, no id
    yield [header(kind="tell"), msgspec.msgpack.encode({"type": "Ping", "x": 1})], None


def main() -> None:
    rng = random.Random(1)
    ctx = zmq.Context()
    ids = iter(range(1, 10**9))
    big = rng.randbytes(1024) * (BIG_FRAME_BYTES // 1024)
    report = {}
    socks = {}
    for ep in sys.argv[1:]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ep)
        socks[ep] = sock
        sent, owed = 0, []
        for _ in range(ROUNDS):
            for frames, owed_id in malformed(rng, lambda: next(ids)):
                sock.send_multipart(frames)
                sent += 1
                if owed_id is not None:
                    owed.append(owed_id)
        i = next(ids)
        sock.send_multipart([header(id=i), big])                               # a 100 MB frame
        sent += 1
        owed.append(i)
        report[ep] = {"sent": sent, "expect_reply": owed, "replies": {}}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
            len(r["replies"]) < len(r["expect_reply"]) for r in report.values()):
        for ep, sock in socks.items():
            while sock.poll(10):
                frames = sock.recv_multipart()
                h = msgspec.msgpack.decode(frames[0])
                body = msgspec.msgpack.decode(frames[1])
                if h[1] == "error":
                    report[ep]["replies"][h[2]] = body.get("message", "")
    for sock in socks.values():
        sock.close(0)
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
