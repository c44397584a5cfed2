"""Send a burst of chat requests from a child process, all at once.

A burst sent from the test process itself (threads or an event loop) can reach the server spread
out when that process is busy, and then nothing queues in the engine. A short-lived child with
its own interpreter and one event loop sends every request within a few milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

_CHILD = r"""
import asyncio, json, sys
import openai

job = json.loads(sys.stdin.read())

async def main():
    client = openai.AsyncOpenAI(base_url=job["base_url"], api_key="unused", timeout=job["timeout_s"], max_retries=0)
    try:
        replies = await asyncio.gather(*(
            client.chat.completions.create(model=job["model"], messages=[{"role": "user", "content": text}],
                                           max_tokens=job["max_tokens"], temperature=1.0,
                                           extra_body={"ignore_eos": True})
            for text in job["texts"]))
    finally:
        await client.close()
    print(json.dumps([[r.id, r.usage.completion_tokens if r.usage else None] for r in replies]))

asyncio.run(main())
"""


def send_burst_replies(base_url: str, model: str, texts: list[str], max_tokens: int,
                       timeout_s: float = 180.0) -> list[tuple[str, int | None]]:
    """(response id, completion tokens) per request, in the order of ``texts`` (every request ignores EOS)."""
    job: dict[str, Any] = {"base_url": base_url, "model": model, "texts": texts, "max_tokens": max_tokens,
                           "timeout_s": timeout_s}
    done = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(job), capture_output=True, text=True,
                          timeout=timeout_s + 60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    replies = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(replies, list) and len(replies) == len(texts)
    return [(str(rid), tokens) for rid, tokens in replies]


def send_burst(base_url: str, model: str, texts: list[str], max_tokens: int, timeout_s: float = 180.0) -> list[str]:
    """The response ids, in the order of ``texts``."""
    return [rid for rid, _ in send_burst_replies(base_url, model, texts, max_tokens, timeout_s)]
