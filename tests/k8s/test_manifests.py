"""KubeRay manifests validated offline against KubeRay's CRD schemas and Ray's Serve schema."""

from __future__ import annotations

import copy
import functools
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.conftest import ROOT, data_path

MANIFESTS = sorted((ROOT / "k8s").glob("*.yaml"))
KIND_TO_CRD = {"RayService": "ray.io_rayservices.yaml", "RayJob": "ray.io_rayjobs.yaml",
               "RayCluster": "ray.io_rayclusters.yaml"}


# The CRDs are megabytes of YAML: parse each once, with libyaml's loader where PyYAML has it.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache
def crd_schema(kind: str) -> dict:
    crd = yaml.load((data_path("k8s/kuberay-crds") / KIND_TO_CRD[kind]).read_text(), Loader=SAFE_LOADER)
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]


def errors(doc: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(crd_schema(doc["kind"]))
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc))


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_there_are_manifests():
    kinds = sorted(load(p)["kind"] for p in MANIFESTS)
    assert kinds == ["RayJob", "RayService", "RayService", "RayService"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_crd(path):
    doc = load(path)
    assert doc["apiVersion"] == "ray.io/v1"
    assert errors(doc) == []


def test_broken_manifest_fails_with_expected_errors():
    doc = copy.deepcopy(load(ROOT / "k8s" / "rayservice.yaml"))
    group = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["replicas"] = "two"
    del group["template"]["spec"]["containers"]
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0
    errs = errors(doc)
    assert any("replicas" in e and "'two' is not of type 'integer'" in e for e in errs), errs
    assert any("'containers' is a required property" in e for e in errs), errs
    assert any("num-gpus" in e and "is not of type 'string'" in e for e in errs), errs


def serve_configs() -> list[tuple[str, dict]]:
    out = [("deploy/serve_config.yaml", yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text()))]
    for p in MANIFESTS:
        doc = load(p)
        if doc["kind"] == "RayService":
            out.append((p.name, yaml.safe_load(doc["spec"]["serveConfigV2"])))
    return out


@pytest.mark.parametrize("name, config", serve_configs(), ids=lambda x: x if isinstance(x, str) else "")
def test_serve_config_is_valid_and_builds(name, config):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else \
        ServeDeploySchema.parse_obj(config)
    for app in config["applications"]:
        module, attr = app["import_path"].split(":")
        builder = getattr(__import__(module, fromlist=[attr]), attr)
        bound = builder(app["args"])  # validates every arg; binding starts no engine
        assert type(bound).__name__ == "Application"


def test_serve_configs_agree():
    configs = serve_configs()
    local = configs[0][1]["applications"][0]
    for name, cfg in configs[1:]:
        app = cfg["applications"][0]
        assert app["import_path"] == local["import_path"], name
        fleet_size = {"num_engines", "min_engines", "max_engines", "prefill_engines", "decode_engines"}
        assert set(app["args"]) - {"enable_dp_attention", "dp_group_size", "served_model_name"} - fleet_size <= set(
            local["args"]) | {"model_path"}, name
    from deploy.options import AppArgs

    known = AppArgs.flat_fields()
    for name, cfg in configs:
        assert set(cfg["applications"][0]["args"]) <= known, name


def test_rayjob_entrypoint_parses_with_batch_cli():
    from cluster.batch import build_parser

    doc = load(ROOT / "k8s" / "rayjob-batch.yaml")
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "cluster", "batch"]
    args = build_parser().parse_args(argv[4:])
    assert args.input == "/data/prompts" and args.output == "/data/results" and args.num_engines == 2
    assert doc["spec"]["shutdownAfterJobFinishes"] is True


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_ray_token_auth_guards_the_dashboard(path):
    """The head listens on all the pod's interfaces (the dashboard and its Jobs API for KubeRay's
    operator, the GCS, Ray Client), so Ray's token auth must be on: otherwise any pod reaching port
    8265 submits jobs that see the API-key Secret."""
    doc = load(path)
    cluster = doc["spec"]["rayClusterConfig" if doc["kind"] == "RayService" else "rayClusterSpec"]
    assert cluster.get("authOptions") == {"mode": "token", "secretName": "radixray-ray-auth"}
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            ports = {p["containerPort"] for p in container.get("ports", [])}
            # Nothing here uses Ray Client: its port is not named (the head still listens there;
            # token auth is what guards it).
            assert 10001 not in ports, f"{path.name}: Ray Client's port is published"
            # A hand-set RAY_AUTH_MODE would fight KubeRay's own (it sets it from authOptions).
            assert "RAY_AUTH_MODE" not in {e["name"] for e in container.get("env", [])}
