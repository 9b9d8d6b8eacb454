"""Every rank of a ring as a thread of this process, over netbridge.channel.local_ring."""
from __future__ import annotations

import threading


def in_threads(ranks: int, body, timeout_s: float = 10) -> dict:
    """body(rank, prev, next) for every rank, as threads over local_ring; {rank: result or exception}. A rank
    that fails closes its links, so the others fail at once instead of waiting out their timeout."""
    from netbridge.channel import local_ring
    links, out = local_ring(ranks, timeout_s=timeout_s), {}

    def run(r):
        try:
            out[r] = body(r, *links[r])
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[r] = e
            for link in links[r]:
                link.close()
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out
