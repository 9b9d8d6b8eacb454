"""What end-to-end sealing (netbridge.secure) costs per round, against a round's compute.

    .venv/bin/python bench/relay_crypto.py

Seals and opens (AES-256-GCM, as RelayChannel does: seal on one rank, open on the other) the frame of a
typical decode round (hidden states of 5 tokens x 1536 x bf16 = 15 KB) and of a 1,000-token prefill
(~3 MB), and prints the median time next to a round's compute (~400 ms for the embedded
1.5B model on the development CPU; --round-ms to change it). ChaCha20-Poly1305 is printed for comparison.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305  # noqa: E402

from netbridge import secure  # noqa: E402

HIDDEN, BF16 = 1536, 2


def frame_bytes(tokens: int) -> int:
    return tokens * HIDDEN * BF16 + 300  # the tensor bytes plus a frame header's worth of JSON


def median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--round-ms", type=float, default=400.0, help="a round's compute on this machine (default 400)")
    p.add_argument("--repeats", type=int, default=50)
    a = p.parse_args()
    # the two ranks' key agreement, as RelayChannel does it on the first hellos
    pairing = secure.pairing_keys(b"bench-pairing-secret", "bench")
    (private0, public0), (private1, public1) = secure.new_ephemeral(), secure.new_ephemeral()
    keys = secure.traffic_keys(pairing, "bench", private0, 0, public1)
    assert keys == secure.traffic_keys(pairing, "bench", private1, 1, public0)
    sender, receiver = secure.Sealer(keys, 0), secure.Sealer(keys, 1)
    chacha = ChaCha20Poly1305(keys[0])
    print(f"{'frame':<28} {'AES-GCM seal+open':>18} {'per round':>10} {'ChaCha20 seal+open':>19}")
    for label, tokens in (("decode round, 5 tokens", 5), ("prefill, 1,000 tokens", 1000)):
        plaintext = bytes(frame_bytes(tokens))

        def aes_round():
            receiver.open(sender.seal(secure.SEALED, 7, 6, plaintext), 7)

        def chacha_round():
            nonce = bytes(12)
            chacha.decrypt(nonce, chacha.encrypt(nonce, plaintext, b"h"), b"h")
        aes = median_ms(aes_round, a.repeats)
        cha = median_ms(chacha_round, a.repeats)
        name = f"{label} ({len(plaintext) / 1e3:,.0f} KB)" if len(plaintext) < 1e6 else f"{label} ({len(plaintext) / 1e6:.1f} MB)"
        print(f"{name:<28} {aes:>15.3f} ms {aes / a.round_ms:>10.2%} {cha:>16.3f} ms")
    print(f"(per round: against a {a.round_ms:g} ms round; median of {a.repeats}; "
          "a round also carries a reply of ~100 bytes, sealed in microseconds)")


if __name__ == "__main__":
    main()
