"""Kubernetes without a cluster, for tests: the API's own models as the validator, and
real KubeSpawner-based spawners of real Hub users.

No test here talks to a Kubernetes API server (none can run on CI's machine). What
would reach one is checked against the Kubernetes API's OpenAPI models as the
``kubernetes_asyncio`` client generates them: :func:`round_trip` reads a document into
its model and writes it back, and a document is valid when nothing changed on the way.
A misspelled or misplaced field is dropped by the model, a string where the API wants
an integer comes back as an integer, and a required field that is missing raises, so
each shows up as a difference or an error.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

from jupyterhub import orm
from jupyterhub.objects import Hub
from jupyterhub.user import User
from kubernetes_asyncio.client import ApiClient

#: A kubeconfig whose server is never contacted: KubeSpawner loads one when created.
KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters:
- name: none
  cluster: {server: "https://127.0.0.1:9"}
users:
- name: none
  user: {token: "never-sent"}
contexts:
- name: none
  context: {cluster: none, user: none, namespace: jhub}
current-context: none
"""

#: Model class of each (apiVersion, kind) our manifests use.
MODELS = {
    ("v1", "Pod"): "V1Pod",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "Node"): "V1Node",
    ("apps/v1", "DaemonSet"): "V1DaemonSet",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
    ("resource.k8s.io/v1", "ResourceClaimTemplate"): "V1ResourceClaimTemplate",
    ("resource.k8s.io/v1", "ResourceClaim"): "ResourceV1ResourceClaim",
}


async def round_trip_async(document: dict, model: str | None = None) -> dict:
    """``document`` read into its Kubernetes model and written back (camelCase JSON).

    Args:
        document: an object as the API takes it.
        model: the model class (``"V1Pod"``); default: from ``apiVersion`` and ``kind``.

    Raises:
        ValueError: a required field is missing (the model says which).
        KeyError: no model for the document's kind here.
    """
    model = model or MODELS[(document.get("apiVersion"), document.get("kind"))]
    async with ApiClient() as client:
        read = client._ApiClient__deserialize(copy.deepcopy(document), model)
        return client.sanitize_for_serialization(read)


def round_trip(document: dict, model: str | None = None) -> dict:
    """:func:`round_trip_async` outside an event loop."""
    return asyncio.run(round_trip_async(document, model))


def use_kubeconfig(monkeypatch, folder: Path) -> Path:
    """Point the Kubernetes client at :data:`KUBECONFIG` (it reads ``$KUBECONFIG`` once,
    at import)."""
    import kubernetes_asyncio.config.kube_config as kube_config

    path = folder / "kubeconfig"
    path.write_text(KUBECONFIG, encoding="utf-8")
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    return path


def new_hub_db(path: Path, users=("ada", "bob"), groups=()):
    """A session on a new Hub database with these users and groups."""
    db = orm.new_session_factory(f"sqlite:///{path}")()
    for name in users:
        db.add(orm.User(name=name))
    for name in groups:
        db.add(orm.Group(name=name))
    db.commit()
    return db


def spawner_of(db, name: str, spawner_class, config):
    """The default server's spawner of user ``name``, made the way the Hub makes it
    (``jupyterhub.user.User`` and its spawner factory). Call inside an event loop."""
    user = User(
        orm.User.find(db, name),
        settings={"spawner_class": spawner_class, "hub": Hub(), "config": config, "base_url": "/"},
    )
    return user.spawners[""]
