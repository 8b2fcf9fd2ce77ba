#!/usr/bin/env bash
# Smoke test of the container: build the image, run it with a volume and a tokens file,
# wait until healthy, store and fetch an archive from the host through tannery.Client,
# check that a call without a token and a write with a read token are refused, restart the
# container (SIGTERM, graceful) and check the archive is still there byte for byte; then
# replace the container by one with TLS on the same volume, wait until its health check
# (over TLS) passes, and fetch the archive over TLS. Needs openssl on the host.
#
#   docker/smoke-test.sh
#   CONTAINER_ENGINE=podman BASE_IMAGE=localhost/python-base:bookworm docker/smoke-test.sh
#
# Settings: CONTAINER_ENGINE (docker), BASE_IMAGE (the Dockerfile's default), IMAGE
# (tannery:smoke, kept afterwards for reuse), PYTHON (the repository's .venv, else python3:
# it needs the tannery client with torch). Exits non-zero naming the step that failed; the
# container, its volume and the temporary files are removed in any case.
#
# The container runs on a bridge network of its own, on the image's documented ports (gRPC
# 50051, data 50052, metrics 20051), which are published on free ports of 127.0.0.1: the test
# may run beside a server on the host's default ports (.ci/run holds them). Its client takes
# the gRPC streams (the data port the server names is the one inside the container); the data
# listeners are checked from inside it.
set -Eeuo pipefail

ENGINE=${CONTAINER_ENGINE:-docker}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${IMAGE:-tannery:smoke}
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
RUN_ID=$$-$RANDOM
NAME=tannery-smoke-$RUN_ID
VOLUME=tannery-smoke-$RUN_ID
WORK=$(mktemp -d)
STEP=setup
STARTED=$SECONDS
# The client must not pick up TLS or token settings from the caller's environment.
unset TANNERY_TOKEN TANNERY_TLS TANNERY_TLS_CA TANNERY_CLIENT_CERT TANNERY_CLIENT_KEY TANNERY_TLS_CERT TANNERY_TLS_KEY TANNERY_TARGET

# The engine, without podman's complaint that it has no systemd to schedule health checks
# on (wait_healthy runs them itself).
engine() { "$ENGINE" "$@" 2> >(grep -v 'unable to get systemd connection' >&2); }
say() { printf '[smoke %3ds] %s\n' "$((SECONDS - STARTED))" "$*"; }
step() { STEP=$1; say "$1"; }

cleanup() {
  local status=$?
  trap - EXIT ERR
  if ((status != 0)); then
    say "FAILED at step: $STEP (exit status $status)"
    if engine inspect "$NAME" >/dev/null 2>&1; then
      say "last lines of the container's log:"
      engine logs --tail 30 "$NAME" 2>&1 | sed 's/^/    /' || true
    fi
  fi
  engine rm -f -t 0 "$NAME" >/dev/null 2>&1 || engine rm -f "$NAME" >/dev/null 2>&1 || true
  engine volume rm -f "$VOLUME" >/dev/null 2>&1 || true
  rm -rf "$WORK"
  if ((status == 0)); then say "PASSED"; fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit $?' ERR

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Waits until the container's health check passes (podman without systemd runs no timer:
# the check is run here instead).
wait_healthy() {
  local deadline=$((SECONDS + ${1:-90}))
  while ((SECONDS < deadline)); do
    local running
    running=$(engine inspect -f '{{.State.Running}}' "$NAME")
    [[ $running == true ]] || { say "the container is not running"; return 1; }
    if [[ $ENGINE == *podman* ]]; then
      if engine healthcheck run "$NAME" >/dev/null 2>&1; then return 0; fi
    else
      [[ $(engine inspect -f '{{.State.Health.Status}}' "$NAME") == healthy ]] && return 0
    fi
    sleep 1
  done
  say "not healthy after ${1:-90} s"
  return 1
}

# ---------------------------------------------------------------------------------------
step "build the image $IMAGE with $ENGINE"
build_args=(-f "$ROOT/docker/Dockerfile" -t "$IMAGE")
[[ $ENGINE == *podman* ]] && build_args+=(--format docker)  # OCI images drop HEALTHCHECK
[[ -n ${BASE_IMAGE:-} ]] && build_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
engine build "${build_args[@]}" "$ROOT" >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; false; }
size=$(engine image inspect -f '{{.Size}}' "$IMAGE")
say "image size: $((size / 1000000)) MB"
engine run --rm --entrypoint python3 "$IMAGE" -c \
  'import importlib.util as u, os; assert u.find_spec("torch") is None, "torch"; assert os.getuid() != 0, "root"'
