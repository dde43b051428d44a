"""Scheduler side of MoriTorchConnector with vLLM's real Scheduler (the
connector loaded through kv_connector_module_path): which blocks the
metadata names for a decode (plain, after prefix-cache hits, full hits,
aborts, malformed params) and what a prefill hands over after a chunked
prefill, when it keeps and frees its blocks."""
import time

import pytest
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from mori_torch.integrations.vllm import MoriTorchConnector, MoriTorchConnectorMetadata
from vllm_helpers import BLOCK, kv_cache_config, make_request, make_scheduler, make_vllm_config, prompt, runner_output

EXTRA = {"rendezvous": "tcpstore://127.0.0.1:29999", "host": "127.0.0.1", "side_channel_port": 40000,
         "kv_lease_s": 60}


def scheduler(model, role, extra=EXTRA, **kw):
    cfg = make_vllm_config(model, role, dict(extra), engine_id=f"{role}-engine", **kw)
    s = make_scheduler(cfg, kv_cache_config(cfg, 200))
    assert isinstance(s.connector, MoriTorchConnector)
    return s


def remote_params(tokens, first_block=100, **over):
    n_blocks = -(-tokens // BLOCK)
    p = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-engine",
         "remote_request_id": "p-req", "remote_block_ids": list(range(first_block, first_block + n_blocks)),
         "remote_num_tokens": tokens, "remote_host": "10.0.0.5", "remote_port": 40000, "remote_tp_size": 1,
         "remote_block_size": BLOCK}
    p.update(over)
    return p


def step(s, tokens=None):
    """schedule + a model output that samples one token per request."""
    out = s.schedule()
    engine_out = s.update_from_output(out, runner_output(s, out, token=tokens or 7))
    return out, engine_out


def run_to_completion(s, req):
    s.add_request(req)
    for _ in range(50):
        if req.request_id not in s.requests:
            return
        step(s)
    raise AssertionError("request did not finish")


def blocks_of(s, req_id):
    (ids,) = s.kv_cache_manager.get_block_ids(req_id)
    return ids


def test_decode_pulls_every_prompt_block_in_the_step_that_schedules_it(model):
    s = scheduler(model, "kv_consumer")
    req = make_request(prompt(70, 1), max_tokens=3, params=remote_params(70))
    s.add_request(req)
    out = s.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, MoriTorchConnectorMetadata)
    spec = meta.reqs_to_pull[req.request_id]
    # 69 tokens pulled (the last prompt token is computed here), in 5 blocks.
    assert out.num_scheduled_tokens[req.request_id] == 1
    assert req.num_computed_tokens == 70  # 69 pulled + the 1 scheduled (counted at scheduling)
    assert out.has_sync_kv_loads
    assert spec.local_block_ids == blocks_of(s, req.request_id)[:5]
    assert spec.remote_block_ids == [100, 101, 102, 103, 104]
    assert (spec.remote_engine_id, spec.remote_request_id, spec.remote_host, spec.remote_port) == \
        ("prefill-engine", "p-req", "10.0.0.5", 40000)
    s.update_from_output(out, runner_output(s, out))
    out2, _ = step(s)
    assert out2.kv_connector_metadata.reqs_to_pull == {}  # one pull per request
    assert out2.num_scheduled_tokens[req.request_id] == 1  # decoding


def test_decode_after_a_prefix_cache_hit_pulls_only_the_missing_blocks(model):
    s = scheduler(model, "kv_consumer")
    shared = prompt(48, 2)  # three full blocks
    run_to_completion(s, make_request(prompt(60, 3, prefix=shared), max_tokens=1))
    req = make_request(prompt(70, 4, prefix=shared), max_tokens=2, params=remote_params(70))
    s.add_request(req)
    out = s.schedule()
    spec = out.kv_connector_metadata.reqs_to_pull[req.request_id]
    assert req.num_computed_tokens == 70 and out.num_scheduled_tokens[req.request_id] == 1
    assert spec.local_block_ids == blocks_of(s, req.request_id)[3:5]
    assert spec.remote_block_ids == [103, 104]


def test_a_full_prefix_hit_pulls_nothing_but_still_frees_the_prefill(model):
    s = scheduler(model, "kv_consumer")
    p = prompt(65, 5)
    run_to_completion(s, make_request(p, max_tokens=1))
    req = make_request(p, max_tokens=2, params=remote_params(65))
    s.add_request(req)
    out = s.schedule()
    spec = out.kv_connector_metadata.reqs_to_pull[req.request_id]
    assert (spec.local_block_ids, spec.remote_block_ids) == ([], [])
    assert spec.remote_request_id == "p-req"
    assert not out.has_sync_kv_loads


def test_a_decode_aborted_before_scheduling_frees_the_prefill(model):
    s = scheduler(model, "kv_consumer")
    req = make_request(prompt(40, 6), params=remote_params(40))
    s.add_request(req)
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    spec = out.kv_connector_metadata.reqs_to_pull[req.request_id]
    assert (spec.local_block_ids, spec.remote_block_ids, spec.remote_request_id) == ([], [], "p-req")


