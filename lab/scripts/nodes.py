"""Your two AWS nodes, from your laptop: launch, status, stop, start, terminate, and a budget alert.

    python3 lab/scripts/nodes.py budget --dollars 10 --email you@example.org   # step 1: an e-mail before it costs more
    python3 lab/scripts/nodes.py launch node1 --type g4dn.2xlarge --key KEY    # step 1 (node2 later, the same way)
    python3 lab/scripts/nodes.py status                 # each node: state, type, public and private IP
    python3 lab/scripts/nodes.py stop                   # both (or: stop node2): only their disks cost while stopped
    python3 lab/scripts/nodes.py start                  # both; waits, then prints the new public IPs
    python3 lab/scripts/nodes.py terminate --yes        # when the homework is handed in: nodes and disks deleted

Each node is launched tagged ``course=ddp`` and ``Name=ddp-<name>``, with shutdown behaviour ``stop`` (a
``shutdown`` on the node, the idle stop's included, stops it instead of deleting it), in the cluster placement
group and security group ``ddp-course`` of step 1, from the Deep Learning AMI looked up by name, with a gp3 root
disk deleted with the node. When the group has no room for a node launched later (node 2, hours after node 1),
it goes to the first kept node's subnet (the same zone) outside the group. Their ids are kept in ~/.ddp-nodes.json (--ids FILE), so every later command names
them; ``status`` also finds the course's nodes by tag. What survives what: a stop keeps the EBS disk (/data, the
kit, your runs) and the private IP, erases the NVMe scratch (/opt/dlami/nvme) and gives a new public IP at the
next start; terminate deletes the node and its disk. Every command is the AWS CLI's (``aws ec2 ...``), printed
before it runs (--print: printed only).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

IDS = Path(os.environ.get("DDP_NODES_FILE", Path.home() / ".ddp-nodes.json"))
TAG = {"Key": "course", "Value": "ddp"}
GROUP = "ddp-course"
AMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"


class NodesError(Exception):
    """A sentence for the student: what is wrong and what to do."""


def aws(*args: str, dry: bool = False) -> dict | str:
    """Run ``aws ARGS --output json``; its parsed answer ({} when it prints nothing). --print: only say it."""
    command = ["aws", *args, "--output", "json"]
    print("$ " + shlex.join(command), flush=True)
    if dry:
        return {}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except FileNotFoundError:
        raise NodesError("the AWS CLI is not installed here: install it (AWS's 'Install the AWS CLI' guide), then "
                         "aws configure") from None
    if done.returncode != 0:
        raise NodesError(f"aws {args[0]} {args[1]} failed: {done.stderr.strip()}")
    return json.loads(done.stdout) if done.stdout.strip() else {}


def kept() -> dict:
    try:
        return json.loads(IDS.read_text())
    except FileNotFoundError:
        return {}


def keep(ids: dict) -> None:
    partial = IDS.with_name(IDS.name + ".partial")
    partial.write_text(json.dumps(ids, indent=1) + "\n")
    partial.replace(IDS)


def chosen(names: list[str]) -> dict[str, str]:
    """``{name: instance id}`` of the named nodes (every kept one when none is named)."""
    ids = kept()
    if not ids:
        raise NodesError(f"no node is kept in {IDS}: launch one first (nodes.py launch node1 ...), or see "
                         f"nodes.py status for the course's nodes by tag")
    unknown = [n for n in names if n not in ids]
    if unknown:
        raise NodesError(f"{', '.join(unknown)}: not a kept node; the kept ones are {', '.join(ids)} ({IDS})")
    return {n: ids[n] for n in (names or ids)}


def launch(args) -> None:
    if args.name in kept():
        raise NodesError(f"{args.name} is already kept ({kept()[args.name]}): terminate it first, or give another "
                         f"name")
    ami = aws("ssm", "get-parameter", "--name", AMI_PARAMETER, dry=args.print).get("Parameter", {}).get("Value", "AMI")
    groups = aws("ec2", "describe-security-groups", "--group-names", GROUP, dry=args.print)
    group = groups.get("SecurityGroups", [{}])[0].get("GroupId", "SG")
    tags = (f"ResourceType=instance,Tags=[{{Key=course,Value=ddp}},{{Key=Name,Value=ddp-{args.name}}}]")
    def run_instance(*where: str) -> dict | str:
        return aws("ec2", "run-instances", "--image-id", ami, "--instance-type", args.type, "--count", "1",
                   "--key-name", args.key, "--security-group-ids", group, *where,
                   "--instance-initiated-shutdown-behavior", "stop", "--tag-specifications", tags,
                   "--block-device-mappings",
                   f"DeviceName=/dev/sda1,Ebs={{VolumeSize={args.volume_gb},VolumeType=gp3,DeleteOnTermination=true}}",
                   dry=args.print)
    try:
        zone = f"AvailabilityZone={args.zone}," if args.zone else ""
        answer = run_instance("--placement", f"{zone}GroupName={GROUP}")
    except NodesError as error:
        # A node launched hours after the first (node 2 once node 1's data is ready) finds the group's rack full
        # more often. Starting over elsewhere would strand node 1's data: node 2 goes to node 1's subnet (its zone)
        # instead, outside the group; the link may be slower, and step 5's check measures it.
        first = next(iter(kept().values()), None)
        if "InsufficientInstanceCapacity" not in str(error) or first is None:
            raise
        subnet = aws("ec2", "describe-instances", "--instance-ids", first)["Reservations"][0]["Instances"][0]["SubnetId"]
        print(f"the placement group {GROUP} has no room for a {args.type} now: launching {args.name} in the subnet "
              f"(zone) of {first} instead, outside the group (the link between the nodes may be slower: step 5's "
              f"check measures it)", flush=True)
        answer = run_instance("--subnet-id", subnet)
    if args.print:
        return
    instance = answer["Instances"][0]["InstanceId"]
    keep({**kept(), args.name: instance})   # kept before the wait: a Ctrl-C still leaves its id
    aws("ec2", "wait", "instance-running", "--instance-ids", instance)
    print(f"{args.name}: {instance} runs; kept in {IDS}")
    show({args.name: instance})


def show(ids: dict[str, str]) -> None:
    """Each node's line: name, id, state, type, public IP (for your SSH) and private IP (for DDP)."""
    answer = aws("ec2", "describe-instances", "--instance-ids", *ids.values())
    found = {i["InstanceId"]: i for r in answer.get("Reservations", []) for i in r["Instances"]}
    for name, instance in ids.items():
        i = found.get(instance, {})
        print(f"{name}: {instance} {i.get('State', {}).get('Name', 'not found')} {i.get('InstanceType', '')} "
              f"public {i.get('PublicIpAddress', '-')} private {i.get('PrivateIpAddress', '-')}")