# The image keeps fixed, documented ports where the server alone picks free ones (auto): the data
# port 50052 and metrics on 20051 (IMAGE_METRICS_PORT: not 9090, Prometheus's own), exposed.
engine run --rm --entrypoint python3 "$IMAGE" -c \
  'from tannery_server.config import IMAGE_METRICS_PORT, Config; c = Config.from_env(); assert IMAGE_METRICS_PORT == 20051; assert (c.port, c.data_port, c.metrics_port) == (50051, 50052, 20051), (c.port, c.data_port, c.metrics_port)'
engine image inspect -f '{{json .Config.ExposedPorts}}' "$IMAGE" | grep -q '"20051/tcp"' || { say "the image does not expose 20051"; false; }

step "write a tokens file (a hashed write token, a raw read token)"
WRITE_TOKEN=$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(24))')
READ_TOKEN=$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(24))')
write_hash=$(printf %s "$WRITE_TOKEN" | sha256sum | cut -d' ' -f1)
printf '# smoke test tokens\nsha256:%s write\n%s read  # the reader\n' "$write_hash" "$READ_TOKEN" >"$WORK/tokens"
chmod 0644 "$WORK/tokens" && chmod 0755 "$WORK"

step "start the container with a volume and the tokens file"
GRPC_PORT=$(free_port)
DATA_PORT=$(free_port)
METRICS_PORT=$(free_port)
engine volume create "$VOLUME" >/dev/null
start_container() {
  engine run -d --name "$NAME" --network bridge \
    -v "$VOLUME:/data" \
    -v "$WORK/tokens:/run/tannery/tokens:ro" \
    -e TANNERY_TOKENS_FILE=/run/tannery/tokens \
    -e TANNERY_LOG_FORMAT=json -e TANNERY_GRACE_SECONDS=20 \
    -p "127.0.0.1:$GRPC_PORT:50051" -p "127.0.0.1:$DATA_PORT:50052" -p "127.0.0.1:$METRICS_PORT:20051" \
    "$@" "$IMAGE" >/dev/null
}
start_container

step "wait until the container is healthy"
wait_healthy 90

step "the listeners answer on the documented ports, inside the container"
engine exec -i "$NAME" python3 - <<'EOF'
import os, socket, urllib.request
for port in (50051, 50052, 20051):
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
assert socket.create_connection(("127.0.0.1", 50052), timeout=5).recv(64), "the data port sent no welcome"
unix = socket.socket(socket.AF_UNIX)
unix.settimeout(5)
unix.connect("/data/tannery.sock")
assert unix.recv(64), "the same-host socket sent no welcome"
text = urllib.request.urlopen("http://127.0.0.1:20051/metrics", timeout=5).read().decode()
assert "tannery_archives" in text, "no tannery metrics on 20051"
assert os.getuid() == 10001, os.getuid()
print("    gRPC 50051, data 50052 and /data/tannery.sock, metrics 20051, as uid 10001")
EOF
# From the host, through the published ports: the data port's welcome too.
"$PYTHON" -c 'import socket, sys; s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5); assert s.recv(64)' "$DATA_PORT"

export TANNERY_TRANSPORT=grpc
export SMOKE_TARGET="127.0.0.1:$GRPC_PORT" SMOKE_METRICS="http://127.0.0.1:$METRICS_PORT/metrics"
export SMOKE_WRITE_TOKEN=$WRITE_TOKEN SMOKE_READ_TOKEN=$READ_TOKEN SMOKE_DIGESTS=$WORK/digests

step "store and fetch an archive through tannery.Client"
"$PYTHON" - <<'EOF'
import hashlib, os
import torch
import tannery
from tannery.torch import serialize

target, write, read = os.environ["SMOKE_TARGET"], os.environ["SMOKE_WRITE_TOKEN"], os.environ["SMOKE_READ_TOKEN"]
torch.manual_seed(0)
tensors = {"layer.weight": torch.randn(256, 128), "layer.bias": torch.randn(128).to(torch.bfloat16),
           "steps": torch.arange(1000, dtype=torch.int64), "mask": torch.rand(64, 3) > 0.5}
