"""Check a CPU engine environment built by ``bench/engine_env.sh``: run by it with the
environment's python, from the repository root (``VLLM_TARGET_DEVICE=cpu``).

Each step names what it found missing: vLLM 0.33 itself, the CPU platform, the CPU ops
(``torch.ops._C`` after the platform loaded them), NIXL's UCX backend, ``vllm serve``'s
API server, then one greedy
generation from a 2-layer random-weight Llama (``kvcopy.testing.engine.models``) whose
tokens must be as many as asked and inside the vocabulary.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time


def fail(what: str) -> None:
    print(f"engine_env_check: {what}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        fail("run with VLLM_TARGET_DEVICE=cpu")
    try:
        import vllm
    except ImportError as exc:
        fail(f"vllm does not import: {exc}")
    if not vllm.__version__.startswith("0.33."):
        fail(f"vllm is {vllm.__version__}, not 0.33")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        fail(f"vLLM's platform is {current_platform.device_name!r}, not the CPU")
    import torch

    current_platform.import_kernels()
    # The CPU ops register under torch.ops._C; the CPU attention backend calls these.
    for op in ("cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache"):
        if not hasattr(torch.ops._C, op):
            fail(f"torch.ops._C.{op} is missing: vLLM's CPU ops did not load")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        fail(f"nixl._api does not import: {exc}")
    agent = nixl_agent("engine-env-check", nixl_agent_config(backends=["UCX"]))
    if "UCX" not in agent.get_plugin_list():
        fail("NIXL has no UCX plugin")

    try:  # what `vllm serve` imports beyond the engine
        import vllm.entrypoints.openai.api_server  # noqa: F401
    except ImportError as exc:
        fail(f"vllm serve's API server does not import: {exc}")

    from kvcopy.testing.engine.models import build_model
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as tmp:
        spec = build_model("llama", tmp, seed=0)
        t0 = time.monotonic()
        llm = LLM(model=tmp, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                  block_size=32, enforce_eager=True, seed=0)
        out = llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 40)))],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        tokens = list(out[0].outputs[0].token_ids)
        elapsed = time.monotonic() - t0
    if len(tokens) != 8 or not all(0 <= t < spec.vocab_size for t in tokens):
        fail(f"the tiny engine generated {tokens!r}, wanted 8 tokens below {spec.vocab_size}")
    print(f"engine_env_check: vllm {vllm.__version__}, torch {torch.__version__}, CPU ops and NIXL UCX load; "
          f"a 2-layer engine started and generated {tokens} in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
