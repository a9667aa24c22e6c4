"""The deployment files agree with each other and with the code (no helm, docker or envoy binary
here): the chart's values against values.schema.json, every value a template names exists,
envoy.yaml against the proto, the descriptor and the chart, the chart's FORGE_* variables against
the configuration dataclasses, the Dockerfiles' install step against CI's, and the runtime
dependencies against what the code imports."""
from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from google.protobuf import descriptor_pb2

from forge_gateway.config import GatewayConfig
from forge_service import config as service_config
from forge_service.pb import generate
from forge_service.server import SERVICE_NAME

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "forge"
TEMPLATES = CHART / "templates"
DESCRIPTOR = ROOT / "forge_service" / "pb" / "forge_descriptor.pb"
RELEASE = "forge"  # the release name envoy.yaml at the root is rendered for


def values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of an override file over values.yaml: maps merge, null deletes, the rest replaces."""
    out = dict(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f".Values.{dotted} is not in values.yaml"
        node = node[part]
    return node


def render_simple(text: str, release: str, vals: dict[str, Any]) -> str:
    """A template that uses only {{ .Release.Name }} and {{ .Values.x.y }}, rendered."""
    text = re.sub(r"\{\{\s*\.Release\.Name\s*\}\}", release, text)
    text = re.sub(r"\{\{\s*\.Values\.([\w.]+)\s*\}\}", lambda m: str(lookup(vals, m.group(1))), text)
    assert "{{" not in text, "files/envoy.yaml may use only {{ .Release.Name }} and {{ .Values.* }}"
    return text


def example_files() -> list[Path]:
    return sorted((CHART / "examples").glob("*.yaml"))


# ---- values and the schema ----------------------------------------------------------------

@pytest.mark.parametrize("example", [None, *example_files()], ids=lambda p: p.name if p else "values.yaml")
def test_values_and_examples_validate_against_the_schema(example: Path | None) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    vals = values() if example is None else merged(values(), yaml.safe_load(example.read_text()))
    jsonschema.Draft7Validator(schema).validate(vals)
    service = vals["service"]
    assert service["terminationGracePeriodSeconds"] > service["drainTimeoutSeconds"]


@pytest.mark.parametrize("override, where", [
    ({"service": {"grpcPort": "50051"}}, "grpcPort"),
    ({"service": {"replica": 2}}, "replica"),
    ({"gateway": {"readyTimeoutSeconds": 0}}, "readyTimeoutSeconds"),
    ({"service": {"env": {"MODEL": "x"}}}, "MODEL"),
    ({"autoscaling": {"requestsWaiting": {"metricName": "requests waiting"}}}, "metricName"),
])
def test_the_schema_refuses_wrong_values(override: dict[str, Any], where: str) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError, match=where):
        jsonschema.Draft7Validator(schema).validate(merged(values(), override))


# ---- templates ---------------------------------------------------------------------------

def template_texts() -> dict[str, str]:
    texts = {p.name: p.read_text() for p in TEMPLATES.iterdir() if p.suffix in (".yaml", ".tpl")}
    texts["files/envoy.yaml"] = (CHART / "files" / "envoy.yaml").read_text()
    return texts


def test_every_value_a_template_names_is_in_values_yaml() -> None:
    vals = values()
    names = {m for text in template_texts().values() for m in re.findall(r"\.Values\.([\w.]+)", text)}
    assert len(names) > 30
    for name in names:
        lookup(vals, name)


def test_template_blocks_are_closed() -> None:
    for name, text in template_texts().items():
        actions = re.findall(r"\{\{-?\s*(if|range|with|define|end)\b", text)
        opened = sum(a != "end" for a in actions)
        assert opened == actions.count("end"), f"{name}: {opened} blocks opened, {actions.count('end')} closed"
        assert "{{" not in re.sub(r"\{\{.*?\}\}", "", text, flags=re.S), f"{name}: an action is not closed"


def test_probes_and_scrapes_name_the_real_service_routes_and_ports() -> None:
    service = (TEMPLATES / "service-deployment.yaml").read_text()
    gateway = (TEMPLATES / "gateway-deployment.yaml").read_text()
    startup = re.search(r"startupProbe:\s*\n\s*grpc: \{port: [^,]+, service: ([\w.]+)\}", service)
    assert startup and startup.group(1) == SERVICE_NAME  # readiness, not liveness: the model has loaded
    assert re.search(r"readinessProbe:\s*\n\s*grpc: \{port: [^,]+, service: forge\.v1\.Forge\}", service)
    assert 'prometheus.io/port: "{{ .Values.service.metricsPort }}"' in service
    assert "containerPort: {{ .Values.service.metricsPort }}" in service
    assert 'prometheus.io/port: "{{ .Values.gateway.httpPort }}"' in gateway
    from forge_gateway.app import create_app

    paths = {getattr(r, "path", None) for r in create_app(GatewayConfig()).routes}
    for probe, path in re.findall(r"(livenessProbe|readinessProbe):\s*\n\s*httpGet: \{path: (/\w+)", gateway):
        assert path in paths, f"the gateway's {probe} asks for {path}, which it does not serve"
    assert "dns:///{{ .Release.Name }}-service-headless:{{ .Values.service.grpcPort }}" in gateway
    assert "name: {{ .Release.Name }}-service-headless" in service and "clusterIP: None" in service


def _env_names(text: str) -> set[str]:
    return set(re.findall(r"name: (FORGE_[A-Z0-9_]+)", text))


def _fields(*classes: type) -> set[str]:
    return {"FORGE_" + f.name.upper() for cls in classes for f in fields(cls)}


def test_every_forge_variable_the_chart_sets_is_a_configuration_field() -> None:
    engine = (service_config.ServiceConfig, service_config.ModelConfig, service_config.CacheConfig,
              service_config.SchedulerConfig, service_config.EngineConfig)
    service_vars = _env_names((TEMPLATES / "service-deployment.yaml").read_text())
    for example in [None, *example_files()]:
        vals = values() if example is None else merged(values(), yaml.safe_load(example.read_text()))
        service_vars |= set(vals["service"]["env"])
    gateway_vars = _env_names((TEMPLATES / "gateway-deployment.yaml").read_text())
    missing = (service_vars - _fields(*engine)) | (gateway_vars - _fields(GatewayConfig))
    assert not missing, f"not configuration fields: {sorted(missing)}"


# ---- Envoy -------------------------------------------------------------------------------

def envoy() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "envoy.yaml").read_text())


def test_envoy_yaml_is_the_charts_envoy_config_rendered_for_the_default_values() -> None:
    rendered = render_simple((CHART / "files" / "envoy.yaml").read_text(), RELEASE, values())
    assert yaml.safe_load(rendered) == envoy(), "envoy.yaml differs from helm/forge/files/envoy.yaml rendered"


def _http_filters(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return {f["name"]: f["typed_config"] for f in manager["http_filters"]}


def _descriptor() -> descriptor_pb2.FileDescriptorSet:
    return descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR.read_bytes())


def test_envoy_reads_the_descriptor_where_the_chart_mounts_it() -> None:
    transcoder = _http_filters(envoy())["envoy.filters.http.grpc_json_transcoder"]
    chart = (TEMPLATES / "envoy.yaml").read_text()
    mount = re.search(r"\{name: descriptor, mountPath: ([^,]+),", chart)
    key = re.search(r"binaryData:\s*\n\s*([\w.]+):", chart)
    assert mount and key
    assert transcoder["proto_descriptor"] == f"{mount.group(1)}/{key.group(1)}"
    config_mount = re.search(r"\{name: config, mountPath: ([^,]+),", chart)
    assert config_mount and f'"-c", "{config_mount.group(1)}"' in chart


def test_the_transcoder_serves_the_protos_services_and_routes_their_paths_to_the_service() -> None:
    config = envoy()
    transcoder = _http_filters(config)["envoy.filters.http.grpc_json_transcoder"]
    services = {f"{f.package}.{s.name}" for f in _descriptor().file for s in f.service}
    assert transcoder["services"] == [SERVICE_NAME] and SERVICE_NAME in services
    forge = next(f for f in _descriptor().file if f.name == generate.PROTO_FILE)
    from google.api import annotations_pb2

    http_paths = []
    for method in forge.service[0].method:
        rule = method.options.Extensions[annotations_pb2.http]
        http_paths.append(getattr(rule, rule.WhichOneof("pattern")))
    assert len(http_paths) == len(forge.service[0].method)
    for path in http_paths:
        assert envoy_cluster_for(path) == "forge_service", path
    assert envoy_cluster_for(f"/{SERVICE_NAME}/Generate") == "forge_service"
    assert envoy_cluster_for("/v1/chat/completions") == "forge_gateway"


def envoy_cluster_for(path: str) -> str | None:
    """The cluster envoy.yaml's public listener sends `path` to (its first matching route)."""
    routes = envoy()["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    for route in routes:
        match = route["match"]
        if path == match.get("path") or ("prefix" in match and path.startswith(match["prefix"])):
            return route["route"]["cluster"]
    return None


def test_envoy_sends_every_api_route_of_the_gateway_to_it() -> None:
    from forge_gateway.app import create_app
    from forge_gateway.config import GatewayConfig

    app = create_app(GatewayConfig(target="127.0.0.1:1"))
    probes = {"/health", "/livez", "/metrics"}  # Kubernetes probes the gateway's own port
    paths = [re.sub(r"\{[^}]*\}", "x", r.path) for r in app.routes  # /v1/models/{model:path} -> /v1/models/x
             if getattr(r, "include_in_schema", False) and r.path not in probes]
    assert {"/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"} <= set(paths)
    for path in paths:
        assert envoy_cluster_for(path) == "forge_gateway", path


def test_envoy_clusters_and_listeners_use_the_charts_names_and_ports() -> None:
    vals, config = values(), envoy()
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}

    def address(name: str) -> tuple[str, int]:
        socket = clusters[name]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"]
        return socket["address"], socket["port_value"]

    assert address("forge_service") == (f"{RELEASE}-service-headless", vals["service"]["grpcPort"])
    assert address("forge_gateway") == (f"{RELEASE}-gateway", vals["gateway"]["servicePort"])
    assert clusters["forge_service"]["health_checks"][0]["grpc_health_check"]["service_name"] == SERVICE_NAME
    ports = [listener["address"]["socket_address"]["port_value"] for listener in config["static_resources"]["listeners"]]
    assert ports == [vals["envoy"]["port"], vals["envoy"]["healthPort"]]


