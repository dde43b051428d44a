"""Toy prefill/decode proxy for vLLM with MoriTorchConnector (or any
connector speaking vLLM's kv_transfer_params protocol: NIXL, MoRIIO).

    python examples/vllm_disagg/proxy.py --port 8000 \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

For each /v1/completions or /v1/chat/completions request it
1. sends the request to a prefill instance with ``max_tokens=1``, no
   streaming and ``kv_transfer_params={"do_remote_decode": true}``; the
   prefill computes the prompt's KV, keeps its blocks and answers with
   ``kv_transfer_params`` naming them;
2. sends the original request to a decode instance with those
   ``kv_transfer_params``; the decode pulls the blocks layer by layer inside
   its first forward pass and generates; its answer (streamed or not) goes
   back to the client.
Several --prefill/--decode URLs are used round robin. It needs aiohttp
(a vLLM dependency) and nothing else.
"""
import argparse
import copy
import itertools
import logging

try:
    import aiohttp
    from aiohttp import web
except ImportError as e:
    raise SystemExit(f"proxy.py needs aiohttp (a vLLM dependency): pip install aiohttp ({e})") from e

log = logging.getLogger("vllm-disagg-proxy")
SESSION = web.AppKey("session", aiohttp.ClientSession)


def prefill_request(body: dict) -> dict:
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    return req


def make_app(prefills, decodes, timeout_s=600.0) -> web.Application:
    next_prefill, next_decode = itertools.cycle(prefills), itertools.cycle(decodes)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session = request.app[SESSION]
        async with session.post(next(next_prefill) + request.path, json=prefill_request(body)) as r:
            if r.status != 200:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
            params = (await r.json()).get("kv_transfer_params")
        if not params:
            return web.json_response({"error": "the prefill instance returned no kv_transfer_params; is it "
                                               "started with a kv_producer connector?"}, status=502)
        decode_body = dict(body, kv_transfer_params=params)
        async with session.post(next(next_decode) + request.path, json=decode_body) as r:
            resp = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get(
                "Content-Type", "application/json")})
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def start(app):
        app[SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def stop(app):
        await app[SESSION].close()

    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True, help="prefill instance URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="decode instance URL (repeatable)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]),
                host=args.host, port=args.port)


if __name__ == "__main__":
    main()
