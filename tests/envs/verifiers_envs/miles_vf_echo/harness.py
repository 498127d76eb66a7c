import openai
import verifiers.v1 as vf


class EchoHarnessConfig(vf.HarnessConfig):
    pass


class EchoHarness(vf.Harness[EchoHarnessConfig]):
    """The chat loop run in the environment's process: `data.turns` model calls, the user's
    second message asks again. Verifiers allows this (`Harness.launch`): a harness may run its
    loop in-process as long as every model call goes through `endpoint` with `secret`."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        messages = [{"role": "user", "content": data.prompt}]
        try:
            for turn in range(data.turns):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
                if turn + 1 < data.turns:
                    messages.append({"role": "user", "content": f"Again: say {data.word}."})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
