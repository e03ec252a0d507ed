"""One vLLM engine (``vllm.LLM``) in its own process, driven over a pipe.

    python -m kvcopy.testing.engine.driver CONFIG_JSON REPLY_FD

Started by :class:`kvcopy.testing.engine.process.Engine`. Commands come as JSON lines on
stdin, one reply per command as a JSON line on ``REPLY_FD`` (vLLM logs to stdout and
stderr, which the parent sends to a file). The first reply says the engine is up.

Commands (``{"op": ..., ...}``):

* ``generate``: ``prompts`` (token-id lists), ``max_tokens`` (one int, or one per prompt),
  ``kv_transfer_params`` (one dict or null per prompt), optionally ``request_ids``
  (increasing integers, one per prompt: the requests' ids before the engine adds its
  random suffix, so two engines can be given one request as a concurrent proxy gives
  it; default: the engine's counter): greedy, ``ignore_eos``; the reply lists per
  prompt its ``token_ids``, ``num_cached_tokens``, ``kv_transfer_params`` and
  ``finish_reason``.
* ``metrics``: vLLM's counters and gauges (``LLM.get_metrics``) as ``[name, labels, value]``.
* ``rpc``: ``LLM.collective_rpc(method, args)``, for the test hooks a worker extension
  adds (:mod:`kvcopy.testing.engine.hooks`).
* ``reset_prefix_cache``, ``exit``.

CONFIG_JSON: ``model``, ``block_size``, ``max_model_len``, ``seed``, and optionally
``dtype`` (default float32), ``kv_transfer_config`` (a dict for vLLM's ``KVTransferConfig``), ``worker_extension_cls``,
``max_num_seqs``, ``enable_prefix_caching``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _outputs(outs):
    return [{
        "token_ids": list(o.outputs[0].token_ids),
        "num_cached_tokens": o.num_cached_tokens,
        "kv_transfer_params": o.kv_transfer_params,
        "finish_reason": o.outputs[0].finish_reason,
        "prompt_len": len(o.prompt_token_ids or ()),
    } for o in outs]


def _metrics(llm):
    rows = []
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            rows.append([m.name, dict(m.labels), value])
    return rows


def _generate(llm, cmd):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = cmd["prompts"]
    max_tokens = cmd["max_tokens"]
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    params = cmd.get("kv_transfer_params") or [None] * len(prompts)
    if not (len(prompts) == len(max_tokens) == len(params)):
        raise ValueError("prompts, max_tokens and kv_transfer_params differ in length")
    sampling = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False,
                               extra_args={"kv_transfer_params": p} if p is not None else None)
                for n, p in zip(max_tokens, params)]
    ids = cmd.get("request_ids")
    counter = llm.request_counter
    if ids is not None:
        # LLM numbers its requests from this counter and sorts its outputs by that number
        if len(ids) != len(prompts) or any(not isinstance(i, int) for i in ids) or ids != sorted(set(ids)):
            raise ValueError("request_ids must be increasing integers, one per prompt")
        llm.request_counter = iter(ids)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, use_tqdm=False)
    finally:
        llm.request_counter = counter
    return {"outputs": _outputs(outs)}


def main(config_json: str, reply_fd: int) -> None:
    from vllm import LLM

    cfg = json.loads(config_json)
    reply = os.fdopen(reply_fd, "w", buffering=1)

    def send(obj):
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    t0 = time.monotonic()
    kwargs = dict(model=cfg["model"], skip_tokenizer_init=True, dtype=cfg.get("dtype", "float32"),
                  max_model_len=cfg["max_model_len"], block_size=cfg["block_size"], enforce_eager=True,
                  seed=cfg.get("seed", 0),
                  disable_log_stats=False, max_num_seqs=cfg.get("max_num_seqs", 16),
                  enable_prefix_caching=cfg.get("enable_prefix_caching", True))
    if cfg.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = cfg["kv_transfer_config"]
    if cfg.get("worker_extension_cls"):
        kwargs["worker_extension_cls"] = cfg["worker_extension_cls"]
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001 -- the parent reports why the engine did not start
        send({"ready": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return
    send({"ready": True, "startup_s": time.monotonic() - t0, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "exit":
                send({"ok": True})
                break
            if op == "generate":
                t = time.monotonic()
                out = _generate(llm, cmd)
                out["seconds"] = time.monotonic() - t
            elif op == "metrics":
                out = {"metrics": _metrics(llm)}
            elif op == "rpc":
                out = {"results": llm.collective_rpc(cmd["method"], args=tuple(cmd.get("args", ())),
                                                     timeout=cmd.get("timeout"))}
            elif op == "reset_prefix_cache":
                out = {"reset": bool(llm.reset_prefix_cache())}
            else:
                raise ValueError(f"unknown op {op!r}")
            send({"ok": True, **out})
        except Exception as exc:  # noqa: BLE001 -- the reply carries the failure to the test
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
