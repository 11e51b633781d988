#!/usr/bin/env bash
# Run the DDP kit container on one node. Do the same on every node of the job.
set -euo pipefail

KIT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"   # the repository root, on the host

usage() {
    cat <<'USAGE'
Usage: docker/run.sh [--build] [--print] [-h] [-- COMMAND...]

Start the DDP kit container on this node with GPUs, host networking and enough shared memory,
then JupyterLab inside it (or COMMAND, e.g. `docker/run.sh -- bash`). Run it on every node.

Options:
  --build    build the image from docker/Dockerfile first (needs internet for pip)
  --print    print the docker commands instead of running them
  -h, --help show this text

Environment (defaults in brackets):
  IMAGE          image to run or build                      [ddp-kit:latest]
  NGC_TAG        NGC PyTorch tag used by --build             [the Dockerfile's default]
  DATA           host folder mounted at /data                [/data]
  PORT           JupyterLab port on this node                [8888]
  JUPYTER_IP     address JupyterLab listens on               [127.0.0.1; 0.0.0.0 = every interface]
  JUPYTER_TOKEN  JupyterLab login token                      [random, printed at start]
  SHM_SIZE       e.g. 8g: use --shm-size=SHM_SIZE instead of --ipc=host
  WANDB_API_KEY  passed through if set (never written to a file)
  GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME
                 passed through if set: the network interface the ranks use, when the kit's
                 choice (the one that routes to the master) is wrong

Examples:
  docker/run.sh --build                 # first time on a node
  PORT=8890 DATA=/mnt/data docker/run.sh
  ssh -i ~/.ssh/KEY.pem -N -L 8888:127.0.0.1:8888 ubuntu@NODE_PUBLIC_IP   # on your laptop; then open the printed URL
USAGE
}

IMAGE="${IMAGE:-ddp-kit:latest}"
DATA="${DATA:-/data}"
PORT="${PORT:-8888}"
SHM_SIZE="${SHM_SIZE:-}"

build=0
print_only=0
while (($#)); do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --build) build=1 ;;
        --print) print_only=1 ;;
        --) shift; break ;;
        *) echo "run.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
# Whatever is left ("$@") replaces the image's default command (JupyterLab).

if ! [[ "$PORT" =~ ^[0-9]+$ ]] || ((PORT < 1 || PORT > 65535)); then
    echo "run.sh: PORT must be a number from 1 to 65535, got '$PORT'" >&2
    exit 2
fi
if [[ -n "${SUDO_USER:-}" && -z "${WANDB_API_KEY:-}${GLOO_SOCKET_IFNAME:-}${NCCL_SOCKET_IFNAME:-}${JUPYTER_TOKEN:-}" ]]; then
    # sudo resets the environment: a key or interface set in the user's shell never reaches the container.
    echo "run.sh: warning: started through sudo, which drops your environment (WANDB_API_KEY, GLOO_SOCKET_IFNAME," >&2
    echo "        NCCL_SOCKET_IFNAME, JUPYTER_TOKEN are not set here). Run it as yourself, in the docker group" >&2
    echo "        (sudo usermod -aG docker \"\$USER\", then log in again), or keep them with sudo -E." >&2
fi
if [[ ! -d "$DATA" ]]; then
    # Without this check docker would quietly create an empty, root-owned $DATA.
    echo "run.sh: data folder DATA=$DATA does not exist on this node." >&2
    echo "        Create it (sudo mkdir -p $DATA) or point DATA at the folder that holds the data sets." >&2
    exit 1
fi

# DataLoader workers hand batches to the training process through shared memory (/dev/shm).
# Docker gives a container only 64 MB of it, and workers then die with "Bus error".
# --ipc=host shares the node's /dev/shm; SHM_SIZE=8g gives the container its own, larger one.
if [[ -n "$SHM_SIZE" ]]; then
    shm=(--shm-size="$SHM_SIZE")
else
    shm=(--ipc=host)
fi
# -t only with a terminal, so the script also works from cron, nohup or CI.
if [[ -t 0 ]]; then tty=(-it); else tty=(-i); fi

build_cmd=(docker build -f "$KIT_DIR/docker/Dockerfile" -t "$IMAGE")
if [[ -n "${NGC_TAG:-}" ]]; then build_cmd+=(--build-arg "NGC_TAG=$NGC_TAG"); fi
build_cmd+=("$KIT_DIR")

run_cmd=(
    docker run "${tty[@]}" --rm
    --gpus all
    --net=host                       # NCCL/Gloo and JupyterLab use the node's own network and ports
    "${shm[@]}"
    --ulimit memlock=-1              # NCCL pins (locks) memory for fast transfers
    --ulimit stack=67108864          # 64 MB stack, as NVIDIA recommends for its containers
    -v "$DATA:/data"
    -v "$KIT_DIR:/workspace/ddp-kit" # the host's kit: notebook edits and runs/ survive --rm
    -e "PORT=$PORT"
    -e JUPYTER_IP -e JUPYTER_TOKEN -e WANDB_API_KEY   # by name: values stay out of `ps` and history
    -e GLOO_SOCKET_IFNAME -e NCCL_SOCKET_IFNAME       # an interface chosen by hand reaches the notebooks
    "$IMAGE"
    "$@"
)

if ((print_only)); then
    if ((build)); then printf '%q ' "${build_cmd[@]}"; echo; fi
    printf '%q ' "${run_cmd[@]}"; echo
    exit 0
fi
if ! command -v docker > /dev/null; then
    echo "run.sh: docker is not installed on this node" >&2
    exit 1
fi
if ((build)); then "${build_cmd[@]}"; fi
exec "${run_cmd[@]}"
