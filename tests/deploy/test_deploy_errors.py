"""kubetune's errors for a cluster that lacks what a target needs point at deploy/install.sh, and
at the option that installs it: PyTorchJob comes with every install.sh run, TrainJob (Kubeflow
Trainer v2 and JobSet) only with --with trainer. Against the FAKE API server (tests/fakes): the
cluster answers 404 for the job resource, as kube-apiserver does for a CRD that is not installed."""

from __future__ import annotations

import pytest
from fakes.kube_api import FakeKubeAPI

from kubetune import Client
from kubetune.errors import KubetuneError

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "target,fix",
    [
        ("pytorchjob", "deploy/install.sh"),
        ("trainjob", "deploy/install.sh --with trainer"),
    ],
)
def test_a_cluster_without_the_target_is_told_how_install_sh_installs_it(tmp_path, target, fix):
    with FakeKubeAPI() as server:
        client = Client(
            backend="kubeflow",
            kubeconfig=str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace="kubetune")),
            target=target,
        )
        server.fail_next(404)
        with pytest.raises(KubetuneError) as err:
            client.list()
    assert "not served by this cluster" in str(err.value)
    assert fix in (err.value.fix or ""), err.value.fix
    if target == "pytorchjob":
        assert "--with" not in err.value.fix  # the default install has the Training Operator
