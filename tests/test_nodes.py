"""lab/scripts/nodes.py, the nodes' lifecycle from a laptop (issue 57), against a stand-in ``aws`` that records its
calls and answers as the AWS CLI does (tests/helpers/fake_aws.py): launch tags the node, sets shutdown behaviour
stop and keeps its id; stop, start, status and terminate use the kept ids; the budget looks the account up and
alerts by e-mail; a failing call is a sentence, and nothing is kept that AWS did not make."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.page_commands import page_commands, path_rows, typed
from tests.helpers.procs import REPO

SCRIPT = Path(REPO) / "lab" / "scripts" / "nodes.py"
FAKE = Path(REPO) / "tests" / "helpers" / "fake_aws.py"


class Laptop:
    def __init__(self, tmp: Path):
        self.tmp, self.log, self.ids = tmp, tmp / "aws-calls.jsonl", tmp / "ddp-nodes.json"
        (tmp / "bin").mkdir()
        (tmp / "bin" / "aws").write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
        (tmp / "bin" / "aws").chmod(0o755)
        self.env = {**os.environ, "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}", "FAKE_AWS_LOG": str(self.log),
                    "FAKE_AWS_STATE": str(tmp / "aws-state.json"), "DDP_NODES_FILE": str(self.ids)}

    def run(self, *args: str, rc: int = 0, **env: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, str(SCRIPT), *args], env={**self.env, **env}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == rc, done.stdout + done.stderr
        return done

    def calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []


@pytest.fixture
def laptop(tmp_path):
    return Laptop(tmp_path)


def test_launch_tags_the_node_stops_it_on_shutdown_and_keeps_its_id(laptop):
    out = laptop.run("launch", "node1", "--type", "g4dn.xlarge", "--key", "KEY").stdout
    calls = laptop.calls()
    assert [c[:2] for c in calls] == [["ssm", "get-parameter"], ["ec2", "describe-security-groups"],
                                      ["ec2", "run-instances"], ["ec2", "wait"], ["ec2", "describe-instances"]]
    run = calls[2]

    def value(flag):
        return run[run.index(flag) + 1]
    assert value("--image-id") == "ami-0fake1234567890ab" and value("--security-group-ids") == "sg-0fake42"
    assert value("--instance-type") == "g4dn.xlarge" and value("--key-name") == "KEY"
    assert value("--instance-initiated-shutdown-behavior") == "stop"
    assert value("--tag-specifications") == ("ResourceType=instance,Tags=[{Key=course,Value=ddp},"
                                             "{Key=Name,Value=ddp-node1}]")
    assert value("--placement") == "GroupName=ddp-course" and "VolumeType=gp3,DeleteOnTermination=true" in \
        value("--block-device-mappings")
    assert calls[3][2:] == ["instance-running", "--instance-ids", "i-0fake0001", "--output", "json"]
    assert json.loads(laptop.ids.read_text()) == {"node1": "i-0fake0001"}
    assert "node1: i-0fake0001 running g4dn.xlarge public 3.80.0.1 private 172.31.9.1" in out
    refused = laptop.run("launch", "node1", "--key", "KEY", rc=2).stderr
    assert "node1 is already kept (i-0fake0001)" in refused


def test_stop_start_status_and_terminate_use_the_kept_ids_and_say_what_survives(laptop):
    laptop.run("launch", "node1", "--key", "KEY")
    laptop.run("launch", "node2", "--key", "KEY")
    stopped = laptop.run("stop").stdout
    assert ["ec2", "stop-instances", "--instance-ids", "i-0fake0001", "i-0fake0002", "--output", "json"] in \
        laptop.calls()
    assert "node1: i-0fake0001 stopped" in stopped and "the NVMe scratch is erased" in stopped
    started = laptop.run("start", "node2").stdout
    assert ["ec2", "start-instances", "--instance-ids", "i-0fake0002", "--output", "json"] in laptop.calls()
    assert "node2: i-0fake0002 running g4dn.2xlarge public 54.90.0.3 private 172.31.9.2" in started   # a new IP
    status = laptop.run("status").stdout
    assert "node1: i-0fake0001 stopped" in status and "node2: i-0fake0002 running" in status
    assert "not kept" not in status
    refused = laptop.run("terminate", rc=2).stderr
    assert "add --yes" in refused and not any(c[1] == "terminate-instances" for c in laptop.calls())
    assert "terminated" in laptop.run("terminate", "--yes").stdout
    assert ["ec2", "wait", "instance-terminated", "--instance-ids", "i-0fake0001", "i-0fake0002", "--output",
            "json"] in laptop.calls()
    assert json.loads(laptop.ids.read_text()) == {}


def test_status_names_course_nodes_that_are_not_kept_here(laptop):
    laptop.run("launch", "node1", "--key", "KEY")
    laptop.ids.write_text("{}")   # launched from another laptop, or the file lost
    assert "also tagged course=ddp, not kept in" in laptop.run("status").stdout
    assert "i-0fake0001" in laptop.run("status").stdout


def test_the_budget_looks_up_the_account_and_alerts_by_email_at_the_amount(laptop):
    out = laptop.run("budget", "--dollars", "10", "--email", "me@example.org").stdout
    (who, create) = laptop.calls()
    assert who[:2] == ["sts", "get-caller-identity"] and create[:2] == ["budgets", "create-budget"]
    assert create[create.index("--account-id") + 1] == "123456789012"
    budget = json.loads(create[create.index("--budget") + 1])
    assert budget["BudgetLimit"] == {"Amount": "10.00", "Unit": "USD"} and budget["BudgetType"] == "COST"
    alerts = json.loads(create[create.index("--notifications-with-subscribers") + 1])
    assert [(a["Notification"]["NotificationType"], a["Notification"]["Threshold"]) for a in alerts] == \
        [("ACTUAL", 80), ("FORECASTED", 100)]
    assert all(a["Subscribers"] == [{"SubscriptionType": "EMAIL", "Address": "me@example.org"}] for a in alerts)
    assert "$10.00 a month" in out


def test_a_failing_call_is_a_sentence_and_nothing_is_kept(laptop):
    err = laptop.run("launch", "node1", "--key", "KEY", rc=2, FAKE_AWS_FAIL="ec2 run-instances").stderr
    assert err.startswith("nodes.py launch: aws ec2 run-instances failed: An error occurred "
                          "(InsufficientInstanceCapacity)")
    assert not laptop.ids.exists()
    assert "no node is kept" in laptop.run("stop", rc=2).stderr
    assert "the AWS CLI is not installed here" in laptop.run("status", rc=2, PATH="/nonexistent").stderr


def test_node2_launched_later_goes_to_node1s_zone_when_the_placement_group_is_full(laptop):
    """Node 2 is launched hours after node 1 (step 2); a full cluster group must not strand node 1's data."""
    laptop.run("launch", "node1", "--key", "KEY")
    out = laptop.run("launch", "node2", "--key", "KEY", FAKE_AWS_FAIL="ec2 run-instances GroupName=ddp-course").stdout
    launches = [c for c in laptop.calls() if c[:2] == ["ec2", "run-instances"]]
    assert len(launches) == 3 and "--placement" in launches[1] and "--placement" not in launches[2]
    assert launches[2][launches[2].index("--subnet-id") + 1] == "subnet-0fake1a"   # node 1's subnet
    assert launches[2][launches[2].index("--instance-initiated-shutdown-behavior") + 1] == "stop"
    assert "no room" in out and "outside the group" in out
    assert json.loads(laptop.ids.read_text()) == {"node1": "i-0fake0001", "node2": "i-0fake0002"}
    # node 1 itself has nowhere to fall back to: the refusal is the sentence of a failed call, and --zone the fix
    laptop.ids.write_text("{}")
    err = laptop.run("launch", "node1", "--key", "KEY", rc=2, FAKE_AWS_FAIL="ec2 run-instances GroupName=ddp-course")
    assert "InsufficientInstanceCapacity" in err.stderr and not json.loads(laptop.ids.read_text())
    laptop.run("launch", "node1", "--key", "KEY", "--zone", "us-east-1b")
    last = laptop.calls()[-3]
    assert last[last.index("--placement") + 1] == "AvailabilityZone=us-east-1b,GroupName=ddp-course"


