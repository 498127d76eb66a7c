"""The codec: arrays as raw frames, strict decoding with errors naming type and field."""

import msgspec
import numpy as np
import pytest

from miles.wire.codec import VersionMismatch, WireError, decode, encode
from miles.wire.messages import Header, Message, Ping, Sample, SampleBatch, VersionSpan


def _sample(n=6, resp=3):
    return Sample(tokens=np.arange(n, dtype=np.int32), response_length=resp,
                  loss_mask=np.ones(resp, np.uint8), rollout_logprobs=np.full(resp, -0.5, np.float32),
                  weight_versions=[VersionSpan(1, 0, resp)], reward={"acc": 1.0}, status="completed",
                  routed_experts=np.zeros((n - 1, 2, 2), np.int32), group_id="g", rollout_id="r",
                  metadata={"k": [1, 2]})


def test_arrays_travel_as_raw_frames_not_msgpack_lists():
    s = _sample(1000, 10)
    frames = encode("call", s)
    # header, body, then one frame per array: tokens, loss_mask, logprobs, routed_experts
    assert len(frames) == 6
    assert len(frames[1]) < 400  # the body holds no token data
    assert bytes(frames[2]) == s.tokens.tobytes()
    header, back = decode([bytes(f) for f in frames])
    assert header.kind == "call" and header.n_arrays == 4
    assert np.array_equal(back.tokens, s.tokens) and back.tokens.dtype == np.int32
    assert back.routed_experts.shape == (999, 2, 2)
    assert back.reward == {"acc": 1.0} and back.weight_versions == [VersionSpan(1, 0, 10)]


def test_decode_is_zero_copy():
    s = _sample(4096, 100)
    frames = encode("call", s)
    raw = [bytearray(f) if i == 2 else bytes(f) for i, f in enumerate(frames)]
    _, back = decode(raw)
    raw[2][0] = 0x7F  # mutate the received frame: the decoded array is a view of it
    assert back.tokens[0] == 0x7F


@pytest.mark.parametrize("body, msg_type, field", [
    ({"type": "Sample", "tokens": "abc"}, "Sample", "$.tokens"),
    ({"type": "Ping", "payload": 3}, "Ping", "$.payload"),
    ({"type": "Ping", "bogus": 1}, "Ping", ""),
    ({"type": "NoSuchMessage"}, "NoSuchMessage", "$.type"),
    ({"type": "Sample", "tokens": None, "response_length": "x"}, "Sample", ""),
])
def test_bad_bodies_name_the_type_and_field(body, msg_type, field):
    header = msgspec.msgpack.encode(Header(1, "call", 7, "fuzzer", 0))
    with pytest.raises(WireError) as err:
        decode([header, msgspec.msgpack.encode(body)])
    assert err.value.msg_type == msg_type
    if field:
        assert err.value.field == field
        assert field in str(err.value)


def test_truncated_and_mismatched_frames_are_refused():
    frames = [bytes(f) for f in encode("call", _sample())]
    with pytest.raises(WireError, match="array frames"):
        decode(frames[:-1])
    with pytest.raises(WireError, match="bytes, expected"):
        decode([*frames[:2], frames[2][:-4], *frames[3:]])
    with pytest.raises(WireError):
        decode([frames[0], frames[1][:-3], *frames[2:]])
    with pytest.raises(WireError, match="at least 2 frames"):
        decode(frames[:1])


def test_protocol_version_mismatch_is_a_clear_error():
    header = msgspec.msgpack.encode(Header(99, "call", 1, "old-node", 0))
    with pytest.raises(VersionMismatch, match="v99.*v1"):
        decode([header, encode("call", Ping())[1]])


def test_object_arrays_cannot_be_sent():
    with pytest.raises(TypeError):
        encode("call", Sample(tokens=np.array([object()]), response_length=0))


def test_user_messages_register_and_duplicates_are_refused():
    class UserThing(Message):
        x: int

    _, back = decode(encode("tell", UserThing(x=3)))
    assert back == UserThing(x=3)
    with pytest.raises(TypeError, match="already used"):
        type("Ping", (Message,), {"__module__": "elsewhere"})


def test_sample_validate_names_the_field():
    s = _sample()
    s.validate()
    s.loss_mask = np.ones(2, np.uint8)
    with pytest.raises(ValueError, match="loss_mask"):
        s.validate()
    batch = SampleBatch(samples=[_sample()])
    assert decode(encode("call", batch))[1].samples[0].group_id == "g"


@pytest.mark.parametrize("body, expected", [
    (b"\x81\xc1", "bad frame (body (not one msgpack value), a key in $): Expected `str`, got a byte"),
    (msgspec.msgpack.encode({1: 2}), "bad frame (body (a map without a 'type' tag), a key in $)"),
    (msgspec.msgpack.encode({"type": ""}), "bad frame (type '', field $.type): Invalid value ''"),
    (msgspec.msgpack.encode([1, 2]), "bad frame (body (a msgpack array, not a message map))"),
    (msgspec.msgpack.encode({"type": "Ping", 3: 4}), "bad frame (Ping, a key in $)"),
])
def test_error_messages_read_as_sentences(body, expected):
    header = msgspec.msgpack.encode(Header(1, "call", 7, "fuzzer", 0))
    with pytest.raises(WireError) as err:
        decode([header, body])
    assert str(err.value).startswith(expected), str(err.value)
    assert "` in `" not in str(err.value) and "<" not in str(err.value)


def test_echoed_junk_is_clipped():
    header = msgspec.msgpack.encode(Header(1, "call", 7, "s" * 5000, 0))
    with pytest.raises(WireError) as err:
        decode([header, msgspec.msgpack.encode({"type": "J" * 4000})])
    assert err.value.msg_type == "J" * 100 + "..." and len(str(err.value)) < 300
    with pytest.raises(VersionMismatch) as err:
        decode([msgspec.msgpack.encode(Header(2, "call", 7, "s" * 5000, 0)), b"\x80"])
    assert "s" * 100 + "..." in str(err.value) and len(str(err.value)) < 300


def test_peek_header_reads_any_version_and_frame_count_and_refuses_unknown_kinds():
    from miles.wire.codec import _default
    raw = msgspec.msgpack.encode(Header(9, "call", 42, "new-node", 3))
    assert _default.peek_header([raw]) == Header(9, "call", 42, "new-node", 0)
    assert _default.peek_header([b"\xc1"]) is None
    assert _default.peek_header([msgspec.msgpack.encode(Header(1, "tell", 0))]) is None  # no id
    with pytest.raises(WireError, match="unknown kind 'gossip'"):
        decode([msgspec.msgpack.encode(Header(1, "gossip", 1)), encode("call", Ping())[1]])
