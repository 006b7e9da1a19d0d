"""deploy/: every kustomize overlay renders and its objects validate against the
Kubernetes schemas; every container command is one ember's own parser accepts, the
router discovers Services that exist, on the port their workers serve; the Dockerfiles
install what the Makefile does."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("mixed", "disaggregated", "disaggregated-with-mooncake")
KUBERNETES_VERSION = "1.32.0"  # the schemas the objects are checked against
POD_IP = "10.1.2.3"  # what $(POD_IP) expands to in a pod


def render(overlay: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(["kubectl", "kustomize", str(KUBERNETES / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def containers(objects: list[dict]):
    for obj in objects:
        if obj["kind"] == "Deployment":
            for container in obj["spec"]["template"]["spec"]["containers"]:
                yield obj, container


def expanded(args: list[str], container: dict) -> list[str]:
    """The args as the kubelet passes them: $(VAR) of the container's env expanded."""
    names = {e["name"] for e in container.get("env", [])}
    assert set(re.findall(r"\$\((\w+)\)", " ".join(args))) <= names, "an undefined $(VAR)"
    return [a.replace("$(POD_IP)", POD_IP) for a in args]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_and_validates(overlay):
    import kubernetes_validate

    objects = render(overlay)
    kinds = sorted(o["kind"] for o in objects)
    assert {"Deployment", "Service", "Secret", "HorizontalPodAutoscaler"} <= set(kinds)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    for obj, container in containers(objects):
        assert container["resources"]["requests"] and container["resources"]["limits"]
        assert container.get("readinessProbe") and container.get("livenessProbe"), obj["metadata"]
    autoscaled = {o["spec"]["scaleTargetRef"]["name"] for o in objects
                  if o["kind"] == "HorizontalPodAutoscaler"}  # fmt: skip
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert autoscaled and autoscaled <= deployments


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_commands_parse_and_the_router_finds_every_worker(overlay):
    from ember.cli import build_parser
    from ember.engine_args import engine_options
    from ember.router.members import DnsTarget

    objects = render(overlay)
    parser = build_parser()
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    served: dict[str, tuple[dict, int, str]] = {}  # Deployment name -> (labels, port, role)
    discovered: list[DnsTarget] = []
    for obj, container in containers(objects):
        if container.get("command"):  # the Mooncake Store's programs
            assert container["command"][0] in ("mooncake_master", "mooncake_client")
            continue
        assert container["image"].startswith("ember")
        args = parser.parse_args(expanded(container["args"], container))
        ports = {p["containerPort"] for p in container["ports"]}
        assert args.port in ports and args.host == "0.0.0.0"
        if args.command == "router":
            discovered += [DnsTarget.parse(spec) for spec in args.discover]
            continue
        assert args.command == "serve"
        options = engine_options(args)
        if options["kv_role"] == "prefill":  # its KV endpoint: on the pod's address and port
            assert (options["kv_host"], options["kv_port"]) == (POD_IP, 8200)
            assert 8200 in ports
        if overlay.endswith("mooncake"):
            assert options["kv_store"] == "mooncake://ember-mooncake:50051"
            assert services["ember-mooncake"]["spec"]["ports"][0]["port"] == 50051
        labels = obj["spec"]["template"]["metadata"]["labels"]
        served[obj["metadata"]["name"]] = (labels, args.port, options["kv_role"])
    roles = {target.name: None for target in discovered}
    for target in discovered:  # a headless Service selecting that role's workers, its port
        service = services[target.name]["spec"]
        assert service["clusterIP"] == "None"
        assert [p["port"] for p in service["ports"]] == [target.port]
        matches = [(name, role) for name, (labels, port, role) in served.items()
                   if service["selector"].items() <= labels.items() and port == target.port]  # fmt: skip
        assert len(matches) == 1, (target, matches)
        roles[target.name] = matches[0][1]
    expected = {"mixed": {"mixed"}, "disaggregated": {"prefill", "decode"}}
    assert set(roles.values()) == expected.get(overlay, {"prefill", "decode"})


def test_the_placeholder_secret_is_refused(monkeypatch):
    from ember import envs

    env = (KUBERNETES / "base" / "cluster-secret.env").read_text()
    placeholder = env.strip().split("=", 1)[1]
    monkeypatch.setenv("EMBER_CLUSTER_SECRET", placeholder)
    with pytest.raises(ValueError, match="placeholder"):
        envs.cluster_secret()


def dockerfile_runs(path: Path) -> str:
    text = path.read_text().replace("\\\n", " ")
    return "\n".join(line[4:] for line in text.splitlines() if line.startswith("RUN "))


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_the_dockerfiles_install_what_the_makefile_does(name):
    import tomllib

    from ember.cli import build_parser

    dockerfile = ROOT / "deploy" / "docker" / name
    runs = dockerfile_runs(dockerfile)
    makefile = (ROOT / "Makefile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch=="))
    assert f"pip install --quiet {torch_pin}" in makefile
    assert f"pip install --no-cache-dir {torch_pin} --index-url" in runs
    assert "ember download" in runs  # the default model inside the image
    mooncake = project["optional-dependencies"]["mooncake"][0].split("==")[1]
    assert "mooncake" in runs and mooncake in runs or "'.[mooncake]'" in runs
    text = dockerfile.read_text()
    entrypoint = re.search(r"^ENTRYPOINT (.*)$", text, re.M).group(1)
    command = re.search(r"^CMD (.*)$", text, re.M).group(1)
    assert yaml.safe_load(entrypoint) == ["ember"]
    args = build_parser().parse_args(yaml.safe_load(command))
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8100
    for source in ("pyproject.toml", "ember"):
        assert re.search(rf"^COPY {re.escape(source)}\b", text, re.M), source


def test_a_package_install_carries_every_kernel_source():
    """The image installs ember as a package (not editable): the kernels build from the
    package data, which must hold every source they include."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["ember.engine.kernels"]
    kernels = ROOT / "ember" / "engine" / "kernels"
    sources = {p.name for p in kernels.iterdir() if p.suffix in (".cpp", ".h", ".hpp", ".inc")}
    carried = {p.name for pattern in patterns for p in kernels.glob(pattern)}
    assert sources and sources <= carried
    included = set(re.findall(r'#include "([^"]+)"', " ".join(
        (kernels / s).read_text() for s in sources)))  # fmt: skip
    assert included <= carried


def test_the_readme_deploys_with_these_overlays():
    readme = (ROOT / "README.md").read_text()
    for overlay in OVERLAYS:
        assert f"deploy/kubernetes/overlays/{overlay}" in readme
    commands = re.findall(r"^(kubectl [^\n]+)$", readme, re.M)
    assert any("apply -k deploy/kubernetes/overlays/" in c for c in commands)
    for command in commands:
        shlex.split(command)
