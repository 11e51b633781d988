"""The build-DDP lab (lab/build_ddp/): its tests pass against the kit's solution (solution/reference.py) on 2, 3
and 4 ranks, on one machine and split over two "nodes"; against the untouched student.py every part fails at once
with its own NotImplementedError message (what a student sees first: what to write and where to read, not a hang
and not the code); each deliberately wrong file of solution/mistakes/ fails with the message that names its
mistake; and student.py is the solution with the bodies taken out (the same names, signatures and docstrings),
none of whose strings spells out a call."""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.helpers.procs import REPO, base_env, free_port

LAB = Path(REPO) / "lab" / "build_ddp"
SOLUTION = LAB / "solution" / "reference.py"
MISTAKES = LAB / "solution" / "mistakes"
PARTS = {   # part -> the function whose NotImplementedError its tests meet first in the untouched student.py
    "part_a": "broadcast_parameters",
    "part_b": "OverlapDDP.__init__",
    "part_c": "BucketDDP.__init__",
    "part_d": "ring_all_reduce",
    "part_f": "ShardedOptimizer.__init__",
}
TESTS_PER_PART = {"part_a": 1, "part_b": 2, "part_c": 2, "part_d": 1, "part_f": 1}   # each on every world size
WORLD_SIZES = (2, 3, 4)
RUN_LIMIT_S = 240
LAB_RUNS_LIMIT_S = 540   # lab_runs: 5 processes, each starting 2 to 4 ranks for each of its tests
# each deliberately wrong file: the part whose test it fails, on how many ranks (2, or 3 where 2 ranks cannot show the
# mistake), and what that failure must say (the same on every run, whichever rank reports first)
MISTAKE_MESSAGES = {
    "summed": ("part_a", 2, "summed over the ranks, not averaged"),
    "max_op": ("part_a", 2, "all-reduced with op=MAX, not SUM"),
    "unwaited": ("part_b", 2, "started with async_op=True were never waited for"),
    "unwaited_future": ("part_b", 2, "were never waited for before optimizer.step() (neither the work's wait() nor "
                                     "a wait for its future"),
    "wait_in_hook": ("part_b", 2, "were waited for inside backward(), in the gradient hook that started them"),
    "fake_overlap": ("part_b", 2, "nothing overlapped the backward pass"),
    "forgotten_bucket": ("part_c", 2, "is this rank's own gradient: never all-reduced"),
    "declared_order": ("part_c", 2, "waits in a bucket that fills later"),
    "all_gather_ring": ("part_d", 2, "ring_all_reduce called dist.all_gather (rank 0): not a ring"),
    "gather_to_rank_0": ("part_d", 3, "rank 0 sent a message to rank 2: not a ring: each rank sends only to its "
                                      "right neighbour"),
    "ring_for_two": ("part_d", 3, "in the reduce-scatter step 1 of 2, rank 0 sent 1 element(s) (its chunk 0) and "
                                  "rank 1 received them into 0"),
    "no_broadcast": ("part_f", 2, "rank 0 still holds its own value of head.weight from before this step: never "
                                  "received from its owner, rank 1"),
    "stale_lr": ("part_f", 2, "stepped with lr 0.01, step 1's, where step 2's lr is 0.005"),
    "rank_owners": ("part_f", 2, "the owners differ between ranks: head.weight is broadcast by rank 0 from rank 1 "
                                 "and rank 1 from rank 0"),
}
NAMED_WITHIN_S = {"rank_owners": 10}   # mistakes that would hang: named this many seconds after the ranks started


def definitions(path: Path) -> dict[str, ast.AST]:
    """``{qualified name: node}`` of the public functions, classes and methods of a file (and ``__init__``)."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            found[node.name] = node
            if isinstance(node, ast.ClassDef):
                found.update({f"{node.name}.{item.name}": item for item in node.body
                              if isinstance(item, ast.FunctionDef)
                              and (item.name == "__init__" or not item.name.startswith("_"))})
    return found


def not_implemented_message(function: ast.FunctionDef) -> str | None:
    """The message of the ``raise NotImplementedError("...")`` in ``function``'s body, if it has one."""
    for node in ast.walk(function):
        if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                and getattr(node.exc.func, "id", None) == "NotImplementedError"):
            return ast.literal_eval(node.exc.args[0])
    return None