@pytest.mark.parametrize("over,why", [
    ({"remote_block_ids": [1, 2]}, "does not fit 2 blocks"),
    ({"remote_tp_size": 2}, "tensor parallel 2"),
    ({"remote_block_size": 32}, "block size 32"),
    ({"remote_block_ids": "1,2"}, "is not a list of block ids"),
])
def test_malformed_params_are_computed_locally(model, caplog, over, why):
    s = scheduler(model, "kv_consumer")
    params = remote_params(70, **over)
    req = make_request(prompt(70, 7), params=params)
    s.add_request(req)
    out = s.schedule()
    assert out.kv_connector_metadata.reqs_to_pull == {}
    assert out.num_scheduled_tokens[req.request_id] == 64  # a plain prefill, chunked to the token budget
    assert why in caplog.text


def test_chunked_prefill_hands_over_all_its_blocks_and_keeps_them_until_read(model):
    s = scheduler(model, "kv_producer", max_num_batched_tokens=32)
    req = make_request(prompt(80, 8), max_tokens=1, params={"do_remote_decode": True})
    s.add_request(req)
    chunks = []
    params = None
    for _ in range(5):
        out, eo = step(s)
        chunks.append(out.num_scheduled_tokens.get(req.request_id, 0))
        for o in (o for outs in eo.values() for o in outs.outputs):
            if o.finished:
                params = o.kv_transfer_params
        if params:
            break
    assert chunks == [32, 32, 16]
    blocks = blocks_of(s, req.request_id)
    assert len(blocks) == 5
    assert params["remote_block_ids"] == blocks
    assert params["remote_num_tokens"] == 80
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert (params["remote_engine_id"], params["remote_request_id"]) == ("kv_producer-engine", req.request_id)
    assert (params["remote_host"], params["remote_port"], params["remote_block_size"]) == ("127.0.0.1", 40000, BLOCK)
    # Blocks stay allocated; the worker learns the lease in the next step,
    # and vLLM's engine keeps stepping (so the worker sees the decode's notice).
    assert req.request_id in s.requests
    assert s.has_requests() and not s.has_unfinished_requests()
    out = s.schedule()
    deadline = out.kv_connector_metadata.reqs_to_send[req.request_id]
    assert 55 < deadline - time.time() <= 60
    free_before = s.kv_cache_manager.block_pool.get_num_free_blocks()
    s.update_from_output(out, runner_output(s, out, KVConnectorOutput(finished_sending={req.request_id})))
    assert req.request_id not in s.requests
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before + 5
    assert not s.has_requests()


def test_an_aborted_prefill_frees_its_blocks_at_once(model):
    s = scheduler(model, "kv_producer")
    req = make_request(prompt(40, 9), max_tokens=1, params={"do_remote_decode": True})
    s.add_request(req)
    s.schedule()
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert req.request_id not in s.requests
    assert s.schedule().kv_connector_metadata.reqs_to_send == {}


def test_roles_ignore_the_other_sides_requests(model):
    p = scheduler(model, "kv_producer")
    req = make_request(prompt(70, 10), params=remote_params(70))
    p.add_request(req)
    out = p.schedule()
    assert out.kv_connector_metadata.reqs_to_pull == {} and out.num_scheduled_tokens[req.request_id] == 64
    c = scheduler(model, "kv_consumer")
    req = make_request(prompt(20, 11), max_tokens=1, params={"do_remote_decode": True})
    run_to_completion(c, req)  # freed at once: a consumer does not hand KV over


def test_both_role_does_both(model):
    s = scheduler(model, "kv_both")
    a = make_request(prompt(70, 12), params=remote_params(70))
    b = make_request(prompt(20, 13), max_tokens=1, params={"do_remote_decode": True})
    s.add_request(a)
    s.add_request(b)
    out, eo = step(s)
    assert a.request_id in out.kv_connector_metadata.reqs_to_pull
    finished = [o for outs in eo.values() for o in outs.outputs if o.finished]
    assert finished and finished[0].kv_transfer_params["remote_block_ids"] == blocks_of(s, b.request_id)


@pytest.mark.parametrize("extra,match", [
    ({}, "needs 'rendezvous'"),
    ({"rendezvous": "redis://x:1"}, "'redis://x:1' is not"),
    ({"rendezvous": "tcpstore://h:70000"}, r"port in \[1, 65535\], got 70000"),
    ({"rendezvous": "tcpstore://h:1", "backend": "nvlink"}, "backend'] must be one of .* got 'nvlink'"),
    ({"rendezvous": "tcpstore://h:1", "kv_lease_s": -1}, r"kv_lease_s'] must be a number in \[1, 86400\], got -1"),
    ({"rendezvous": "tcpstore://h:1", "bogus": 1}, r"unknown keys \['bogus'\]"),
    ({"rendezvous": "etcd://h:2379", "rendezvous_serve": True}, "with etcd, run etcd"),
    ({"rendezvous": "tcpstore://h:1", "namespace": "a/b"}, "namespace'] must be"),
])
def test_bad_extra_config_is_an_error_naming_the_value(model, extra, match):
    with pytest.raises(ValueError, match=match):
        scheduler(model, "kv_consumer", extra=extra)
