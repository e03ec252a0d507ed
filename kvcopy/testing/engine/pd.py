"""P/D pairs of real engines: the connectors' configs, starting a pair, one batch through it.

The connectors compared (:data:`CONNECTORS`; the push variants are ``bench/serve_pd.py``'s):

* ``stock``: vLLM's own ``NixlConnector`` (on the CPU platform it reads the KV in
  place: vLLM turns host buffers off there);
* ``mirror``: ``KvcopyNixlConnector`` with ``host_buffer_on_cpu``: vLLM's host-buffer path
  (``kv_buffer_device="cpu"``), P's save and D's sync through kvcopy's copier;
* ``arena``: ``KvcopyArenaConnector``; ``arena-layerwise`` the same with P staging layer
  by layer (``layerwise``).

A batch (:func:`run_pd`) is what a proxy does: P runs every prompt with
``do_remote_decode`` and ``max_tokens=1`` in one ``generate``, then D runs every prompt
with P's ``kv_transfer_params`` (less ``remote_prefill_cached_tokens``, which would
overwrite D's own ``num_cached_tokens``) in one ``generate``: all requests in flight
together on each side.
"""
from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import Any, Dict, List, Optional, Sequence

from .process import Engine, free_port

CONNECTORS = ("stock", "mirror", "arena", "arena-layerwise")
HOOKS = "kvcopy.testing.engine.hooks.KvcopyHooks"


def kv_transfer_config(connector: str, role: str = "kv_both", **kvcopy: Any) -> Dict[str, Any]:
    """vLLM's ``KVTransferConfig`` fields for ``connector`` (``kvcopy``: the
    ``kv_connector_extra_config["kvcopy"]`` options). Every one recomputes a failed load."""
    if connector == "stock":
        if kvcopy:
            raise ValueError("the stock connector takes no kvcopy options")
        return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                "kv_load_failure_policy": "recompute"}
    if connector == "mirror":
        return {"kv_connector": "KvcopyNixlConnector", "kv_connector_module_path": "kvcopy.vllm", "kv_role": role,
                "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvcopy": {"host_buffer_on_cpu": True, **kvcopy}}}
    if connector == "arena-layerwise":
        return kv_transfer_config("arena", role, **{"layerwise": True, **kvcopy})
    if connector == "arena":
        return {"kv_connector": "KvcopyArenaConnector", "kv_connector_module_path": "kvcopy.vllm", "kv_role": role,
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvcopy": {"arena_bytes": 64 << 20, **kvcopy}}}
    raise ValueError(f"unknown connector {connector!r}; known: {CONNECTORS}")


def engine_config(model: str, block_size: int = 32, max_model_len: int = 1024, dtype: str = "float32",
                  kv: Optional[Dict[str, Any]] = None, **extra: Any) -> Dict[str, Any]:
    """The driver's config (:mod:`.driver`): a tiny model, greedy, the test hooks loaded."""
    cfg = {"model": model, "block_size": block_size, "max_model_len": max_model_len, "dtype": dtype, "seed": 0,
           "worker_extension_cls": HOOKS, "kv_transfer_config": kv}
    cfg.update(extra)
    return cfg


def side_channel_env() -> Dict[str, str]:
    """Each engine's own NIXL side-channel port (vLLM's and the arena connector's), on loopback."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}


def link_side_env(net, side: str) -> Dict[str, str]:
    """An engine's variables on ``side`` (``"p"``/``"d"``) of a two-namespace link
    (:class:`kvcopy.bench.two_hosts.TwoHosts`, started): NIXL's UCX on TCP over its veth
    only; its side channel (vLLM's and the arena connector's listener, whose address P
    hands D in ``kv_transfer_params`` and a pushing D hands P in each reservation) on its
    veth address, where the other namespace reaches it; vLLM's host address
    (``VLLM_HOST_IP``: its distributed init) there too, as on a host of its own."""
    addr = net.address(side)
    return dict(net.link_env(side), VLLM_NIXL_SIDE_CHANNEL_HOST=addr, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()),
                VLLM_HOST_IP=addr)


@dataclasses.dataclass
class Pair:
    p: Engine
    d: Engine

    def close(self) -> None:
        for e in (self.d, self.p):
            e.close()


def start_pair(log_dir: str, name: str, p_config: Dict[str, Any], d_config: Dict[str, Any],
               env: Optional[Dict[str, str]] = None) -> Pair:
    """Start P and D (side by side) and wait for both; kills both if either fails."""
    p = Engine(f"{name}-P", p_config, os.path.join(log_dir, f"{name}-P.log"), {**(env or {}), **side_channel_env()})
    d = Engine(f"{name}-D", d_config, os.path.join(log_dir, f"{name}-D.log"), {**(env or {}), **side_channel_env()})
    try:
        p.start()
        d.start()
        p.wait_ready()
        d.wait_ready()
    except BaseException:
        p.kill()
        d.kill()
        raise
    return Pair(p, d)


def prefill_params(p: Engine, prompts: Sequence[Sequence[int]]) -> List[Dict[str, Any]]:
    """P's part of a batch: the ``kv_transfer_params`` to hand D, one per prompt."""
    outs = p.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = []
    for o in outs:
        kp = o["kv_transfer_params"]
        if not kp or not kp.get("do_remote_prefill"):
            raise AssertionError(f"P returned no kv_transfer_params for D: {kp!r}")
        kp = dict(kp)
        kp.pop("remote_prefill_cached_tokens", None)
        params.append(kp)
    return params


@dataclasses.dataclass
class Batch:
    outputs: List[Dict[str, Any]]  # D's, per prompt: token_ids, num_cached_tokens, ...
    p_seconds: float
    d_seconds: float

    @property
    def tokens(self) -> List[List[int]]:
        return [o["token_ids"] for o in self.outputs]

    @property
    def cached(self) -> List[int]:
        return [o["num_cached_tokens"] for o in self.outputs]


def run_pd(pair: Pair, prompts: Sequence[Sequence[int]], max_tokens: int) -> Batch:
    """One batch, P then D (module docstring)."""
    t0 = time.monotonic()
    params = prefill_params(pair.p, prompts)
    t1 = time.monotonic()
    outs = pair.d.generate(prompts, max_tokens, params)
    return Batch(outs, t1 - t0, time.monotonic() - t1)


def load_failures(engine: Engine, limit: int = 20) -> str:
    """The lines of ``engine``'s log that say why a load failed (vLLM's NIXL failure
    reports, the arena connector's failed pulls and pushes, its side channel held up):
    what a failed ``cached`` check shows."""
    keys = ("NIXL transfer failure", "pull failed", "push failed", "did not answer the NIXL handshake", "recomput",
            "was held up", "asking again")  # the last two: the side channel's listener starved, D asking again
    lines = [line for line in engine.log().splitlines() if any(k in line for k in keys)]
    return f"{engine.name}: {len(lines)} load-failure lines" + "".join("\n" + line for line in lines[:limit])


def random_prompts(lengths: Sequence[int], seed: int, vocab: int = 512) -> List[List[int]]:
    """Token-id prompts of the given lengths (ids 1 .. vocab-1), reproducible from ``seed``."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def counter_delta(before: Dict[str, float], after: Dict[str, float], name: str) -> float:
    """How much vLLM counter ``name`` (a :meth:`Engine.metrics` key) grew."""
    return after.get(name, 0) - before.get(name, 0)


PROMPT_SOURCES = tuple(f"vllm:prompt_tokens_by_source{{source={s}}}"
                       for s in ("local_compute", "local_cache_hit", "external_kv_transfer"))