def test_student_py_is_reference_py_with_the_bodies_taken_out():
    """The same public names, signatures and docstrings (the contract); every body the student writes raises
    NotImplementedError with a message that starts 'write <its name> (part x):'."""
    student, reference = definitions(LAB / "student.py"), definitions(SOLUTION)
    assert sorted(student) == sorted(reference)
    for name, node in student.items():
        twin = reference[name]
        assert ast.get_docstring(node) == ast.get_docstring(twin), f"{name}: the docstrings differ"
        if isinstance(node, ast.FunctionDef):
            assert ast.unparse(node.args) == ast.unparse(twin.args), f"{name}: the signatures differ"
            assert not not_implemented_message(twin), f"the solution's {name} is not written"
            message = not_implemented_message(node)
            if name.endswith(".forward"):   # given: calling the wrapped module is not the lesson
                assert message is None
            else:
                assert message and re.match(rf"write {re.escape(name)} \(part [abcdf]\): ", message), (name, message)
                part = message[len(f"write {name} (part "):][0]
                assert f"README.md ({part})" in message and f"HINTS.md ({part})" in message, (name, message)


def string_constants(path: Path) -> list[str]:
    """Every string literal of a file: its docstrings, messages and comments' neighbours in code."""
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def hinted_calls() -> set[str]:
    """The names of the calls HINTS.md gives in its second tier ("The calls") of each part."""
    names = set()
    for tier in re.findall(r"<summary>Hint 2[^<]*</summary>(.*?)</details>", (LAB / "HINTS.md").read_text(), re.S):
        for span in re.findall(r"`([^`]+)`", tier):
            names.update(re.findall(r"(\w+)\(", span))
    return names


def test_no_string_in_student_py_spells_out_a_call():
    """The answers are not in the messages or the docstrings: no torch.distributed call written out, and none of
    the calls HINTS.md keeps for its second tier (student.py says what to build and where to read, never how)."""
    strings = string_constants(LAB / "student.py")
    # the contract may name what the student's code is called by, and torch's own training calls
    contract = {name.split(".")[-1] for name in definitions(LAB / "student.py")} | {
        "backward", "step", "zero_grad", "state_dict", "parameters", "super"}
    calls = hinted_calls() - contract
    assert {"all_reduce", "register_post_accumulate_grad_hook", "wait", "batch_isend_irecv", "broadcast"} <= calls
    for text in strings:
        assert not re.search(r"\b(dist|torch\.distributed)\.\w+\s*\(", text), text
        for name in calls:
            assert f"{name}(" not in text and f".{name}" not in text, (name, text)


def test_each_part_has_three_hint_tiers_folded_one_at_a_time():
    page = (LAB / "HINTS.md").read_text()
    for part in "abcdf":
        section = re.search(rf"^## \({part}\).*?(?=^## |\Z)", page, re.S | re.M)
        assert section, f"HINTS.md has no section for part ({part})"
        tiers = re.findall(r"<details><summary>(Hint \d)", section.group(0))
        assert tiers == ["Hint 1", "Hint 2", "Hint 3"], (part, tiers)


def test_the_labs_page_states_the_harness_time_bounds():
    source = (LAB / "harness.py").read_text()
    limit = re.search(r"^TIME_LIMIT_S = (\d+)\.0 ", source, re.M).group(1)
    nodes_limit = re.search(r"^NODES_TIME_LIMIT_S = (\d+)\.0 ", source, re.M).group(1)
    page = (LAB / "README.md").read_text()
    assert f"after {limit} seconds" in page and f"waits up to {nodes_limit} s" in page


def lab_env(**extra) -> dict:
    env = base_env(**extra)
    for var in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(var, None)
    for var in [v for v in env if v.startswith("BUILD_DDP")]:
        if var not in extra:
            env.pop(var)
    return env


