#!/usr/bin/env python3
"""A stand-in ``aws`` for tests/test_nodes.py: records each call (one JSON line of its arguments in $FAKE_AWS_LOG)
and answers as the AWS CLI does with ``--output json``, keeping the instances it launched in $FAKE_AWS_STATE
(their state, type, subnet and addresses: a stop drops the public IP, a start gives a new one). $FAKE_AWS_FAIL
names a call that fails as AWS's do, exit 254 and the service's message on stderr: "ec2 run-instances", or with
more words that must all be among the call's arguments ("ec2 run-instances GroupName=ddp-course")."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    with open(os.environ["FAKE_AWS_LOG"], "a") as log:
        log.write(json.dumps(argv) + "\n")
    state_file = Path(os.environ["FAKE_AWS_STATE"])
    state = json.loads(state_file.read_text()) if state_file.exists() else {"instances": {}, "launched": 0}
    call = " ".join(argv[:2])
    fail = os.environ.get("FAKE_AWS_FAIL", "").split()
    if fail and " ".join(fail[:2]) == call and all(word in argv for word in fail[2:]):
        print(f"\nAn error occurred (InsufficientInstanceCapacity) when calling the {argv[1]} operation: We "
              f"currently do not have sufficient capacity in the Availability Zone you requested.", file=sys.stderr)
        return 254

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    def ids() -> list[str]:
        start = argv.index("--instance-ids") + 1
        return [a for a in argv[start:] if a.startswith("i-")]
    instances = state["instances"]
    answer: dict | None = None
    if call == "ssm get-parameter":
        answer = {"Parameter": {"Name": value("--name"), "Type": "String", "Value": "ami-0fake1234567890ab"}}
    elif call == "ec2 describe-security-groups":
        answer = {"SecurityGroups": [{"GroupName": "ddp-course", "GroupId": "sg-0fake42"}]}
    elif call == "sts get-caller-identity":
        answer = {"UserId": "AIDAFAKE", "Account": "123456789012", "Arn": "arn:aws:iam::123456789012:user/student"}
    elif call == "ec2 run-instances":
        state["launched"] += 1
        instance = f"i-0fake{state['launched']:04d}"
        tags = value("--tag-specifications")
        instances[instance] = {"InstanceId": instance, "InstanceType": value("--instance-type"),
                               "State": {"Name": "running"}, "PrivateIpAddress": f"172.31.9.{state['launched']}",
                               "PublicIpAddress": f"3.80.0.{state['launched']}", "Tags": tags,
                               "SubnetId": value("--subnet-id") if "--subnet-id" in argv else "subnet-0fake1a"}
        answer = {"Instances": [{**instances[instance], "State": {"Name": "pending"}}]}
    elif call == "ec2 describe-instances":
        chosen = ids() if "--instance-ids" in argv else [i for i in instances if "course" in instances[i]["Tags"]]
        found = [instances[i] for i in chosen if i in instances and instances[i]["State"]["Name"] != "terminated"]
        answer = {"Reservations": [{"Instances": found}] if found else []}
    elif call in ("ec2 stop-instances", "ec2 start-instances", "ec2 terminate-instances"):
        new = {"stop-instances": "stopped", "start-instances": "running", "terminate-instances": "terminated"}[argv[1]]
        for instance in ids():
            if instance not in instances:
                print(f"An error occurred (InvalidInstanceID.NotFound): The instance ID '{instance}' does not exist",
                      file=sys.stderr)
                return 254
            record = instances[instance]
            record["State"]["Name"] = new
            record.pop("PublicIpAddress", None)
            if new == "running":
                state["launched"] += 1
                record["PublicIpAddress"] = f"54.90.0.{state['launched']}"
        answer = {"Instances": [{"InstanceId": i, "CurrentState": {"Name": new}} for i in ids()]}
    elif call in ("ec2 wait", "budgets create-budget"):
        answer = None   # both print nothing when they succeed
    else:
        print(f"fake aws: no answer for {argv}", file=sys.stderr)
        return 252
    state_file.write_text(json.dumps(state))
    if answer is not None:
        print(json.dumps(answer, indent=4))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
