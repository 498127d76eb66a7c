"""Regenerates the round-trip fixtures (run once; the .jsonl files are committed)."""
import json

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}}
SHELL = {"type": "function", "function": {"name": "shell", "description": "Run a shell command; returns stdout.",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


qwen = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]},
    {"tools": [ADD], "messages": [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 17 + 25?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should add.", "tool_calls": [call("add", a=17, b=25)]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "17 + 25 = 42.", "reasoning_content": "The tool said 42."},
        {"role": "user", "content": "And 1 + 1 and 2 + 2?"},
        {"role": "assistant", "content": "Calling both.", "reasoning_content": "",
         "tool_calls": [call("add", a=1, b=1), call("add", a=2, b=2)]},
        {"role": "tool", "content": "2"}, {"role": "tool", "content": "4"},
        {"role": "user", "content": "Be brief."},
        {"role": "assistant", "content": "2 and 4.", "reasoning_content": "Two results."}]},
    {"tools": [SHELL, ADD], "messages": [
        {"role": "user", "content": "列出文件 🙂, then count them."},
        {"role": "assistant", "content": "", "tool_calls": [call("shell", cmd="ls -la | head")]},
        {"role": "tool", "content": "total 8\ndrwxr-xr-x  2 u u 4096 .\n-rw-r--r--  1 u u  12 a.txt\n"},
        {"role": "assistant", "content": "<think>\nOne file.\n</think>\n\nThere is one file: `a.txt`.  "},
        {"role": "user", "content": "  spaces around  \n\n"},
        {"role": "assistant", "content": "\n\nNoted."}]},
    {"messages": [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "Sort 3 1 2"},
        {"role": "assistant", "content": "1 2 3", "reasoning_content": "\nsmallest first\n"},
        {"role": "user", "content": "Reverse it"},
        {"role": "assistant", "content": "3 2 1", "reasoning_content": "flip"},
        {"role": "system", "content": "Answer in French from now on."},
        {"role": "user", "content": "Merci"}]},
]

llama = [
    {"messages": [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+3?"},
                  {"role": "assistant", "content": "5"}]},
    {"tools": [ADD], "messages": [
        {"role": "user", "content": "What is 17 + 25?"},
        {"role": "assistant", "content": "", "tool_calls": [call("add", a=17, b=25)]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "17 + 25 = 42."},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [call("add", a=2, b=2)]},
        {"role": "tool", "content": "{\"result\": 4}"},
        {"role": "user", "content": "thanks"}]},
]

for name, rows in (("conversations_qwen3.jsonl", qwen), ("conversations_llama3.jsonl", llama)):
    with open(name, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
