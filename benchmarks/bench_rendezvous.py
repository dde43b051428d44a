"""Rendezvous directory costs, on a TCPStore and on etcd (Debian's etcd-server
started here on a loopback port):

- publish: one engine with 64 memories (a fresh directory's publish();
  etcd: lease grant + one transaction), and lookup of it from another
  directory connection; each against the same-run baseline of a raw store
  round trip of the same bytes (TCPStore set/get, etcd put/get);
- departure: time from SIGKILL of a publishing engine (its own process) to
  the "peer left" seen by a connected peer, against the TTL.

    python benchmarks/bench_rendezvous.py [--iters 200] [--kills 5] [--json out.json]
"""
import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid

import torch

from mori_torch.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig
from mori_torch.rendezvous import EtcdDirectory, TorchStoreDirectory
from mori_torch.rendezvous.local_etcd import LocalEtcd

MEMORIES = 64


def engine(key):
    e = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
    e.create_backend(BackendType.TCP, TcpBackendConfig())
    return e


def directory(kind, address, namespace, ttl_s):
    if kind == "etcd":
        return EtcdDirectory(namespace, address, ttl_s=ttl_s)
    host, port = address.rsplit(":", 1)
    return TorchStoreDirectory(namespace, host=host, port=int(port), ttl_s=ttl_s)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(xs_s):
    us = [x * 1e6 for x in xs_s]
    return {"p50_us": round(pct(us, 0.5), 1), "p90_us": round(pct(us, 0.9), 1),
            "mean_us": round(statistics.mean(us), 1)}


def raw_round_trip(kind, d, payload: bytes, iters):
    """Baseline: the store's own write and read of the same bytes."""
    put, get = [], []
    for i in range(iters):
        key = f"bench-raw/{i}"
        if kind == "etcd":
            t0 = time.perf_counter()
            d._client.put(d._k(key), payload)
            t1 = time.perf_counter()
            d._client.get(d._k(key))
            t2 = time.perf_counter()
        else:
            t0 = time.perf_counter()
            d.store.set(d._entry_key(key), payload)
            t1 = time.perf_counter()
            d.store.get(d._entry_key(key))
            t2 = time.perf_counter()
        put.append(t1 - t0)
        get.append(t2 - t1)
    return put, get


def bench_publish_lookup(kind, address, iters):
    e = engine("bench-pub")
    tensors = [torch.zeros(4096, dtype=torch.uint8) for _ in range(MEMORIES)]
    mems = {f"layer{i}": e.register_torch_tensor(t) for i, t in enumerate(tensors)}
    namespace = "bench" + uuid.uuid4().hex[:8]
    reader = directory(kind, address, namespace, 10)
    publish, lookup = [], []
    for _ in range(iters):
        d = directory(kind, address, namespace, 10)
        t0 = time.perf_counter()
        d.publish(e, mems, takeover_timeout_s=0)
        publish.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        entry = reader.lookup(e.key)
        lookup.append(time.perf_counter() - t0)
        assert len(entry.memories) == MEMORIES
        payload = d._published_bytes
        d.close()
    base_put, base_get = raw_round_trip(kind, reader, payload, iters)
    reader.close()
    e.shutdown()
    return {
        "store": kind, "memories": MEMORIES, "entry_bytes": len(payload), "iters": iters,
        "publish": summary(publish), "lookup": summary(lookup),
        "baseline_raw_put": summary(base_put), "baseline_raw_get": summary(base_get),
        "publish_ratio_to_raw_put_p50": round(pct(publish, 0.5) / pct(base_put, 0.5), 2),
        "lookup_ratio_to_raw_get_p50": round(pct(lookup, 0.5) / pct(base_get, 0.5), 2),
    }


def peer_main(kind, address, namespace, key, ttl_s):
    e = engine(key)
    t = torch.zeros(1 << 16, dtype=torch.uint8)
    d = directory(kind, address, namespace, float(ttl_s))
    d.publish(e, {"kv": e.register_torch_tensor(t)}, takeover_timeout_s=0)
    print("READY", flush=True)
    time.sleep(3600)


def bench_departure(kind, address, ttl_s, kills):
    samples = []
    for i in range(kills):
        namespace = "kill" + uuid.uuid4().hex[:8]
        p = subprocess.Popen([sys.executable, __file__, "--peer", kind, address, namespace, "victim", str(ttl_s)],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().startswith("READY")
        e = engine(f"watcher{i}")
        d = directory(kind, address, namespace, ttl_s)
        peer = d.connect(e, "victim", 30)
        time.sleep(ttl_s / 2)  # mid-way between keep-alives
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        assert peer.wait_left(ttl_s * 3 + 5), f"{kind}: peer not seen leaving"
        samples.append(time.monotonic() - t0)
        p.wait(10)
        d.close()
        e.shutdown()
    return {"store": kind, "ttl_s": ttl_s, "kills": kills, "sigkill_to_peer_left_s": [round(s, 3) for s in samples],
            "mean_s": round(statistics.mean(samples), 3), "max_s": round(max(samples), 3),
            "max_ratio_to_ttl": round(max(samples) / ttl_s, 2),
            "ratio_to_default_op_timeout_30s": round(statistics.mean(samples) / 30.0, 3)}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        peer_main(*sys.argv[2:7])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--ttls", type=float, nargs="+", default=[2.0, 5.0])
    ap.add_argument("--json")
    args = ap.parse_args()
    host = TorchStoreDirectory("bench-host", host="127.0.0.1", port=0, is_server=True)
    stores = {"tcpstore": f"127.0.0.1:{host.port}"}
    records = []
    with LocalEtcd() as etcd:
        stores["etcd"] = etcd.endpoint
        version = subprocess.run([etcd.binary, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
        print(f"{'store':<9} {'entry B':>8} {'publish p50/p90 us':>20} {'raw put p50':>12} {'lookup p50/p90 us':>19} "
              f"{'raw get p50':>12}")
        for kind, address in stores.items():
            r = bench_publish_lookup(kind, address, args.iters)
            records.append(r)
            print(f"{kind:<9} {r['entry_bytes']:>8} {r['publish']['p50_us']:>10.0f}/{r['publish']['p90_us']:<9.0f}"
                  f" {r['baseline_raw_put']['p50_us']:>12.0f}"
                  f" {r['lookup']['p50_us']:>9.0f}/{r['lookup']['p90_us']:<9.0f}"
                  f" {r['baseline_raw_get']['p50_us']:>12.0f}")
        print(f"\n{'store':<9} {'TTL s':>6} {'SIGKILL -> peer left (s)':>40} {'max/TTL':>8}")
        for ttl in args.ttls:
            for kind, address in stores.items():
                r = bench_departure(kind, address, ttl, args.kills)
                records.append(r)
                print(f"{kind:<9} {ttl:>6.1f} {str(r['sigkill_to_peer_left_s']):>40} {r['max_ratio_to_ttl']:>8}")
    host.close()
    meta = {"command": "python " + " ".join(sys.argv), "machine": f"{platform.node()} {platform.processor()} "
            f"{os.cpu_count()} cores", "python": platform.python_version(), "torch": torch.__version__,
            "etcd": version, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
