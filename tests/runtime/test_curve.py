"""CurveZMQ (`cluster.auth = "curve"`): one keypair per job handed over by the environment; a
peer without the key gets no reply and the actor serves it nothing."""

import asyncio

import pytest
import zmq
import zmq.asyncio

from miles.runtime import Actor, ActorDied, Registry, Runtime
from miles.wire import auth
from miles.wire.codec import encode
from miles.wire.messages import GetMetrics, Ping, Pong


def test_job_keys_come_from_the_environment_or_are_made_fresh():
    assert auth.job_keys("none") is None
    fresh = auth.job_keys("curve", env={})
    assert len(fresh.public) == 40 and zmq.curve_public(fresh.secret) == fresh.public
    assert auth.job_keys("curve", env=fresh.env()) == fresh
    assert auth.job_keys("curve", env={}) != fresh
    with pytest.raises(ValueError, match=r"cluster.auth = 'tls': expected 'none' or 'curve'"):
        auth.job_keys("tls")
    with pytest.raises(ValueError, match="MILES_CURVE_SECRET is not set"):
        auth.keys_from_env({"MILES_CURVE_PUBLIC": fresh.public.decode()})
    other = auth.job_keys("curve", env={})
    with pytest.raises(ValueError, match="does not belong"):
        auth.keys_from_env({"MILES_CURVE_PUBLIC": fresh.public.decode(),
                            "MILES_CURVE_SECRET": other.secret.decode()})


def test_child_env_gets_the_keys_or_none_at_all():
    keys = auth.job_keys("curve", env={})
    env = {"PATH": "/bin"}
    auth.set_child_env(env, keys)
    assert auth.keys_from_env(env) == keys
    auth.set_child_env(env, None)  # auth off: stale keys from the launcher are not passed on
    assert env == {"PATH": "/bin"}


async def _no_reply(sock, endpoint):
    sock.connect(endpoint)
    await sock.send_multipart([bytes(f) for f in encode("call", Ping(payload=b"x"), 1)])
    return await sock.poll(1000) == 0


async def test_curve_calls_work_with_the_key_and_get_nothing_without_it():
    keys = auth.job_keys("curve", env={})
    rt = Runtime(curve=keys)
    registry = Registry()
    rt.registry_endpoint = await registry.start(rt, register=False)
    actor = Actor("guarded")
    await actor.start(rt)
    client = Runtime(registry=rt.registry_endpoint, curve=keys)
    stranger = Runtime(registry=rt.registry_endpoint, curve=None)
    try:
        pong = await client.ref("guarded").call(Ping(payload=b"ok"), timeout_s=10)
        assert isinstance(pong, Pong) and pong.payload == b"ok"
        served = actor.counters["calls"]
        ctx = zmq.asyncio.Context.instance()
        plain = ctx.socket(zmq.DEALER)
        assert await _no_reply(plain, actor.server.endpoint)
        impostor = ctx.socket(zmq.DEALER)  # knows the server's public key, not the job's secret
        pub, sec = zmq.curve_keypair()
        impostor.curve_publickey, impostor.curve_secretkey = pub, sec
        impostor.curve_serverkey = keys.public
        assert await _no_reply(impostor, actor.server.endpoint)
        with pytest.raises(ActorDied, match="handshake .* failed: .*cluster.auth = 'curve', the two ends do not hold"):
            await stranger.ref_at(actor.server.endpoint).call(Ping(), timeout_s=10)
        assert actor.counters["calls"] == served and actor.server.bad_frames == 0
        metrics = (await client.ref("guarded").call(GetMetrics())).values
        assert metrics["refused_handshakes"] >= 3
        assert isinstance(await client.ref("guarded").call(Ping()), Pong)
        plain.close(0)
        impostor.close(0)
    finally:
        stranger.close()
        client.close()
        await actor.close()
        await registry.close()
        rt.close()


CURVE_JOB = '''
[run]
output_dir = "@OUT@"
[cluster]
head_port = @PORT@
auth = "curve"
[actors.driver]
class = "supervision_actors:Waiter"
main = true
[actors.sink]
class = "miles.demo:Sink"
'''


async def test_a_curve_job_hands_the_exported_key_to_children_by_environment(node_launcher):
    import psutil

    from miles.wire.messages import ListActors, Shutdown

    keys = auth.job_keys("curve", env={})
    (daemon,), port, logs = node_launcher(CURVE_JOB, extra_env=keys.env())
    client = Runtime(registry=f"tcp://127.0.0.1:{port}", curve=keys)
    stranger = Runtime(registry=f"tcp://127.0.0.1:{port}", curve=None)
    try:
        info = await client.lookup("sink", wait_s=60)
        assert isinstance(await client.ref("sink").call(Ping(), timeout_s=10), Pong)
        child = psutil.Process(info.pid)
        assert child.environ()["MILES_CURVE_SECRET"] == keys.secret.decode()
        assert not any(keys.secret.decode() in arg for arg in child.cmdline())
        with pytest.raises(ActorDied, match="handshake"):
            await stranger.registry.call(ListActors(), timeout_s=10)
        await client.ref("node/0").call(Shutdown(reason="done"), timeout_s=10)
        assert await asyncio.to_thread(daemon.wait, 30) == 0
    finally:
        stranger.close()
        client.close()


async def test_a_curve_job_without_an_exported_key_makes_one_for_its_children(node_launcher):
    import time

    from miles.wire.messages import ListActors

    (daemon,), port, logs = node_launcher(CURVE_JOB)
    deadline = time.monotonic() + 60
    while "[driver] waiting" not in logs[0].read_text():  # registered, over CURVE, with the key
        assert time.monotonic() < deadline and daemon.poll() is None, logs[0].read_text()
        await asyncio.sleep(0.1)
    stranger = Runtime(registry=f"tcp://127.0.0.1:{port}", curve=None)
    try:
        with pytest.raises(ActorDied, match="handshake"):
            await stranger.registry.call(ListActors(), timeout_s=10)
    finally:
        stranger.close()


def test_a_multi_node_curve_job_without_an_exported_key_is_refused(monkeypatch):
    from miles.config import RecipeError, load_recipe
    from miles.recipe_checks import check_placement

    monkeypatch.delenv("MILES_CURVE_PUBLIC", raising=False)
    monkeypatch.delenv("MILES_CURVE_SECRET", raising=False)
    recipe = load_recipe(text='[cluster]\nauth = "curve"\n')
    check_placement(recipe, 1)  # one node makes its own key
    import pytest
    with pytest.raises(RecipeError, match=r"cluster.auth = 'curve'.*2 nodes.*miles.wire.auth"):
        check_placement(recipe, 2)
