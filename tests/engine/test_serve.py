"""As users run it: one ``vllm serve`` P and one ``vllm serve`` D with the arena connector,
a small proxy in front (``kvcopy.testing.engine.serve.Proxy``: prefill on P with
``do_remote_decode``, P's ``kv_transfer_params`` forwarded to D), driven by an HTTP client
over the OpenAI completions API, several requests at once. Every answer equals a single
engine's tokens, and D's usage reports the prompt as cached (loaded, not computed).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcopy.testing.engine.pd import kv_transfer_config, random_prompts, side_channel_env
from kvcopy.testing.engine.serve import Proxy, Server, complete, stream_first_token

NEW_TOKENS = 8
LENGTHS = [31, 64, 65, 300, 700]


@pytest.fixture(scope="module")
def proxy(engine_dir, model):
    path = model("llama")
    kv = kv_transfer_config("arena")
    p = Server("serve-P", path, os.path.join(engine_dir, "serve-P.log"), kv, env=side_channel_env())
    d = Server("serve-D", path, os.path.join(engine_dir, "serve-D.log"), kv, env=side_channel_env())
    try:
        p.start()
        d.start()
        p.wait_ready()
        d.wait_ready()
        px = Proxy(p.url, d.url)
        yield px
        px.close()
    finally:
        d.kill()
        p.kill()


def test_completions_through_the_proxy_equal_a_single_engine(proxy, single):
    prompts = random_prompts(LENGTHS, seed=31)
    want = [o["token_ids"] for o in single("llama").generate(prompts, NEW_TOKENS)]
    with ThreadPoolExecutor(len(prompts)) as pool:  # all in flight together
        got = list(pool.map(lambda p: complete(proxy.url, p, NEW_TOKENS), prompts))
    assert [g["token_ids"] for g in got] == want
    cached = [(g["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") for g in got]
    assert cached == LENGTHS, got


def test_a_streamed_completion_through_the_proxy(proxy, single):
    prompt = random_prompts([150], seed=32)[0]
    want = single("llama").generate([prompt], NEW_TOKENS)[0]["token_ids"]
    out = stream_first_token(proxy.url, prompt, NEW_TOKENS)
    assert out["token_ids"] == want
    assert out["ttft_s"] is not None and out["ttft_s"] <= out["total_s"]