@pytest.fixture(scope="module")
def lab_runs(tmp_path_factory) -> dict:
    """``python -m pytest lab/build_ddp`` as a student types it, all at once: against the solution, against
    student.py and against the solution split over two "nodes" (part d on 127.0.0.1), each a process of its own;
    and against each deliberately wrong file on 2 or 3 ranks (its part only), as ``BUILD_DDP=<file> python -m
    pytest lab/build_ddp -k ...`` would, one after the other in one process (tests/helpers/lab_runs.py: torch and
    the ranks' fork server start once for all the files, not once for each).
    For each run its exit code, output, seconds, and ``{test name: failure message, or None if it passed}`` from
    its JUnit XML."""
    tmp = tmp_path_factory.mktemp("build_ddp")
    port = free_port()
    nodes = dict(BUILD_DDP="reference", BUILD_DDP_NODES=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    pytest_runs = {"reference": (lab_env(BUILD_DDP="reference"), []),
                   "student": (lab_env(BUILD_DDP="student"), []),
                   "node0": (lab_env(**nodes, BUILD_DDP_NODE_RANK=0), ["-k", "part_d"]),   # they wait for each
                   "node1": (lab_env(**nodes, BUILD_DDP_NODE_RANK=1), ["-k", "part_d"])}   # other
    commands = {name: ([sys.executable, "-m", "pytest", "lab/build_ddp", "-p", "no:cacheprovider",
                        f"--junitxml={tmp / name}.xml", *args], env) for name, (env, args) in pytest_runs.items()}
    mistakes = [[mistake, str(MISTAKES / f"{mistake}.py"), ["-k", f"{part} and {ranks}-ranks"]]
                for mistake, (part, ranks, _) in MISTAKE_MESSAGES.items()]
    (tmp / "mistakes.json").write_text(json.dumps({"out": str(tmp / "mistakes"), "runs": mistakes}))
    (tmp / "mistakes").mkdir()
    commands["mistakes"] = ([sys.executable, "-m", "tests.helpers.lab_runs", str(tmp / "mistakes.json")], lab_env())
    started, procs, logs, ended = time.monotonic(), {}, {}, {}
    try:
        for name, (argv, env) in commands.items():   # 5 processes: 20 at once thrashed 2 cores
            logs[name] = open(tmp / f"{name}.log", "w+")
            procs[name] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=logs[name], stderr=subprocess.STDOUT,
                                           text=True)
        while len(ended) < len(procs) and time.monotonic() - started < LAB_RUNS_LIMIT_S:
            for name, proc in procs.items():
                if name not in ended and proc.poll() is not None:
                    ended[name] = {"rc": proc.returncode, "seconds": time.monotonic() - started}
            time.sleep(0.1)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs.values():
            log.close()
    assert len(ended) == len(procs), f"still running after {LAB_RUNS_LIMIT_S} s: {sorted(set(procs) - set(ended))}"
    results = {name: {**ended[name], "at": tmp} for name in pytest_runs}
    for mistake, _, _ in mistakes:
        done = tmp / "mistakes" / f"{mistake}.json"
        assert done.exists(), f"not run: {mistake}\n{(tmp / 'mistakes.log').read_text()}"
        results[mistake] = {**json.loads(done.read_text()), "at": tmp / "mistakes"}
    for name, result in results.items():
        result["output"] = (result["at"] / f"{name}.log").read_text()
        result["tests"] = junit_results(result["at"] / f"{name}.xml")
    return results


def junit_results(path: Path) -> dict[str, str | None]:
    tests = {}
    for case in ET.parse(path).iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        assert case.find("skipped") is None, f"{case.get('name')} was skipped"
        tests[case.get("name")] = None if problem is None else problem.get("message", "")
    return tests


def names_of(part: str, world_size: int, tests: dict) -> list[str]:
    return [t for t in tests if t.startswith(f"test_{part}_") and t.endswith(f"[{world_size}-ranks]")]


