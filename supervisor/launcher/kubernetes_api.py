"""The official `kubernetes` client, imported only when a Kubernetes launcher is used (the `[kubernetes]` extra)."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from supervisor.errors import UserError

#: How to get the client when it is missing.
INSTALL_HINT = "pip install 'rollback-supervisor[kubernetes]'"


def client_module() -> ModuleType:
    """`kubernetes.client`, or a UserError naming the extra that installs it."""
    try:
        import kubernetes.client
    except ImportError as exc:
        raise UserError(
            f"kubernetes launcher: the `kubernetes` Python client is not installed ({exc}); install it with "
            f"`{INSTALL_HINT}`, or choose another launcher"
        ) from None
    return kubernetes.client


def api_client(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """An ApiClient for the cluster: in a pod its service account, else the kubeconfig (file and context)."""
    client = client_module()
    from kubernetes import config

    configuration = client.Configuration()
    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        try:
            config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=configuration
            )
        except (config.ConfigException, OSError) as exc:
            raise UserError(
                f"kubernetes launcher: cannot load the kubeconfig {kubeconfig or '~/.kube/config'!r} "
                f"(context {context or 'current'}): {exc}; set launcher.kubernetes.kubeconfig/context"
            ) from None
    return client.ApiClient(configuration)


def to_dict(api: Any, obj: Any) -> Any:
    """A client model as the JSON the API speaks (camelCase keys, no nulls)."""
    return api.sanitize_for_serialization(obj)
