"""Pure builders: the exact launch argv of one server and the POSIX shell scripts run on its host.

Nothing here touches a host. The scripts are fed to `sh -s` on stdin by a transport, so no
secret and no script text appears in a remote command line or in the hook's command log.
Every value interpolated into a script is either a constant of this module, an integer, or
passed through `shlex.quote` after `FleetSpec` validated it.

The API key never enters the server's argv (`ps` and /proc/PID/cmdline are world-readable): the
launch script writes it to a mode-0600 YAML file in the work dir and the server is started with
`--config FILE`, which SGLang (and the stand-in) expands into `--api-key ...` inside the process.

Secrets the fleet's `env` references (Airflow Variables or connection fields, resolved on the worker) take
the same path as the key's file: they are written into the launch script, which travels on stdin, as
environment assignments of the server process (its environment, /proc/PID/environ, is readable by its
own user only), never into an argv, the pid file or the log; the configuration hash holds their digests.

The pid file records pid, process group, the kernel start time of the process (field 22 of
/proc/PID/stat) and a hash of the launch configuration. Stopping signals the recorded process
group only after checking that the recorded pid is still the same process (same start time):
a recycled pid is never signalled, and nothing is ever stopped by name pattern.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass

from tracegen.fleet.spec import FleetSpec, FleetSpecError, HostSpec, check_sglang_flags, flag_args

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class ServerPaths:
    """Where one server's pid file and log live on its host (relative paths are under $HOME)."""

    work_dir: str
    pid_file: str
    log_file: str
    config_file: str  # SGLang `--config` YAML holding the API key; SGLang wants a .yaml suffix


def server_paths(spec: FleetSpec, host: HostSpec, gpu: int) -> ServerPaths:
    stem = f"sglang-gpu{int(gpu)}-port{host.port(gpu)}"
    return ServerPaths(spec.work_dir, f"{stem}.pid", f"{stem}.log", f"{stem}.config.yaml")


def _check_api_key(spec: FleetSpec, api_key: str) -> None:
    # SGLang turns the config file back into `--api-key VALUE` for argparse: a leading '-' would be
    # read as an option, and only printable ASCII survives the YAML round trip unchanged.
    if not api_key or _CONTROL.search(api_key) or api_key.startswith("-") or not api_key.isascii():
        raise FleetSpecError(
            f"api key from connection {spec.api_key_conn_id!r} is empty, starts with '-' or has "
            "control or non-ASCII characters"
        )


def launch_argv(spec: FleetSpec, host: HostSpec, gpu: int, api_key: str | None = None) -> list[str]:
    """The exact argv of the server on `gpu` of `host` (the same for SGLang and the stand-in).

    With an API key the argv carries `--config FILE` (written by `launch_script`), never the key.
    """
    if gpu not in host.gpus:
        raise FleetSpecError(f"gpu {gpu!r} is not one of host {host.conn_id}'s GPUs {list(host.gpus)}")
    check_sglang_flags(spec.sglang_flags)
    argv = [spec.python, "-m", spec.launch_module, "--model-path", spec.model_path]
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    argv += ["--host", spec.bind_host, "--port", str(host.port(gpu))]
    if api_key is not None:
        _check_api_key(spec, api_key)
        argv += ["--config", server_paths(spec, host, gpu).config_file]
    return argv + flag_args(spec.sglang_flags)


def server_env(spec: FleetSpec, gpu: int, secrets: dict[str, str] | None = None) -> dict[str, str]:
    """Environment added to the server process: its own GPU, the spec's plain extras, and the values of
    the secrets its `env` references (`secrets`, resolved by the caller on the worker)."""
    refs = spec.secret_refs()
    secrets = secrets or {}
    missing = sorted(set(refs) - set(secrets))
    if missing:
        raise FleetSpecError(f"env{missing}: secret references not resolved before building the server's environment")
    for name in refs:
        value = secrets[name]
        # Control characters would corrupt the script's lines; the message never shows the value.
        if not isinstance(value, str) or _CONTROL.search(value):
            raise FleetSpecError(f"env[{name}]: the value of {refs[name].describe()} is not a single-line string")
    return {"CUDA_VISIBLE_DEVICES": str(int(gpu)), **spec.plain_env(), **{n: secrets[n] for n in refs}}