@pytest.mark.slow
@pytest.mark.timeout(LAB_RUNS_LIMIT_S + 60)   # whichever runs first waits for lab_runs
@pytest.mark.floor
def test_the_solution_passes_every_part_on_2_3_and_4_ranks(lab_runs):
    run = lab_runs["reference"]
    assert run["rc"] == 0, run["output"]
    assert len(run["tests"]) == sum(TESTS_PER_PART.values()) * len(WORLD_SIZES), run["output"]
    for part, count in TESTS_PER_PART.items():
        for world_size in WORLD_SIZES:
            names = names_of(part, world_size, run["tests"])
            assert len(names) == count and all(run["tests"][name] is None for name in names), run["output"]


@pytest.mark.slow
@pytest.mark.timeout(LAB_RUNS_LIMIT_S + 60)   # whichever runs first waits for lab_runs
@pytest.mark.floor
def test_the_untouched_student_file_fails_each_part_at_once_with_its_own_message(lab_runs):
    """At once: a NotImplementedError, not the TimeoutError of a rank that hung."""
    run = lab_runs["student"]
    assert run["rc"] == 1, run["output"]
    nodes = definitions(LAB / "student.py")
    messages = {part: not_implemented_message(nodes[name]) for part, name in PARTS.items()}
    for part, message in messages.items():
        for world_size in WORLD_SIZES:
            for name in names_of(part, world_size, run["tests"]):
                failure = run["tests"][name]
                assert failure and failure.startswith(f"NotImplementedError: {message}"), (part, failure)
        assert f"E       NotImplementedError: {message}" in run["output"], f"{part}'s message is not shown"


@pytest.mark.slow
@pytest.mark.timeout(LAB_RUNS_LIMIT_S + 60)   # whichever runs first waits for lab_runs
@pytest.mark.floor
def test_the_tests_run_across_two_nodes_with_master_addr_and_master_port(lab_runs):
    for node in ("node0", "node1"):
        run = lab_runs[node]
        assert run["rc"] == 0, run["output"]
        assert sorted(run["tests"]) == [t for n in WORLD_SIZES for t in names_of("part_d", n, run["tests"])], run["output"]
        assert f"node {node[-1]} of 2" in run["output"]


@pytest.mark.slow
@pytest.mark.timeout(LAB_RUNS_LIMIT_S + 60)   # whichever runs first waits for lab_runs
@pytest.mark.parametrize("mistake", sorted(MISTAKE_MESSAGES))
def test_each_deliberate_mistake_fails_its_part_with_the_message_that_names_it(lab_runs, mistake):
    """Bugs that once gave one message ("layers.0.weight differs"), passed, or hung now each say what they are: a
    wrapper that overlaps nothing or waits in its hooks, futures never waited for, a reduction other than the sum,
    buckets in the wrong order, the kit's own old BucketDDP (an unused parameter's bucket never sent), "rings" that
    are no ring or right for 2 ranks only, and a sharded optimizer that never sends, keeps its first lr or whose
    owners differ between the ranks (named at once, not after the harness's time bound)."""
    part, ranks, says = MISTAKE_MESSAGES[mistake]
    run = lab_runs[mistake]
    failed = [name for name, problem in run["tests"].items() if problem]
    assert run["rc"] == 1 and failed, run["output"]
    assert says in run["output"], run["output"]
    assert set(failed) <= set(names_of(part, ranks, run["tests"])), f"{mistake} should fail {part} only: {failed}"
    if mistake in NAMED_WITHIN_S:   # the harness's note: how long the ranks ran (not pytest's and torch's start)
        after = re.search(r"\(raised on rank \d+ of \d+, ([\d.]+) s after the ranks started", run["output"])
        assert after and float(after.group(1)) < NAMED_WITHIN_S[mistake], run["output"]


# -- the student handout (lab/scripts/make_handout.py) and the Docker image: no answer key --------------------
def handout_module():
    sys.path.insert(0, str(Path(REPO) / "lab" / "scripts"))
    try:
        import make_handout
    finally:
        sys.path.pop(0)
    return make_handout


def test_the_docker_image_leaves_the_solution_out():
    ignored = {line.strip() for line in (Path(REPO) / ".dockerignore").read_text().splitlines()}
    assert "lab/build_ddp/solution/" in ignored