with tannery.Client(target, token=write) as client:
    info = client.store("smoke", tensors)
    assert info.entries == len(tensors), info
    archive = client.fetch("smoke")
    fetched = {name: archive.find(name) for name in archive.names()}
assert fetched.keys() == tensors.keys(), fetched.keys()
for name, tensor in tensors.items():
    assert serialize(fetched[name]) == serialize(tensor), f"{name} differs"
with open(os.environ["SMOKE_DIGESTS"], "w") as out:
    for name in sorted(tensors):
        out.write(f"{name} {hashlib.sha256(serialize(tensors[name])).hexdigest()}\n")
print(f"    stored and fetched {len(tensors)} tensors, {info.payload_bytes} payload bytes")
EOF

step "refuse a call without a token and a write with the read token"
"$PYTHON" - <<'EOF'
import os, urllib.request
import torch
import tannery

target, read = os.environ["SMOKE_TARGET"], os.environ["SMOKE_READ_TOKEN"]
with tannery.Client(target) as anonymous:
    try:
        anonymous.list()
    except tannery.Unauthenticated as error:
        print(f"    without a token: Unauthenticated ({error})")
    else:
        raise SystemExit("a call without a token was answered")
with tannery.Client(target, token="not-" + read) as stranger:
    try:
        stranger.describe("smoke")
    except tannery.Unauthenticated:
        print("    unknown token: Unauthenticated")
    else:
        raise SystemExit("a call with an unknown token was answered")
with tannery.Client(target, token=read) as reader:
    assert [a.name for a in reader.list()] == ["smoke"]
    for attempt in (lambda: reader.store("intruder", {"x": torch.zeros(3)}), lambda: reader.delete("smoke")):
        try:
            attempt()
        except tannery.PermissionDenied as error:
            print(f"    write with the read token: PermissionDenied ({error})")
        else:
            raise SystemExit("a write with a read-only token was accepted")
    assert [a.name for a in reader.list()] == ["smoke"], "the refused writes changed the store"
metrics = urllib.request.urlopen(os.environ["SMOKE_METRICS"], timeout=10).read().decode()
for line in ('tannery_calls_total{code="UNAUTHENTICATED",method="List"} 1.0',
             'tannery_calls_total{code="PERMISSION_DENIED",method="Store"} 1.0', "tannery_archives 1.0"):
    assert line in metrics, f"metrics lack {line!r}"
print("    metrics count the refusals; tannery_archives 1.0")
EOF

step "push a real model with the tannery command and pull it back byte for byte"
export SMOKE_WORK=$WORK SMOKE_SHARED=$ROOT/../shared/fixtures/tannic-nn
"$PYTHON" - <<'EOF'
import hashlib, os, subprocess, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file

work, shared = Path(os.environ["SMOKE_WORK"]), Path(os.environ["SMOKE_SHARED"])
tannery = [sys.executable, "-m", "tannery.cli", "--target", os.environ["SMOKE_TARGET"]]
env = {**os.environ, "TANNERY_TOKEN": os.environ["SMOKE_WRITE_TOKEN"]}
torch.manual_seed(1)
model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 2)
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, work / "encoder.safetensors")
models = [("encoder", work / "encoder.safetensors")]
if (shared / "MLP.tannic").is_file():  # a real trained MNIST model written by pytannic
    models.append(("mnist-mlp", shared / "MLP.tannic"))
for name, path in models:
    subprocess.run([*tannery, "push", str(path), "--as", name], env=env, check=True, capture_output=True)
    out = work / f"{name}.pulled.safetensors"
    subprocess.run([*tannery, "pull", name, "-o", str(out)], env=env, check=True, capture_output=True)
    if path.suffix == ".safetensors":
        want, got = load_file(path), load_file(out)
        assert want.keys() == got.keys(), (sorted(want), sorted(got))
        for key in want:
            assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
    else:  # the pair's data file ends with the buffers back to back, in this order
        got = load_file(out)
        order = ["input_layer.weight", "input_layer.bias", "output_layer.weight", "output_layer.bias"]
        raw = b"".join(got[key].numpy().tobytes() for key in order)
        assert path.read_bytes().endswith(raw) and len(raw) == 1628200, "MLP's buffers differ"
    print(f"    {name}: {path.name} pushed and pulled back, {len(got)} tensors identical")
    with open(work / "model-digests", "a") as digests:
        digests.write(f"{name} {hashlib.sha256(out.read_bytes()).hexdigest()}\n")
