"""A user's own actor module, loaded by import path from a recipe (the plug-in contract test)."""

from miles.runtime import Actor
from miles.demo import Sink
from miles.wire.messages import Message


class Greet(Message):
    who: str


class Greeting(Message):
    text: str


class PoliteSink(Sink):
    """A user subclass of a built-in actor: adds a handler, keeps the stream behaviour."""

    async def on_greet(self, msg: Greet) -> Greeting:
        return Greeting(text=f"hello {msg.who} from {self.name}")


class GreetingDriver(Actor):
    async def run(self) -> int:
        reply = await self.runtime.ref("sink").call(Greet(who="driver"), timeout_s=30)
        print("GREETING:", reply.text, flush=True)
        return 0 if reply.text == "hello driver from sink" else 3