def test_the_handout_refuses_a_folder_in_use_and_touches_nothing_there(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty"):
        handout_module().make_handout(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"


def test_the_handout_check_finds_the_solution_wherever_it_is_copied(tmp_path):
    """The check the handout passes can fail: the solution's code pasted into any file is found."""
    make_handout = handout_module()
    (tmp_path / "notes.md").write_text("my answers:\n" + SOLUTION.read_text())
    found = make_handout.leaks(tmp_path, make_handout.solution_windows(SOLUTION.read_text()))
    assert found and all(f.startswith("notes.md: ") for f in found)


def test_the_handout_check_compares_code_so_the_skeleton_passes_and_the_solution_without_docstrings_does_not():
    """Issue 56: the check subtracted the working tree's student.py from the solution, so a solved student.py
    cleared itself. It now takes the bodies the student writes (GIVEN's aside: the skeleton keeps them) and
    compares code only: the skeleton shares none of it, the solution with every docstring reworded all of it."""
    make_handout = handout_module()
    solution = make_handout.solution_windows(SOLUTION.read_text())
    assert not make_handout.windows(make_handout.code_lines((LAB / "student.py").read_text())) & solution
    assert make_handout.GIVEN == {name for name, node in definitions(LAB / "student.py").items()
                                  if isinstance(node, ast.FunctionDef) and not not_implemented_message(node)}
    source, tree = SOLUTION.read_text().splitlines(), ast.parse(SOLUTION.read_text())
    for node in ast.walk(tree):   # every docstring reworded, the code kept
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and ast.get_docstring(node):
            first = node.body[0]
            indent = source[first.lineno - 1][:len(source[first.lineno - 1]) - len(source[first.lineno - 1].lstrip())]
            source[first.lineno - 1:first.end_lineno] = [f'{indent}"""Mine."""'] + [""] * (first.end_lineno -
                                                                                         first.lineno)
    reworded = make_handout.windows(make_handout.code_lines("\n".join(source)))
    assert reworded & solution == solution


def committed_clone(tmp_path: Path) -> Path:
    """A clone of the kit's commit, for an instructor's hands."""
    clone = tmp_path / "kit"
    subprocess.run(["git", "clone", "-q", "--no-local", "--depth", "1", f"file://{REPO}", str(clone)], check=True,
                   timeout=120)
    return clone


def test_the_handout_takes_the_committed_student_py_not_an_uncommitted_solution(tmp_path):
    """Issue 56: an instructor who solved student.py to try the lab, without committing, got a handout whose
    student.py was the solution. The handout is made from the commit: its student.py is the committed skeleton,
    the uncommitted file is named, and the kit's own tests that run the solution stay out (they would fail)."""
    make_handout = handout_module()
    clone = committed_clone(tmp_path)
    skeleton = (clone / "lab/build_ddp/student.py").read_bytes()
    shutil.copy(clone / "lab/build_ddp/solution/reference.py", clone / "lab/build_ddp/student.py")
    files = make_handout.make_handout(tmp_path / "handout", repo=clone, check_lab=False)
    assert (tmp_path / "handout/lab/build_ddp/student.py").read_bytes() == skeleton
    assert make_handout.uncommitted(clone) == ["lab/build_ddp/student.py"]
    assert "tests/test_build_ddp.py" not in files and "tests/test_own_ddp.py" not in files
    assert "tests/test_training.py" in files and "lab/build_ddp/test_build_ddp.py" in files
    assert not any(name.startswith(("lab/build_ddp/solution/", ".ci/")) for name in files)


def test_the_handout_refuses_a_committed_solution_and_leaves_nothing_behind(tmp_path):
    make_handout = handout_module()
    clone = committed_clone(tmp_path)
    shutil.copy(clone / "lab/build_ddp/solution/reference.py", clone / "lab/build_ddp/student.py")
    subprocess.run(["git", "-c", "user.name=TA", "-c", "user.email=ta@example.org", "commit", "-qam", "solved"],
                   cwd=clone, check=True)
    (tmp_path / "handout.partial").mkdir()   # someone's folder of that name beside OUT: left alone
    (tmp_path / "handout.partial" / "mine.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"would hold the solution's code .*\n  lab/build_ddp/student.py: "):
        make_handout.make_handout(tmp_path / "handout", repo=clone, check_lab=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["handout.partial", "kit"]
    assert (tmp_path / "handout.partial" / "mine.txt").read_text() == "mine"


def test_the_handout_says_which_folder_it_cannot_write_or_which_copy_has_no_git(tmp_path):
    make_handout = handout_module()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"^cannot write beside .*a-file/handout .*: give a folder you can write"):
        make_handout.make_handout(tmp_path / "a-file" / "handout")
    copy = tmp_path / "copy"
    copy.mkdir()
    with pytest.raises(ValueError, match=r"is not a git checkout: the handout is made from what the kit's "):
        make_handout.make_handout(tmp_path / "out", repo=copy)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "copy"]


@pytest.mark.slow
def test_the_handout_has_no_solution_and_its_untouched_student_file_fails_every_part(tmp_path):
    make_handout = handout_module()
    out = tmp_path / "handout"
    files = make_handout.make_handout(out)   # its own check ran the lab's tests there (below: what they say)
    assert "lab/build_ddp/student.py" in files and "lab/build_ddp/HINTS.md" in files
    assert not (out / "lab/build_ddp/solution").exists() and not any("solution" in f for f in files)
    assert not make_handout.leaks(out, make_handout.solution_windows(SOLUTION.read_text()))
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == files   # nothing the check left
    done = subprocess.run([sys.executable, "-m", "pytest", "lab/build_ddp", "-p", "no:cacheprovider", "-k", "2-ranks",
                           f"--junitxml={tmp_path / 'student.xml'}"], cwd=out, env=lab_env(), capture_output=True,
                          text=True, timeout=RUN_LIMIT_S)
    tests = junit_results(tmp_path / "student.xml")
    assert done.returncode == 1 and len(tests) == sum(TESTS_PER_PART.values()), done.stdout
    for part, function in PARTS.items():
        for name in names_of(part, 2, tests):
            assert tests[name].startswith(f"NotImplementedError: write {function} (part {part[-1]}): "), tests[name]
    reference = subprocess.run([sys.executable, "-m", "pytest", "lab/build_ddp", "-p", "no:cacheprovider", "-k",
                                "part_a and 2-ranks"], cwd=out, env=lab_env(BUILD_DDP="reference"),
                               capture_output=True, text=True, timeout=RUN_LIMIT_S)
    assert reference.returncode != 0 and "the student handout and the Docker image leave it out" in reference.stdout


PROBE = """
import sys


def pytest_collection_finish(session):
    lab = [name for name in ("adapter", "harness", "checks", "student", "reference") if name in sys.modules]
    print("TOP-LEVEL", lab, "PACKAGE", sorted(m for m in sys.modules if m.startswith("build_ddp.")))
"""


def test_the_lab_imports_its_modules_as_a_package_never_under_top_level_names(tmp_path):
    """Issue 43, finding 8: the lab's conftest put lab/build_ddp first on sys.path and imported adapter, harness and
    checks as top-level modules: names any other code in the process (a student's checks.py, an installed package)
    then got the lab's file for. They are build_ddp.<name> now, and --build-ddp uses the same adapter module."""
    (tmp_path / "lab_probe.py").write_text(PROBE)
    env = lab_env(BUILD_DDP="reference")
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    done = subprocess.run([sys.executable, "-m", "pytest", "lab/build_ddp", "-p", "no:cacheprovider", "-p",
                           "lab_probe", "--collect-only", "-q"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    line = next((x for x in done.stdout.splitlines() if x.startswith("TOP-LEVEL")), done.stdout + done.stderr)
    assert line.startswith("TOP-LEVEL [] PACKAGE"), line
    for module in ("build_ddp.adapter", "build_ddp.checks", "build_ddp.harness"):
        assert module in line, line
    from ddp_utils import own_ddp
    assert own_ddp._adapter() is sys.modules["build_ddp.adapter"]
