"""Short soak in CI: three initiator processes, one target process, mixed
verified reads and writes for a few seconds; lost, corrupt and hung must be
zero. The long form: scripts/soak.sh."""
import soak


def test_soak_mixed_reads_and_writes_from_several_processes():
    r = soak.run(initiators=3, seconds=8, region=2 << 20, hang_ms=30000, seed=7)
    assert r["ops"] > 100, r
    assert (r["lost"], r["corrupt"], r["hung"]) == (0, 0, 0), r