EOF

step "restart the container (SIGTERM, graceful shutdown)"
engine restart -t 40 "$NAME" >/dev/null
engine logs "$NAME" 2>&1 | grep -q '"message": "stopped"' \
  || { say "the log has no graceful 'stopped' line"; false; }
say "the server stopped gracefully"

step "wait until the restarted container is healthy"
wait_healthy 90

step "fetch the archive again and compare it byte for byte"
"$PYTHON" - <<'EOF'
import hashlib, os
import tannery
from tannery.torch import serialize

with open(os.environ["SMOKE_DIGESTS"]) as lines:
    expected = dict(line.split() for line in lines)
with tannery.Client(os.environ["SMOKE_TARGET"], token=os.environ["SMOKE_READ_TOKEN"]) as client:
    archive = client.fetch("smoke")
    got = {name: hashlib.sha256(serialize(archive.find(name))).hexdigest() for name in archive.names()}
assert got == expected, (got, expected)
print(f"    {len(got)} tensors identical after the restart")
EOF

step "pull the real models again: the same files"
"$PYTHON" - <<'EOF'
import hashlib, os, subprocess, sys
from pathlib import Path
work = Path(os.environ["SMOKE_WORK"])
env = {**os.environ, "TANNERY_TOKEN": os.environ["SMOKE_READ_TOKEN"]}
for line in (work / "model-digests").read_text().splitlines():
    name, digest = line.split()
    out = work / f"{name}.again.safetensors"
    subprocess.run([sys.executable, "-m", "tannery.cli", "--target", os.environ["SMOKE_TARGET"], "pull", name,
                    "-o", str(out)], env=env, check=True, capture_output=True)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == digest, f"{name} differs after the restart"
    print(f"    {name}: the same file after the restart")
EOF

step "replace the container by one with TLS, on the same volume (as an upgrade would)"
mkdir "$WORK/tls"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=tannery-smoke \
  -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" \
  -keyout "$WORK/tls/server-key.pem" -out "$WORK/tls/server.pem" 2>/dev/null
chmod 0755 "$WORK/tls" && chmod 0644 "$WORK/tls/server.pem" "$WORK/tls/server-key.pem"  # readable by uid 10001
engine logs "$NAME" >"$WORK/plaintext.log" 2>&1
engine stop -t 40 "$NAME" >/dev/null
engine rm "$NAME" >/dev/null
start_container -v "$WORK/tls:/run/tannery/tls:ro" \
  -e TANNERY_TLS_CERT=/run/tannery/tls/server.pem -e TANNERY_TLS_KEY=/run/tannery/tls/server-key.pem

step "wait until the TLS container is healthy (the health check speaks TLS)"
wait_healthy 90

step "fetch the archive over TLS; a plaintext client is refused"
export SMOKE_CA=$WORK/tls/server.pem
"$PYTHON" - <<'EOF2'
import hashlib, os
import tannery
from tannery.torch import serialize

with open(os.environ["SMOKE_DIGESTS"]) as lines:
    expected = dict(line.split() for line in lines)
target, read = os.environ["SMOKE_TARGET"], os.environ["SMOKE_READ_TOKEN"]
with tannery.Client(target, token=read, tls=tannery.TLS(ca=os.environ["SMOKE_CA"])) as client:
    archive = client.fetch("smoke")
    got = {name: hashlib.sha256(serialize(archive.find(name))).hexdigest() for name in archive.names()}
assert got == expected, (got, expected)
print(f"    {len(got)} tensors identical over TLS")
with tannery.Client(target, token=read, tls=False, timeout=10) as plaintext:
    try:
        plaintext.list()
    except tannery.Unavailable:
        print("    plaintext client: Unavailable")
    else:
        raise SystemExit("a plaintext client was answered by the TLS server")
EOF2

step "check the server's log lines"
logs=$(cat "$WORK/plaintext.log"; engine logs "$NAME" 2>&1)
grep -q '"status": "UNAUTHENTICATED"' <<<"$logs" || { say "no UNAUTHENTICATED call line"; false; }
if grep -q -e "$WRITE_TOKEN" -e "$READ_TOKEN" <<<"$logs"; then say "a token appears in the log"; false; fi
say "one JSON line per call, no token in the log"
step done
