#!/usr/bin/env bash
# Start JupyterLab inside the kit container (the image's default command).
#
# Settings come from the environment (docker/run.sh passes them through):
#   PORT           port to listen on (default 8888). With --net=host this is a port of the node itself.
#   JUPYTER_IP     address to listen on (default 127.0.0.1, reach it with `ssh -i KEY -N -L 8888:127.0.0.1:8888 USER@NODE`).
#                  Set JUPYTER_IP=0.0.0.0 to listen on every interface (then guard the port in the
#                  cloud security group: anyone who reaches it and has the token can run code).
#   JUPYTER_TOKEN  login token. When unset or empty a random one is made: an empty token would turn
#                  the login off, and a notebook server is a remote shell.
#   KIT_DIR        folder JupyterLab opens (default /workspace/ddp-kit).
set -euo pipefail

port="${PORT:-8888}"
ip="${JUPYTER_IP:-127.0.0.1}"
kit_dir="${KIT_DIR:-/workspace/ddp-kit}"

if ! [[ "$port" =~ ^[0-9]+$ ]] || ((port < 1 || port > 65535)); then
    echo "start-jupyter: PORT must be a number from 1 to 65535, got '$port'" >&2
    exit 2
fi
if [[ -z "${JUPYTER_TOKEN:-}" ]]; then
    JUPYTER_TOKEN="$(python3 -c 'import secrets; print(secrets.token_hex(24))')"
fi
# Jupyter reads the token from the environment, so it never shows up in `ps` output.
export JUPYTER_TOKEN
# The node's idle stop (lab/scripts/idle_stop.py, on the host) asks JupyterLab whether a kernel is busy: it reads
# the address and token from the kit's folder, which the host shares. Root only: the token opens a shell.
(umask 077 && printf '{"url": "http://127.0.0.1:%s", "token": "%s"}\n' "$port" "$JUPYTER_TOKEN" \
    > "$kit_dir/.jupyter_server.json") 2> /dev/null || true

echo "JupyterLab listens on ${ip}:${port}. On your laptop, run: ssh -i ~/.ssh/KEY.pem -N -L ${port}:127.0.0.1:${port} ubuntu@THIS_NODE_PUBLIC_IP, then open:"
echo "    http://127.0.0.1:${port}/lab?token=${JUPYTER_TOKEN}"

# --port-retries=0: fail if the port is taken instead of quietly moving to another one.
# --allow-root: the NGC container runs as root.
exec jupyter lab --ip="$ip" --port="$port" --port-retries=0 --no-browser --allow-root \
    --notebook-dir="$kit_dir"
