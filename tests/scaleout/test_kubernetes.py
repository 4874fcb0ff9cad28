"""The Kubernetes manifests of packaging/kubernetes (docs/scale-out.md, "Kubernetes"): valid
against the Kubernetes API schemas (kubernetes-validate, from PyPI, schemas bundled: no
network), a config gpuqd accepts, and the DaemonSet and the client pod agreeing on what they
share. Nothing here runs them on a cluster."""

from __future__ import annotations

import json
import pathlib
import subprocess
from typing import Any, Dict, List

import pytest
import yaml

import gpuq.testing
from conftest import BIN, REPO

MANIFESTS = sorted((REPO / "packaging" / "kubernetes").glob("*.yaml"))


def documents(name: str) -> List[Dict[str, Any]]:
    return [d for d in yaml.safe_load_all((REPO / "packaging" / "kubernetes" / name).read_text())
            if d]


def one(docs: List[Dict[str, Any]], kind: str) -> Dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(manifest: pathlib.Path):
    p = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "--quiet", str(manifest)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_daemonset_config_passes_gpuqd_check(tmp_path: pathlib.Path):
    config = one(documents("gpuqd.yaml"), "ConfigMap")["data"]["gpuqd.json"]
    path = tmp_path / "gpuqd.json"
    path.write_text(config)
    p = subprocess.run([gpuq.testing.find_gpuqd(), "--check-config", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_client_pod_reaches_the_daemonsets_gpuqd():
    docs = documents("gpuqd.yaml")
    config = json.loads(one(docs, "ConfigMap")["data"]["gpuqd.json"])
    daemon = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    client = one(documents("client-pod.yaml"), "Pod")["spec"]

    def host_path(spec: Dict[str, Any], container: Dict[str, Any], mount_path: str) -> str:
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == mount_path]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        return volume["hostPath"]["path"]

    (gpuqd,) = [c for c in daemon["containers"] if c["name"] == "gpuqd"]
    runtime_dir = gpuqd["args"][gpuqd["args"].index("--runtime-dir") + 1]
    (app,) = client["containers"]
    client_dir = {e["name"]: e["value"] for e in app["env"]}["GPUQ_RUNTIME_DIR"]
    # The same node directory, the daemon's runtime directory and the clients' GPUQ_RUNTIME_DIR.
    assert host_path(daemon, gpuqd, runtime_dir) == host_path(client, app, client_dir)
    # The node's /dev/shm, where the queue segment is.
    assert daemon["hostIPC"] is True and client["hostIPC"] is True
    # The daemon's group owns the directory and socket; the client's primary group is admitted.
    assert config["group"] == daemon["securityContext"]["runAsGroup"]
    assert client["securityContext"]["runAsGroup"] in config["allowed_groups"]
    assert client["nodeSelector"] == daemon["nodeSelector"]
    # The GPUs through the device plugin, to the daemon only.
    assert int(gpuqd["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert "nvidia.com/gpu" not in str(app.get("resources", {}))
