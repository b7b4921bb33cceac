"""kopf's credentials (the operator's login handler) from every way the official client can be
configured. In a pod, the client keeps the service-account token under api_key['BearerToken']
and re-reads the rotating token file through its refresh hook: a login that looked elsewhere
talked to the API server as system:anonymous."""

from __future__ import annotations

import base64
import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator]')")

import kopf  # noqa: E402
import kubernetes  # noqa: E402
import yaml  # noqa: E402
from kubernetes.config import incluster_config  # noqa: E402

from hivekeeper_operator.kube import Kube  # noqa: E402
from hivekeeper_operator.reconcile import OperatorConfig  # noqa: E402
from hivekeeper_operator.runtime import Operator  # noqa: E402

CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def login_handler_info(configuration: Any) -> kopf.ConnectionInfo:
    """What the operator's registered login handler returns for this client configuration."""
    operator = Operator(OperatorConfig(metrics_port=None, kinds=()),
                        kube=Kube(kubernetes.client.ApiClient(configuration)))
    handlers = [h for h in operator.registry._activities.get_all_handlers() if h.activity == "authentication"]
    assert len(handlers) == 1
    info = handlers[0].fn()
    assert isinstance(info, kopf.ConnectionInfo)
    return info


def in_cluster(tmp_path: Path, token: str) -> tuple[Any, Path, incluster_config.InClusterConfigLoader]:
    """A Configuration as load_incluster_config makes one in a pod (with its refresh hook)."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(token)
    (account / "ca.crt").write_text(CA)
    loader = incluster_config.InClusterConfigLoader(
        token_filename=str(account / "token"), cert_filename=str(account / "ca.crt"),
        environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    configuration = kubernetes.client.Configuration()
    loader.load_and_set(configuration)
    assert configuration.refresh_api_key_hook is not None
    return configuration, account / "token", loader


def kubeconfig(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Any:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://k8s.example.org:6443", **(cluster or {})}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(path), client_configuration=configuration)
    return configuration


def test_in_cluster_service_account_token(tmp_path):
    configuration, _, _ = in_cluster(tmp_path, "sa-token-1")
    info = login_handler_info(configuration)
    assert info.server == "https://10.96.0.1:443"
    assert (info.scheme.lower(), info.token) == ("bearer", "sa-token-1")
    assert info.as_http_headers() == {"Authorization": "bearer sa-token-1"}
    assert Path(info.ca_path).read_text() == CA and not info.insecure
    assert (info.username, info.password) == (None, None)


def test_a_rotated_token_file_is_read_at_the_next_login(tmp_path, monkeypatch):
    """kubelet rewrites the projected token; kopf logs in again (on a 401) and gets the new one."""
    configuration, token_file, _ = in_cluster(tmp_path, "sa-token-1")
    assert login_handler_info(configuration).token == "sa-token-1"
    token_file.write_text("sa-token-2")

    # The client re-reads the file once its copy is a minute old: move its clock on.
    later = datetime.datetime.now() + datetime.timedelta(minutes=2)

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206
            return later

    monkeypatch.setattr(incluster_config, "datetime", SimpleNamespace(datetime=Clock, timedelta=datetime.timedelta))
    assert login_handler_info(configuration).token == "sa-token-2"


def test_kubeconfig_token(tmp_path):
    info = login_handler_info(kubeconfig(tmp_path, {"token": "kc-token"}))
    assert (info.server, info.scheme, info.token) == ("https://k8s.example.org:6443", "Bearer", "kc-token")


def test_kubeconfig_token_file(tmp_path):
    (tmp_path / "token").write_text("file-token")
    info = login_handler_info(kubeconfig(tmp_path, {"tokenFile": str(tmp_path / "token")}))
    assert info.as_http_headers() == {"Authorization": "Bearer file-token"}


def test_exec_plugin_token(tmp_path):
    plugin = tmp_path / "plugin.sh"
    plugin.write_text('#!/bin/sh\necho \'{"apiVersion": "client.authentication.k8s.io/v1beta1", '
                      '"kind": "ExecCredential", "status": {"token": "exec-token"}}\'\n')
    plugin.chmod(0o755)
    info = login_handler_info(kubeconfig(tmp_path, {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1beta1", "command": str(plugin)}}))
    assert (info.scheme, info.token) == ("Bearer", "exec-token")


def test_client_certificate(tmp_path):
    (tmp_path / "client.crt").write_text("CERT")
    (tmp_path / "client.key").write_text("KEY")
    (tmp_path / "ca.crt").write_text(CA)
    info = login_handler_info(kubeconfig(
        tmp_path, {"client-certificate": str(tmp_path / "client.crt"), "client-key": str(tmp_path / "client.key")},
        {"certificate-authority": str(tmp_path / "ca.crt")}))
    assert Path(info.certificate_path).read_text() == "CERT"
    assert Path(info.private_key_path).read_text() == "KEY"
    assert Path(info.ca_path).read_text() == CA
    assert info.as_http_headers() == {}


def test_basic_auth(tmp_path):
    info = login_handler_info(kubeconfig(tmp_path, {"username": "admin", "password": "s3cret"},
                                         {"insecure-skip-tls-verify": True}))
    assert info.insecure is True
    expected = "Basic " + base64.b64encode(b"admin:s3cret").decode()
    assert info.as_http_headers() == {"Authorization": expected}


def test_configuration_set_by_hand():
    """api_key with a separate prefix, or username/password on the Configuration itself."""
    by_key = kubernetes.client.Configuration(host="https://h", api_key={"BearerToken": "raw"},
                                             api_key_prefix={"BearerToken": "Bearer"})
    assert login_handler_info(by_key).as_http_headers() == {"Authorization": "Bearer raw"}
    bare = kubernetes.client.Configuration(host="https://h", api_key={"BearerToken": "raw"})
    assert login_handler_info(bare).as_http_headers() == {"Authorization": "Bearer raw"}
    basic = kubernetes.client.Configuration(host="https://h", username="u", password="p")
    info = login_handler_info(basic)
    assert (info.username, info.password, info.token) == ("u", "p", None)
