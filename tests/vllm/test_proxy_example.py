"""examples/vllm_disagg/proxy.py speaks vLLM's kv_transfer_params protocol:
the prefill gets the prompt with max_tokens=1 and do_remote_decode, the
decode gets the original request plus the prefill's kv_transfer_params, and
the client gets the decode's answer (streamed or not). The two upstreams are
small HTTP servers that answer as vLLM's OpenAI server does and record what
they were sent; the proxy under test runs unmodified."""
import asyncio
import importlib.util
import json
import os

import aiohttp
from aiohttp import web

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("proxy", os.path.join(ROOT, "examples", "vllm_disagg", "proxy.py"))
proxy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(proxy)

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [3, 4]}


async def serve(app):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def upstream(seen, reply_params=True):
    async def completions(request):
        body = await request.json()
        seen.append(body)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        out = {"choices": [{"text": "hi"}]}
        if reply_params and body.get("kv_transfer_params", {}).get("do_remote_decode"):
            out["kv_transfer_params"] = PARAMS
        return web.json_response(out)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def run(coro):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_prefill_then_decode_with_the_prefills_params():
    async def main():
        p_seen, d_seen = [], []
        p_run, p_url = await serve(upstream(p_seen))
        d_run, d_url = await serve(upstream(d_seen))
        x_run, x_url = await serve(proxy.make_app([p_url], [d_url]))
        body = {"model": "m", "prompt": "hello", "max_tokens": 20}
        async with aiohttp.ClientSession() as s:
            async with s.post(x_url + "/v1/completions", json=body) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["text"] == "hi"
            async with s.post(x_url + "/v1/completions", json=dict(body, stream=True)) as r:
                text = await r.text()
        assert p_seen[0] == {"model": "m", "prompt": "hello", "max_tokens": 1, "stream": False,
                             "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        assert d_seen[0] == dict(body, kv_transfer_params=PARAMS)
        assert d_seen[1]["stream"] is True and p_seen[1]["stream"] is False
        assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
        for runner in (x_run, p_run, d_run):
            await runner.cleanup()

    run(main())


def test_a_prefill_without_a_kv_connector_is_a_clear_502():
    async def main():
        p_run, p_url = await serve(upstream([], reply_params=False))
        d_seen = []
        d_run, d_url = await serve(upstream(d_seen))
        x_run, x_url = await serve(proxy.make_app([p_url], [d_url]))
        async with aiohttp.ClientSession() as s:
            async with s.post(x_url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 502
                assert "kv_producer" in (await r.json())["error"]
        assert d_seen == []
        for runner in (x_run, p_run, d_run):
            await runner.cleanup()

    run(main())
