"""A launched program for fleet tests: records the argv and environment it received, then waits.

Launched by the fleet exactly like SGLang (`python -m fleet_probe_server --model-path ...`) with
PYTHONPATH pointing here. It never serves HTTP, so health waits against it time out. It starts a
child in its own process group (to prove stop kills the whole group) and, with
PROBE_IGNORE_TERM=1, ignores SIGTERM (to prove stop escalates to SIGKILL).
"""

import json
import os
import signal
import subprocess
import sys
import time

if __name__ == "__main__":
    out = os.environ.get("PROBE_OUT")
    if out:
        record = {
            "argv": sys.argv[1:],
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pid": os.getpid(),
            "pgid": os.getpgid(0),
            "sid": os.getsid(0),
        }
        with open(out + ".tmp", "w") as fh:
            json.dump(record, fh)
        os.replace(out + ".tmp", out)
    if os.environ.get("PROBE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("PROBE-LOADING-WEIGHTS shard 1/3 for", sys.argv[sys.argv.index("--model-path") + 1], flush=True)
    print("PROBE-STDERR-LINE", file=sys.stderr, flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    while True:
        time.sleep(1)
