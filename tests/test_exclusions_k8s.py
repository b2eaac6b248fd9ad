"""Excluded hosts through the real `kubernetes` client and the suite's API stand-in: the Job sent carries the
node anti-affinity, the segment's exit names the node its pod ran on, and a service account that may not list
nodes leaves the pool unknown (the exclusion is then taken as named)."""

from __future__ import annotations

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes launcher needs `pip install '.[kubernetes]'`")

from supervisor.launcher.base import LaunchSpec  # noqa: E402
from supervisor.lineage.exclusions import HostPool  # noqa: E402
from tests.k8s_api_server import k8s_api_server  # noqa: E402
from tests.test_kubernetes_launcher import launcher_for  # noqa: E402


def test_the_job_sent_avoids_the_excluded_nodes_and_its_exit_names_its_node():
    with k8s_api_server() as (url, cluster):
        launcher = launcher_for(url, nodes=1)
        assert launcher.host_pool() == HostPool(1, None)  # the stand-in, like rbac.yaml, does not list nodes
        spec = LaunchSpec(("python", "train.py"), name="lin-4", exclude_hosts=("node-b",))
        job = launcher.start(spec)
        sent = cluster.jobs[("training", job.name)]["spec"]["template"]["spec"]
        term = sent["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["nodeSelectorTerms"][0]["matchExpressions"] == [
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-b"]}
        ]
        (pod,) = cluster.pods_of(job.name)
        cluster.run_pod(pod, node="node-a")
        assert job.started()
        cluster.end_pod(pod, 1)
        info = job.wait(20)
        assert (info.returncode, info.hosts) == (1, ("node-a",))