def status(args) -> None:
    ids = kept()
    if ids:
        show(ids)
    answer = aws("ec2", "describe-instances", "--filters", "Name=tag:course,Values=ddp",
                 "Name=instance-state-name,Values=pending,running,stopping,stopped")
    others = [i["InstanceId"] for r in answer.get("Reservations", []) for i in r["Instances"]
              if i["InstanceId"] not in ids.values()]
    if others:
        print(f"also tagged course=ddp, not kept in {IDS} (they cost too): {', '.join(others)}")


def change(args) -> None:
    ids = chosen(args.names)
    verb = {"stop": "stop-instances", "start": "start-instances", "terminate": "terminate-instances"}[args.command]
    if args.command == "terminate" and not args.yes:
        raise NodesError(f"terminate deletes {', '.join(ids)} and their disks (/data, your runs): copy what you keep "
                         f"first, then add --yes")
    aws("ec2", verb, "--instance-ids", *ids.values(), dry=args.print)
    if args.print:
        return
    waited = {"stop": "instance-stopped", "start": "instance-running", "terminate": "instance-terminated"}
    aws("ec2", "wait", waited[args.command], "--instance-ids", *ids.values())
    if args.command == "terminate":
        keep({n: i for n, i in kept().items() if n not in ids})
    else:
        show(ids)
    print({"stop": "stopped: only their disks cost now; the NVMe scratch is erased, and the next start gives new "
                   "public IPs (lab/nodes.md, After a restart)",
           "start": "running: the public IPs above are new; the private IPs are the same (lab/nodes.md, After a "
                    "restart: tmux, the container, the tunnel)",
           "terminate": "terminated: the nodes and their disks are deleted"}[args.command])


def budget(args) -> None:
    account = aws("sts", "get-caller-identity", dry=args.print).get("Account", "ACCOUNT")
    limit = {"BudgetName": "ddp-course", "BudgetLimit": {"Amount": f"{args.dollars:.2f}", "Unit": "USD"},
             "TimeUnit": "MONTHLY", "BudgetType": "COST"}
    alerts = [{"Notification": {"NotificationType": kind, "ComparisonOperator": "GREATER_THAN", "Threshold": share,
                                "ThresholdType": "PERCENTAGE"},
               "Subscribers": [{"SubscriptionType": "EMAIL", "Address": args.email}]}
              for kind, share in (("ACTUAL", 80), ("FORECASTED", 100))]
    aws("budgets", "create-budget", "--account-id", account, "--budget", json.dumps(limit),
        "--notifications-with-subscribers", json.dumps(alerts), dry=args.print)
    print(f"budget ddp-course: ${args.dollars:.2f} a month; {args.email} gets an e-mail when 80 % of it is spent "
          f"and when AWS forecasts more than all of it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="print the aws commands, run none")
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("launch", help="launch a node and keep its id")
    one.add_argument("name", help="node1 or node2 (any name: it tags the node and keeps its id)")
    one.add_argument("--type", default="g4dn.2xlarge", help="instance type (your row's; default g4dn.2xlarge)")
    one.add_argument("--key", required=True, help="your key pair's name (step 1)")
    one.add_argument("--volume-gb", type=int, default=300, help="gp3 root disk (default 300)")
    one.add_argument("--zone", default="", help="an Availability Zone (e.g. us-east-1b) when AWS has no capacity "
                                               "in the one it chose; the group's first node sets its zone")
    commands.add_parser("status", help="state and addresses of the kept nodes, and any other course node")
    for verb in ("stop", "start", "terminate"):
        sub = commands.add_parser(verb, help=f"{verb} the kept nodes (or those named)")
        sub.add_argument("names", nargs="*", help="node names (default: every kept one)")
        if verb == "terminate":
            sub.add_argument("--yes", action="store_true", help="yes, delete them and their disks")
    money = commands.add_parser("budget", help="a monthly budget with e-mail alerts")
    money.add_argument("--dollars", type=float, required=True, help="your row's dollars plus a margin")
    money.add_argument("--email", required=True, help="where the alerts go")
    args = parser.parse_args(argv)
    try:
        {"launch": launch, "status": status, "budget": budget}.get(args.command, change)(args)
    except NodesError as error:
        print(f"nodes.py {args.command}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