# ---- the descriptor ----------------------------------------------------------------------

def test_the_charts_descriptor_is_the_committed_one_and_matches_the_proto(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    fresh = (tmp_path / "forge_descriptor.pb").read_bytes()
    assert DESCRIPTOR.read_bytes() == fresh, "forge_service/pb/forge_descriptor.pb drifted: run `make proto`"
    assert (CHART / "files" / "forge_descriptor.pb").read_bytes() == fresh, \
        "helm/forge/files/forge_descriptor.pb drifted: run `make proto`"


# ---- the image ---------------------------------------------------------------------------

def _make_prerequisites(target: str) -> list[str]:
    line = re.search(rf"^{target}:([^\n]*)$", (ROOT / "Makefile").read_text(), re.M)
    assert line, f"no `{target}` target in the Makefile"
    return line.group(1).split()


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_the_image_installs_with_the_make_target_ci_runs(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    runs = re.findall(r"^RUN (.*?)(?<!\\)$", text, re.M | re.S)
    installs = [r for r in runs if re.search(r"\bmake install\b", r)]
    assert len(installs) == 1 and not any("pip install" in r for r in runs), "install only through `make install`"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\b", ci, re.M)
    # `make test` installs through the same stamp recipe that `make install` is.
    assert _make_prerequisites("install") == ["$(STAMP)"] and "$(STAMP)" in _make_prerequisites("test")
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for name in source.split():
            assert (ROOT / name).exists(), f"{dockerfile} copies {name}, which does not exist"
    copied = " ".join(re.findall(r"^COPY (?!--from)(.+)$", text, re.M))
    for package in ("forge_service", "forge_gateway", "native", "proto"):
        assert package in copied
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}
    vals = values()
    assert {vals["service"]["grpcPort"], vals["service"]["metricsPort"], vals["gateway"]["httpPort"]} <= exposed
    assert re.search(r"^USER 10001", text, re.M)


def _requirement_name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def test_every_package_the_code_imports_at_load_is_a_runtime_dependency() -> None:
    """The images install no extras: a module-level import of a package that only the test extras
    bring (jsonschema once was) would stop `forge serve` in the image at start-up."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_requirement_name(r) for r in project["dependencies"]}
    providers = {module: {_requirement_name(d) for d in dists}
                 for module, dists in importlib.metadata.packages_distributions().items()}
    missing = set()
    for path in sorted((ROOT / "forge_service").rglob("*.py")) + sorted((ROOT / "forge_gateway").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level: imported whenever the module is
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names):
                if top not in ("__future__", "forge_service", "forge_gateway") and not providers.get(top, set()) & declared:
                    missing.add(f"{top} ({path.relative_to(ROOT)})")
    assert not missing, f"imported at load but not in [project].dependencies: {sorted(missing)}"


def test_dockerignore_keeps_the_venv_and_git_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    for needed in ("forge_service", "forge_gateway", "native", "proto", "Makefile", "pyproject.toml"):
        assert needed not in ignored
