"""A verbs endpoint in its own process, for the two-process tests (driven over stdin/stdout).

Registers one zeroed region of argv[1] bytes and prints one JSON line {"info", "regions"}; a
sender connects with those, and this process does nothing for it (its wire's thread answers).
Then each {"wait": N} line on stdin is answered with {"immediates", "sha256"} once N immediates
have arrived. Runs until killed or stdin closes.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from disagg.hw.transport.verbs import VerbsTransport


def main() -> None:
    nbytes = int(sys.argv[1])
    t = VerbsTransport("peer")
    buf = np.zeros(nbytes, dtype=np.uint8)
    desc = t.register("kv", buf)
    print(json.dumps({"info": t.local_info(), "regions": [desc.to_dict()]}), flush=True)
    immediates: list[int] = []
    for line in sys.stdin:
        want = json.loads(line)["wait"]
        while len(immediates) < want:
            immediates += t.poll().immediates
            time.sleep(0.0005)
        sha = hashlib.sha256(buf.tobytes()).hexdigest()
        print(json.dumps({"immediates": immediates, "sha256": sha}), flush=True)


if __name__ == "__main__":
    main()
