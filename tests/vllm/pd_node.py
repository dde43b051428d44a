"""One vLLM instance for the worker-side tests, in its own process: vLLM's
real Scheduler with MoriTorchConnector (scheduler role), the connector's
worker role built by vLLM's KVConnectorFactory, and CPU KV caches from
vLLM's planner and allocator. The test drives it over a pipe, one engine
step at a time; the "forward pass" calls wait_for_layer_load before each
layer's attention and then writes the KV of the step's tokens (random bytes
seeded by the instance's salt), as attention would."""
import os
import traceback
from typing import List

import torch


def _positions(sched, out):
    """req id -> (block ids, first position, count) of the tokens computed this step."""
    res = {}
    for req_id, n in out.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        (blocks,) = sched.kv_cache_manager.get_block_ids(req_id)
        res[req_id] = (blocks, req.num_computed_tokens - n, n)
    return res


def _slots(blocks: List[int], start: int, n: int, block: int):
    pos = torch.arange(start, start + n)
    return torch.tensor(blocks)[pos // block], pos % block


def _write_kv(cache: torch.Tensor, blocks, start, n, block, seed):
    b, j = _slots(blocks, start, n, block)
    g = torch.Generator().manual_seed(seed)
    shape = (n, cache.shape[1], cache.shape[3] * cache.element_size())
    cache[b, :, j] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(cache.dtype)


def _read_kv(cache: torch.Tensor, blocks, start, n, block) -> bytes:
    b, j = _slots(blocks, start, n, block)
    return bytes(cache[b, :, j].contiguous().view(torch.uint8).numpy())


def node_main(conn, model: str, role: str, extra: dict, engine_id: str, num_blocks: int, layout: str,
              policy: str, salt: int):
    try:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.outputs import KVConnectorOutput

        import vllm_helpers as H

        cfg = H.make_vllm_config(model, role, extra, engine_id=engine_id, max_num_batched_tokens=32,
                                 layout=layout, kv_load_failure_policy=policy)
        kcfg = H.kv_cache_config(cfg, num_blocks)
        sched = H.make_scheduler(cfg, kcfg)
        worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcfg)
        caches = H.allocate_caches(cfg, kcfg)
        worker.register_kv_caches(caches)
        names = H.layer_names()
        conn.send(("ready", os.getpid()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    step_no = 0
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "exit":
                worker.shutdown()
                conn.send(("ok", None))
                return
            if cmd == "add":
                req_id, prompt, max_tokens, params = args
                sched.add_request(H.make_request(prompt, max_tokens=max_tokens, params=params, request_id=req_id))
                conn.send(("ok", None))
            elif cmd == "step":
                skip = set(args[0]) if args else set()  # layers whose attention does not call the hook
                step_no += 1
                out = sched.schedule()
                meta = out.kv_connector_metadata
                pos = _positions(sched, out)
                worker.bind_connector_metadata(meta)
                worker.start_load_kv(None)
                for li, name in enumerate(names):
                    if li not in skip:
                        worker.wait_for_layer_load(name)
                    for k, (blocks, start, n) in enumerate(pos.values()):
                        _write_kv(caches[name], blocks, start, n, H.BLOCK, hash((salt, step_no, li, k)) & 0xFFFFFFFF)
                results = worker.get_transfer_results(out.finished_req_ids)
                invalid = worker.get_block_ids_with_load_errors()
                stats = worker.get_kv_connector_stats()
                worker.clear_connector_metadata()
                kv = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                       finished_recving=results.finished_recving or None,
                                       invalid_block_ids=invalid, kv_connector_stats=stats)
                eo = sched.update_from_output(out, H.runner_output(sched, out, kv))
                finished = {o.request_id: o.kv_transfer_params for outs in eo.values() for o in outs.outputs
                            if o.finished}
                reasons = {o.request_id: str(o.finish_reason) for outs in eo.values() for o in outs.outputs
                           if o.finished}
                conn.send(("ok", {
                    "scheduled": dict(out.num_scheduled_tokens),
                    "pulls": {r: (s.local_block_ids, s.remote_block_ids) for r, s in meta.reqs_to_pull.items()},
                    "finished": finished,
                    "reasons": reasons,
                    "finished_sending": sorted(results.finished_sending),
                    "invalid": sorted(invalid),
                    "stats": None if stats is None else stats.data,
                    "live": sorted(sched.requests),
                    "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
                    "computed": {r: sched.requests[r].num_computed_tokens for r in sched.requests},
                }))
            elif cmd == "kv":
                req_id, n = args  # bytes of the request's first n token slots, per layer
                (blocks,) = sched.kv_cache_manager.get_block_ids(req_id)
                conn.send(("ok", {name: _read_kv(caches[name], blocks, 0, n, H.BLOCK) for name in names}))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception:
            conn.send(("error", traceback.format_exc()))