def test_print_shows_the_commands_and_runs_none(laptop):
    out = laptop.run("--print", "launch", "node1", "--key", "KEY").stdout
    assert "$ aws ec2 run-instances --image-id AMI" in out and "--instance-initiated-shutdown-behavior stop" in out
    assert laptop.calls() == [] and not laptop.ids.exists()


@pytest.mark.parametrize("row", [r for r in path_rows() if r["TYPE"]], ids=lambda r: r["TYPE"])
def test_every_nodes_command_the_pages_give_runs_as_typed_against_the_stand_in(tmp_path, row):
    """Issue 57's Done-when: each lifecycle command a page prints is run here, in the pages' order, with each AWS
    row's values typed in, and does what it says to the ids it kept: the row's type, its budget."""
    laptop = Laptop(tmp_path)
    commands = page_commands("nodes.py")
    assert [c[0] for c in commands] == ["budget", "launch", "launch", "status", "stop", "start", "terminate"], commands
    for command in commands:
        laptop.run(*typed(command, row))
    calls = laptop.calls()
    verbs = [c[1] for c in calls]
    for verb in ("create-budget", "run-instances", "stop-instances", "start-instances", "terminate-instances"):
        assert verb in verbs, verbs
    launches = [c for c in calls if c[1] == "run-instances"]
    assert [c[c.index("--instance-type") + 1] for c in launches] == [row["TYPE"]] * 2
    assert ["ddp-node1" in c[c.index("--tag-specifications") + 1] for c in launches] == [True, False]
    assert all("Key=course,Value=ddp" in c[c.index("--tag-specifications") + 1] for c in launches)
    assert all(c[c.index("--instance-initiated-shutdown-behavior") + 1] == "stop" for c in launches)
    for verb in ("stop-instances", "start-instances", "terminate-instances"):   # the ids launch kept, both nodes
        call = next(c for c in calls if c[1] == verb)
        assert call[call.index("--instance-ids") + 1:call.index("--output")] == ["i-0fake0001", "i-0fake0002"], call
    budget = next(c for c in calls if c[1] == "create-budget")
    assert json.loads(budget[budget.index("--budget") + 1])["BudgetLimit"]["Amount"] == f"{int(row['BUDGET'])}.00"
    assert json.loads(laptop.ids.read_text()) == {}   # terminated: nothing left to cost