def hashed_env(spec: FleetSpec, gpu: int, secrets: dict[str, str] | None = None) -> dict[str, str]:
    """`server_env` with each secret replaced by its digest: what the configuration hash is computed over,
    so a rotated secret restarts the server while the pid file and the log never hold the secret."""
    env = server_env(spec, gpu, secrets)
    for name in spec.secret_refs():
        env[name] = "sha256:" + hashlib.sha256(env[name].encode()).hexdigest()
    return env


def server_config(api_key: str) -> str:
    """The YAML of the server's `--config` file: SGLang reads each key as the flag `--<key>`."""
    # A JSON string is a YAML double-quoted scalar: any quote or backslash in the key stays literal.
    return f"api-key: {json.dumps(api_key)}\n"


def config_hash(argv: list[str], env: dict[str, str], api_key: str | None = None) -> str:
    """A short digest of what the server was launched with; a changed flag or key means a restart.

    The API key enters only as its own digest so the pid file never holds the secret.
    """
    key = None if api_key is None else "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()
    blob = json.dumps({"argv": argv, "env": sorted(env.items()), "api_key": key}, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


# Shell helpers shared by every script. Fields of /proc/PID/stat are read after the *last* ") "
# because the command name in between parentheses may itself contain spaces or parentheses;
# after it, $1 is the state (field 3), $3 the process group (field 5), ${20} the start time (22).
_HELPERS = r"""
proc_stat() { s=''; read -r s < "/proc/$1/stat" 2>/dev/null; printf '%s' "${s##*) }"; }
starttime_of() {  # start time of a live (non-zombie) process, empty when gone
  r=$(proc_stat "$1"); [ -n "$r" ] || return 0
  set -- $r; [ "$1" = Z ] && return 0; printf '%s' "${20}"
}
pgid_of() { r=$(proc_stat "$1"); [ -n "$r" ] || return 0; set -- $r; printf '%s' "$3"; }
group_members() {  # live (non-zombie) processes of process group $1, space separated
  out=''
  for f in /proc/[0-9]*/stat; do
    s=''; read -r s < "$f" 2>/dev/null || continue
    r=${s##*) }; set -- $r
    if [ "$3" = "$G" ] && [ "$1" != Z ]; then p=${f#/proc/}; out="$out ${p%/stat}"; fi
  done
  printf '%s' "$out"
}
field() { sed -n "s/^$1=\([0-9a-f]*\)\$/\1/p" "$PIDFILE" 2>/dev/null | head -n 1; }
inspect() {  # sets STATE to absent | corrupt | stale | running | orphaned
  PID=''; PGID=''; START=''; CONFIG=''; AGE=''
  if [ ! -f "$PIDFILE" ]; then STATE=absent; return 0; fi
  PID=$(field pid); PGID=$(field pgid); START=$(field start); CONFIG=$(field config)
  LAUNCHED=$(field launched); [ -n "$LAUNCHED" ] && AGE=$(( $(date +%s) - LAUNCHED ))
  if [ -z "$PID" ] || [ -z "$PGID" ] || [ -z "$START" ]; then STATE=corrupt; return 0; fi
  NOW=$(starttime_of "$PID")
  G=$PGID
  if [ -n "$NOW" ] && [ "$NOW" = "$START" ]; then STATE=running
  elif [ -n "$NOW" ]; then STATE=stale  # the pid was recycled by an unrelated process
  elif [ -n "$(group_members)" ]; then STATE=orphaned  # leader gone, its children still hold the group
  else STATE=stale
  fi
}
lock_slot() {  # serialise launch/stop of this slot between concurrent provisioners (flock: util-linux)
  exec 9>>"$PIDFILE.lock"
  if command -v flock >/dev/null 2>&1; then
    flock -w "$1" 9 || { echo "error=another fleet operation on $PIDFILE did not finish within $1 s"; exit 7; }
  fi
}
report() {
  printf 'state=%s\npid=%s\npgid=%s\nstart=%s\nconfig=%s\nage=%s\n' "$STATE" "$PID" "$PGID" "$START" "$CONFIG" "$AGE"
}
"""


def _prelude(spec: FleetSpec, host: HostSpec, gpu: int) -> str:
    paths = server_paths(spec, host, gpu)
    enter_home = "" if paths.work_dir.startswith("/") else 'cd "$HOME" || exit 3\n'
    wd = shlex.quote(paths.work_dir)
    return (
        "set -u\numask 077\n"
        + enter_home
        + f"mkdir -p {wd} 2>/dev/null\n"
        + f'cd {wd} || {{ echo "error=cannot enter work dir {paths.work_dir}"; exit 3; }}\n'
        + f"PIDFILE={shlex.quote(paths.pid_file)}\nLOGFILE={shlex.quote(paths.log_file)}\n"
        + f"CONFIGFILE={shlex.quote(paths.config_file)}\n"
        + _HELPERS
    )


def inspect_script(spec: FleetSpec, host: HostSpec, gpu: int) -> str:
    """Prints key=value lines: state, pid, pgid, start, config, age of the pid file, and who
    listens on the server's port: `own` (a process of the recorded group), `other`, or `none`.

    Health probes wait for `own`: probing a port nobody listens on through an SSH tunnel only
    produces tracebacks, and a port held by someone else must not pass for our server.
    """
    port_hex = f"{host.port(gpu):04X}"
    return (
        _prelude(spec, host, gpu)
        + "inspect\nreport\n"
        # Inodes of sockets in LISTEN state (0A) on the port, IPv4 and IPv6.
        + f"INODES=$(awk -v p=':{port_hex}' '$4 == \"0A\" && substr($2, length($2) - 4) == p {{ print $10 }}' "
        + "/proc/net/tcp /proc/net/tcp6 2>/dev/null)\n"
        + r"""LISTEN=none
if [ -n "$INODES" ]; then
  LISTEN=other
  if [ "$STATE" = running ] || [ "$STATE" = orphaned ]; then
    G=$PGID
    for p in $(group_members); do
      links=$(ls -l "/proc/$p/fd" 2>/dev/null)
      for inode in $INODES; do
        case "$links" in *"socket:[$inode]"*) LISTEN=own;; esac
      done
    done
  fi
fi
echo "listening=$LISTEN"
"""
    )


def launch_script(
    spec: FleetSpec, host: HostSpec, gpu: int, api_key: str | None = None, secrets: dict[str, str] | None = None
) -> str:
    """Launches the server detached in its own session and writes its pid file.

    Serialised per slot with flock. When a concurrent provisioner already launched the very same
    configuration it joins that server (exit 0, state=running); any other live server in the pid
    file makes it refuse (exit 6): never two servers on one GPU and port.
    """
    argv = launch_argv(spec, host, gpu, api_key)
    env = server_env(spec, gpu, secrets)
    digest = config_hash(argv, hashed_env(spec, gpu, secrets), api_key)
    assignments = " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())
    command = " ".join(shlex.quote(arg) for arg in argv)
    return (
        _prelude(spec, host, gpu)
        + r"""
lock_slot LOCKWAIT
inspect
if [ "$STATE" = running ] && [ "$CONFIG" = DIGEST ]; then
  report; exit 0  # a concurrent provisioner launched the very same server: join it
fi
case "$STATE" in running|orphaned) report; echo "error=a server is already running from $PIDFILE"; exit 6;; esac
for tool in setsid nohup; do
  command -v "$tool" >/dev/null 2>&1 || { echo "error=$tool not found on this host"; exit 3; }
done
rm -f "$PIDFILE"
[ -f "$LOGFILE" ] && mv -f "$LOGFILE" "$LOGFILE.1"
""".replace("LOCKWAIT", str(_lock_wait(spec))).replace("DIGEST", digest)
        + _write_config_file(api_key)
        + f'printf "# tracegen launch %s config={digest}\\n" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$LOGFILE"\n'
        # stdin from /dev/null: this script itself arrives on sh's stdin and must not be eaten.
        # 9>&-: the server must not inherit the slot lock, or it would hold it for its whole life.
        + f'{assignments} setsid nohup {command} < /dev/null >> "$LOGFILE" 2>&1 9>&- &\n'
        + r"""PID=$!
i=0
while :; do
  G=$(pgid_of "$PID")
  [ -n "$G" ] || { echo "error=server process vanished right after launch"; exit 4; }
  [ "$G" = "$PID" ] && break  # setsid has run: the server leads its own session and group
  i=$((i + 1)); [ "$i" -lt 500 ] || { echo "error=server never became a process group leader"; exit 4; }
  sleep 0.01
done
START=$(starttime_of "$PID")
[ -n "$START" ] || { echo "error=server exited right after launch"; exit 4; }
"""
        + "printf 'pid=%s\\npgid=%s\\nstart=%s\\nconfig=%s\\nport=%s\\ngpu=%s\\nlaunched=%s\\n' "
        + f'"$PID" "$PID" "$START" {digest} {host.port(gpu)} {int(gpu)} "$(date +%s)" > "$PIDFILE.tmp"\n'
        + r"""mv -f "$PIDFILE.tmp" "$PIDFILE"
STATE=launched PGID=$PID AGE=0 CONFIG="""
        + digest
        + "\nreport\n"
    )


def _write_config_file(api_key: str | None) -> str:
    """Shell lines that leave the server's `--config` file holding `api_key`, or no file without one.

    The key travels in a here-document, never in an argv (`printf` may be an external program on
    some shells). A fresh file (umask 077, then chmod) replaces any old one, so a file planted with
    looser permissions is never reused; the rename makes a concurrent reader see old or new.
    """
    if api_key is None:
        return 'rm -f "$CONFIGFILE"\n'
    # The key has no newline (checked), so no line of the document can end it early.
    return (
        'rm -f "$CONFIGFILE.tmp"\n'
        "cat > \"$CONFIGFILE.tmp\" <<'TRACEGEN_CONFIG_END'\n"
        + server_config(api_key)
        + "TRACEGEN_CONFIG_END\n"
        + 'chmod 600 "$CONFIGFILE.tmp" && mv -f "$CONFIGFILE.tmp" "$CONFIGFILE" || '
        + '{ echo "error=cannot write the server config file $CONFIGFILE"; exit 3; }\n'
    )


def _lock_wait(spec: FleetSpec) -> int:
    # Long enough for a concurrent stop to drain and escalate to SIGKILL.
    return int(spec.stop_timeout_s + 60)


def stop_script(spec: FleetSpec, host: HostSpec, gpu: int, keep_config: str | None = None) -> str:
    """Stops the server recorded in the pid file: SIGTERM to its group, wait, SIGKILL, verify.

    With `keep_config`, a running server launched with that configuration is left alone
    (`result=kept`): a concurrent provisioner already replaced the outdated one.
    Prints `result=absent|stale|kept|stopped|killed`; exits 5 if the group survives SIGKILL.
    """
    grace = max(1, int(round(spec.stop_timeout_s * 5)))  # in 0.2 s steps
    keep = keep_config if keep_config and all(c in "0123456789abcdef" for c in keep_config) else "-"
    return (
        _prelude(spec, host, gpu)
        + f"lock_slot {_lock_wait(spec)}\n"
        + r"""
inspect
report
case "$STATE" in
  absent) rm -f "$CONFIGFILE"; echo result=absent; exit 0;;
  stale|corrupt) rm -f "$PIDFILE" "$CONFIGFILE"; echo result=stale; exit 0;;
esac
"""
        + f'if [ "$STATE" = running ] && [ "$CONFIG" = "{keep}" ]; then echo result=kept; exit 0; fi\n'
        + r"""
G=$PGID
kill -s TERM -- "-$PGID" 2>/dev/null
i=0
"""
        + f'while [ -n "$(group_members)" ] && [ "$i" -lt {grace} ]; do sleep 0.2; i=$((i + 1)); done\n'
        + r"""RESULT=stopped
if [ -n "$(group_members)" ]; then
  RESULT=killed
  kill -s KILL -- "-$PGID" 2>/dev/null
  i=0
  while [ -n "$(group_members)" ] && [ "$i" -lt 50 ]; do sleep 0.2; i=$((i + 1)); done
fi
LEFT=$(group_members)
if [ -n "$LEFT" ]; then echo "error=process group $PGID survived SIGKILL:$LEFT"; exit 5; fi
rm -f "$PIDFILE" "$CONFIGFILE"
echo "result=$RESULT"
"""
    )


def log_tail_script(spec: FleetSpec, host: HostSpec, gpu: int, lines: int = 40) -> str:
    """Prints the last `lines` lines of the server's log (nothing when there is no log yet)."""
    return _prelude(spec, host, gpu) + f'[ -f "$LOGFILE" ] && tail -n {int(lines)} "$LOGFILE"\nexit 0\n'


def parse_kv(text: str) -> dict[str, str]:
    """The key=value lines a script printed (later keys win)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isidentifier():
            out[key] = value
    return out
