"""A launched program for the redaction tests: logs its secrets the ways servers and launchers do, then exits.

Launched by the fleet exactly like SGLang (`python -m fleet_log_probe --model-path ... --config FILE`) with
PYTHONPATH pointing here. Like SGLang it reads the API key from the `--config` file and logs its server
args as a repr; it also logs the env secrets named in PROBE_LOG_NAMES as a dict repr, as JSON (ASCII and
not) and as a shell `export` line. Then it exits 1, so the fleet reports the start-up failure with the log
tail, the path whose redaction is under test.
"""

import json
import os
import shlex
import sys

if __name__ == "__main__":
    argv = sys.argv[1:]
    api_key = None
    if "--config" in argv:
        with open(argv[argv.index("--config") + 1]) as fh:
            for line in fh:
                if line.startswith("api-key: "):
                    api_key = json.loads(line[len("api-key: "):])
    model = argv[argv.index("--model-path") + 1]
    print(f"server_args=ServerArgs(model_path={model!r}, api_key={api_key!r}, port=31000)", flush=True)
    secrets = {name: os.environ.get(name, "") for name in os.environ.get("PROBE_LOG_NAMES", "").split(",") if name}
    print(f"env={secrets!r}", flush=True)
    print("json=" + json.dumps(secrets), flush=True)
    print("json-utf8=" + json.dumps({"api_key": api_key, **secrets}, ensure_ascii=False), flush=True)
    for name, value in secrets.items():
        print(f"+ export {name}={shlex.quote(value)}", file=sys.stderr, flush=True)
    print("PROBE-FAILED-TO-START", file=sys.stderr, flush=True)
    sys.exit(1)
