"""The fake Kubernetes API server answers the real `kubernetes` client the way kube-apiserver does.

Each test reaches the fake over HTTP through a kubeconfig, with its own ApiClient, so no client
configuration leaks between tests.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes.kube_api import FakeKubeAPI
from kubernetes import client, config, watch
from kubernetes.client import ApiClient, ApiException

NS = "team-a"
GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
JOBS = f"{GROUP}/{VERSION}"


@pytest.fixture
def fake_kube() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI() as server:
        yield server


@pytest.fixture
def kubeconfig(fake_kube: FakeKubeAPI, tmp_path: Path) -> Path:
    return fake_kube.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
def api_client(kubeconfig: Path) -> Iterator[ApiClient]:
    api = config.new_client_from_config(config_file=str(kubeconfig))
    yield api
    api.close()


@pytest.fixture
def core(api_client: ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


@pytest.fixture
def custom(api_client: ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client)


def _job(name: str) -> dict[str, Any]:
    """The smallest PyTorchJob the v1.8.1 CRD and webhook admit."""
    pod = {"spec": {"containers": [{"name": "pytorch", "image": "busybox"}]}}
    return {
        "apiVersion": JOBS,
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 2, "template": pod}}},
    }


def _pod(name: str, labels: dict[str, str] | None = None, containers: tuple[str, ...] = ("main",)) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [{"name": c, "image": "trainer:1"} for c in containers]},
        "status": {"phase": "Running"},
    }


def _status(err: ApiException) -> dict[str, Any]:
    return json.loads(err.body)


def _after(delay: float, action: Any) -> threading.Timer:
    timer = threading.Timer(delay, action)
    timer.start()
    return timer


def test_kubeconfig_points_the_client_at_the_fake(
    fake_kube: FakeKubeAPI, kubeconfig: Path, api_client: ApiClient
) -> None:
    _, active = config.list_kube_config_contexts(config_file=str(kubeconfig))
    assert active["name"] == "fake" and active["context"]["namespace"] == NS

    assert client.VersionApi(api_client).get_code().git_version.startswith("v1.")
    assert client.CoreApi(api_client).get_api_versions().versions == ["v1"]
    groups = {g.name for g in client.ApisApi(api_client).get_api_versions().groups}
    assert {"apps", "kubeflow.org", "trainer.kubeflow.org"} <= groups

    # the kubeconfig's token is what gets a request in
    with pytest.raises(urllib.error.HTTPError) as anonymous:
        urllib.request.urlopen(f"{fake_kube.url}/api/v1/namespaces/{NS}/pods")
    anonymous.value.close()
    assert anonymous.value.code == 401


def test_configmap_create_get_list_delete(core: client.CoreV1Api) -> None:
    body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="params"), data={"lr": "0.1"})
    created = core.create_namespaced_config_map(NS, body)
    assert created.metadata.uid and created.metadata.creation_timestamp
    assert created.metadata.namespace == NS and int(created.metadata.resource_version) > 0

    assert core.read_namespaced_config_map("params", NS).data == {"lr": "0.1"}
    generated = core.create_namespaced_config_map(
        NS, client.V1ConfigMap(metadata=client.V1ObjectMeta(generate_name="run-"))
    )
    assert generated.metadata.name.startswith("run-") and len(generated.metadata.name) == len("run-") + 5
    assert [cm.metadata.name for cm in core.list_namespaced_config_map(NS).items] == sorted(
        ["params", generated.metadata.name]
    )

    deleted = core.delete_namespaced_config_map("params", NS)
    assert deleted.status == "Success" and deleted.details.uid == created.metadata.uid
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_config_map("params", NS)
    assert missing.value.status == 404
    assert _status(missing.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'configmaps "params" not found',
        "reason": "NotFound",
        "details": {"name": "params", "kind": "configmaps"},
        "code": 404,
    }


def test_pytorchjob_create_get_list_patch_delete(custom: client.CustomObjectsApi) -> None:
    created = custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, _job("myjob"))
    meta = created["metadata"]
    assert set(meta) >= {"uid", "resourceVersion", "creationTimestamp", "namespace"} and meta["namespace"] == NS

    assert custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "myjob")["metadata"]["uid"] == meta["uid"]
    listed = custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)
    assert listed["kind"] == "PyTorchJobList" and [j["metadata"]["name"] for j in listed["items"]] == ["myjob"]
    assert int(listed["metadata"]["resourceVersion"]) >= int(meta["resourceVersion"])

    patched = custom.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "myjob", {"spec": {"runPolicy": {"suspend": True}}}
    )
    assert patched["spec"]["runPolicy"] == {"suspend": True} and "pytorchReplicaSpecs" in patched["spec"]
    assert int(patched["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])

    deleted = custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "myjob")
    assert deleted["status"] == "Success" and deleted["details"]["uid"] == meta["uid"]
    with pytest.raises(ApiException) as missing:
        custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "myjob")
    assert missing.value.status == 404
    status = _status(missing.value)
    assert status["reason"] == "NotFound" and status["message"] == 'pytorchjobs.kubeflow.org "myjob" not found'
    assert status["details"] == {"name": "myjob", "group": "kubeflow.org", "kind": "pytorchjobs"}


def test_duplicate_create_is_409_already_exists(custom: client.CustomObjectsApi) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, _job("myjob"))
    with pytest.raises(ApiException) as duplicate:
        custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, _job("myjob"))
    assert duplicate.value.status == 409
    status = _status(duplicate.value)
    assert (
        status["reason"] == "AlreadyExists" and status["message"] == 'pytorchjobs.kubeflow.org "myjob" already exists'
    )


def test_status_subresource_and_stale_replace(custom: client.CustomObjectsApi) -> None:
    created = custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, _job("myjob"))
    running = {"conditions": [{"type": "Running", "status": "True"}]}
    assert (
        custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PLURAL, "myjob", {"status": running})["status"]
        == running
    )

    # writes to the main resource leave status alone, as with a CRD's status subresource
    patched = custom.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "myjob", {"spec": {"suspend": True}, "status": {"conditions": []}}
    )
    assert patched["status"] == running and patched["spec"]["suspend"] is True

    with pytest.raises(ApiException) as stale:
        custom.replace_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "myjob", created)
    assert stale.value.status == 409 and _status(stale.value)["reason"] == "Conflict"
    replaced = custom.replace_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "myjob", patched)
    assert replaced["metadata"]["uid"] == created["metadata"]["uid"] and replaced["status"] == running


def test_delete_cascades_to_owned_objects(
    fake_kube: FakeKubeAPI, core: client.CoreV1Api, custom: client.CustomObjectsApi
) -> None:
    job = custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, _job("myjob"))
    keeper = core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="keeper")))

    def owned_by(*owners: tuple[str, str, str]) -> list[client.V1OwnerReference]:
        return [client.V1OwnerReference(api_version=v, kind=k, name=k.lower(), uid=u) for v, k, u in owners]

    job_ref = (JOBS, "PyTorchJob", job["metadata"]["uid"])
    params = core.create_namespaced_config_map(
        NS, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="params", owner_references=owned_by(job_ref)))
    )
    # a dependent of a dependent goes too; one with another live owner stays
    core.create_namespaced_secret(
        NS,
        client.V1Secret(
            metadata=client.V1ObjectMeta(
                name="token", owner_references=owned_by(("v1", "ConfigMap", params.metadata.uid))
            )
        ),
    )
    core.create_namespaced_config_map(
        NS,
        client.V1ConfigMap(
            metadata=client.V1ObjectMeta(
                name="shared", owner_references=owned_by(job_ref, ("v1", "ConfigMap", keeper.metadata.uid))
            )
        ),
    )

    custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "myjob")

    assert [cm.metadata.name for cm in core.list_namespaced_config_map(NS).items] == ["keeper", "shared"]
    assert fake_kube.objects("v1", "secrets", NS) == []


def test_orphan_propagation_keeps_dependents(core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
    job = custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, _job("myjob"))
    ref = client.V1OwnerReference(api_version=JOBS, kind="PyTorchJob", name="myjob", uid=job["metadata"]["uid"])
    core.create_namespaced_config_map(
        NS, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="params", owner_references=[ref]))
    )

    custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "myjob", propagation_policy="Orphan")

    assert core.read_namespaced_config_map("params", NS).metadata.name == "params"


def test_deny_answers_403_like_rbac(
    fake_kube: FakeKubeAPI, core: client.CoreV1Api, custom: client.CustomObjectsApi
) -> None:
    fake_kube.deny("create", "pytorchjobs", NS)
    fake_kube.deny("get", "pods/log", NS)
    fake_kube.put("v1", "pods", NS, _pod("trainer-0"))

    with pytest.raises(ApiException) as denied:
        custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, _job("myjob"))
    assert denied.value.status == 403
    status = _status(denied.value)
    assert status["reason"] == "Forbidden" and status["message"] == (
        'pytorchjobs.kubeflow.org is forbidden: User "system:serviceaccount:team-a:jupyter" cannot create '
        'resource "pytorchjobs" in API group "kubeflow.org" in the namespace "team-a"'
    )
    with pytest.raises(ApiException) as denied_log:
        core.read_namespaced_pod_log("trainer-0", NS)
    assert _status(denied_log.value)["message"] == (
        'pods "trainer-0" is forbidden: User "system:serviceaccount:team-a:jupyter" cannot get '
        'resource "pods/log" in API group "" in the namespace "team-a"'
    )

    # only that verb, resource and namespace
    assert custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"] == []
    custom.create_namespaced_custom_object(GROUP, VERSION, "team-b", PLURAL, _job("myjob"))
    assert core.read_namespaced_pod("trainer-0", NS).status.phase == "Running"


def test_watch_by_name_sees_modified_and_ends_at_timeout(
    fake_kube: FakeKubeAPI, custom: client.CustomObjectsApi
) -> None:
    for name in ("myjob", "other"):
        custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, _job(name))
    running = {"conditions": [{"type": "Running", "status": "True"}]}

    def controller() -> None:
        fake_kube.set_status(JOBS, PLURAL, NS, "other", running)
        fake_kube.set_status(JOBS, PLURAL, NS, "myjob", running)

    seen: list[tuple[str, str, Any]] = []
    timers: list[threading.Timer] = []
    start = time.monotonic()
    for event in watch.Watch().stream(
        custom.list_namespaced_custom_object,
        GROUP,
        VERSION,
        NS,
        PLURAL,
        field_selector="metadata.name=myjob",
        timeout_seconds=1,
    ):
        seen.append((event["type"], event["raw_object"]["metadata"]["name"], event["raw_object"].get("status")))
        if not timers:  # change things only once the watch is surely open
            timers.append(_after(0.1, controller))
    elapsed = time.monotonic() - start
    timers[0].join()

    assert seen == [("ADDED", "myjob", None), ("MODIFIED", "myjob", running)]
    assert 0.9 < elapsed < 2.5
    watches = [q for _, path, q in fake_kube.requests if path.endswith("/pytorchjobs") and q.get("watch")]
    assert watches == [{"fieldSelector": "metadata.name=myjob", "timeoutSeconds": "1", "watch": "True"}]


def test_watch_from_resource_version_sends_only_newer_events(fake_kube: FakeKubeAPI, core: client.CoreV1Api) -> None:
    fake_kube.put("v1", "pods", NS, _pod("old", {"app": "train"}))
    since = core.list_namespaced_pod(NS).metadata.resource_version
    fake_kube.put("v1", "pods", NS, _pod("new", {"app": "train"}))
    fake_kube.put("v1", "pods", NS, _pod("unlabelled"))

    events = list(
        watch.Watch().stream(
            core.list_namespaced_pod, NS, label_selector="app=train", resource_version=since, timeout_seconds=0.3
        )
    )

    assert [(e["type"], type(e["object"]), e["object"].metadata.name) for e in events] == [
        ("ADDED", client.V1Pod, "new")
    ]


def test_list_pods_by_label_selector(fake_kube: FakeKubeAPI, core: client.CoreV1Api) -> None:
    fake_kube.put("v1", "pods", NS, _pod("master-0", {"job": "myjob", "role": "master"}))
    fake_kube.put("v1", "pods", NS, _pod("worker-0", {"job": "myjob", "role": "worker"}))
    fake_kube.put("v1", "pods", NS, _pod("worker-1", {"job": "myjob", "role": "worker"}))
    fake_kube.put("v1", "pods", NS, _pod("sidecar", {"job": "myjob"}))
    fake_kube.put("v1", "pods", NS, _pod("elsewhere", {"job": "otherjob", "role": "worker"}))

    def names(selector: str) -> list[str]:
        return [p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=selector).items]

    assert names("job=myjob,role=worker") == ["worker-0", "worker-1"]
    assert names("job==myjob,role!=worker") == ["master-0", "sidecar"]
    assert names("job=myjob,!role") == ["sidecar"]
    assert names("role") == ["elsewhere", "master-0", "worker-0", "worker-1"]


def test_pod_log_tail_lines_and_container_choice(fake_kube: FakeKubeAPI, core: client.CoreV1Api) -> None:
    fake_kube.put("v1", "pods", NS, _pod("trainer-0", containers=("pytorch", "sidecar")))
    fake_kube.append_log(NS, "trainer-0", "pytorch", "epoch 0", "epoch 1", "epoch 2")

    assert core.read_namespaced_pod_log("trainer-0", NS, container="pytorch", tail_lines=2) == "epoch 1\nepoch 2\n"
    assert core.read_namespaced_pod_log("trainer-0", NS, container="sidecar") == ""

    with pytest.raises(ApiException) as unnamed:
        core.read_namespaced_pod_log("trainer-0", NS)
    assert unnamed.value.status == 400 and _status(unnamed.value)["message"] == (
        "a container name must be specified for pod trainer-0, choose one of: [pytorch sidecar]"
    )
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod_log("trainer-9", NS)
    assert _status(missing.value)["message"] == 'pods "trainer-9" not found'


def test_pod_log_follow_streams_until_the_pod_succeeds(fake_kube: FakeKubeAPI, core: client.CoreV1Api) -> None:
    fake_kube.put("v1", "pods", NS, _pod("trainer-0"))
    fake_kube.append_log(NS, "trainer-0", "main", "epoch 0")

    resp = core.read_namespaced_pod_log("trainer-0", NS, follow=True, _preload_content=False)
    chunks = resp.stream(amt=None)
    assert next(chunks) == b"epoch 0\n"  # what was there already, before anything else is written

    def finish() -> None:
        fake_kube.append_log(NS, "trainer-0", "main", "epoch 1", "done")
        fake_kube.set_status("v1", "pods", NS, "trainer-0", {"phase": "Succeeded"})

    timer = _after(0.2, finish)
    start = time.monotonic()
    rest = b"".join(chunks)
    timer.join()
    resp.release_conn()

    assert rest.decode().splitlines() == ["epoch 1", "done"]
    assert time.monotonic() - start < 2


def test_stop_ends_open_streams(
    fake_kube: FakeKubeAPI, core: client.CoreV1Api, custom: client.CustomObjectsApi
) -> None:
    fake_kube.put("v1", "pods", NS, _pod("trainer-0"))
    job_watch = custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, watch=True, _preload_content=False)
    log_follow = core.read_namespaced_pod_log("trainer-0", NS, follow=True, _preload_content=False)
    readers = [threading.Thread(target=resp.read) for resp in (job_watch, log_follow)]
    for reader in readers:
        reader.start()

    fake_kube.stop()

    for reader in readers:
        reader.join(timeout=2)
        assert not reader.is_alive()


def test_fail_next_and_unsupported_requests_answer_with_status(
    fake_kube: FakeKubeAPI, custom: client.CustomObjectsApi
) -> None:
    fake_kube.fail_next(503, times=2)
    for _ in range(2):
        with pytest.raises(ApiException) as unavailable:
            custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)
        assert unavailable.value.status == 503 and _status(unavailable.value)["reason"] == "ServiceUnavailable"
    assert custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"] == []

    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, _job("myjob"))
    # custom resources take no strategic merge patch; the client cannot send one, so go around it
    strategic = urllib.request.Request(
        f"{fake_kube.url}/apis/{JOBS}/namespaces/{NS}/{PLURAL}/myjob",
        data=b'{"spec": {}}',
        method="PATCH",
        headers={
            "Authorization": f"Bearer {fake_kube.token}",
            "Content-Type": "application/strategic-merge-patch+json",
        },
    )
    with pytest.raises(urllib.error.HTTPError) as unsupported:
        urllib.request.urlopen(strategic)
    with unsupported.value as answer:
        assert answer.code == 415 and json.load(answer)["reason"] == "UnsupportedMediaType"
    with pytest.raises(ApiException) as field:
        custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, field_selector="status.phase=Running")
    assert field.value.status == 400


def _inference_service(name: str, **predictor: Any) -> dict[str, Any]:
    """The smallest InferenceService KServe v0.20.0's CRD and webhook admit (what `render --serve` makes)."""
    model = {"modelFormat": {"name": "huggingface"}, "storageUri": "s3://bucket/runs/j/model"}
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {"predictor": {"model": model, **predictor}},
    }


def test_inference_services_are_admitted_by_kserves_crd_and_webhook(tmp_path: Path) -> None:
    from fakes import crds, webhooks

    isvc = ("serving.kserve.io", "v1beta1", NS, "inferenceservices")
    with FakeKubeAPI(kserve="v0.20.0") as server:
        api = config.new_client_from_config(config_file=str(server.write_kubeconfig(tmp_path / "kc")))
        custom = client.CustomObjectsApi(api)
        body = _inference_service("chat", minReplicas=1, maxReplicas=2)
        outcome = crds.crd("inferenceservices", "v0.20.0").admit(body)
        assert (outcome.errors, webhooks.inferenceservice_errors(outcome.stored)) == ([], [])
        created = custom.create_namespaced_custom_object(*isvc, body)
        assert created["spec"] == outcome.stored["spec"]
        # the CRD's schema (422), then KServe's webhook (403, as controller-runtime denies)
        with pytest.raises(ApiException) as invalid:
            custom.create_namespaced_custom_object(*isvc, _inference_service("bad", minReplicas="1"))
        assert (
            invalid.value.status == 422
            and "spec.predictor.minReplicas in body must be of type integer" in (_status(invalid.value)["message"])
        )
        with pytest.raises(ApiException) as refused:
            custom.create_namespaced_custom_object(*isvc, _inference_service("bad", minReplicas=3, maxReplicas=2))
        assert refused.value.status == 403 and _status(refused.value)["message"] == (
            'admission webhook "inferenceservice.kserve-webhook-server.validator" denied the request: '
            "MinReplicas cannot be greater than MaxReplicas"
        )
        # a controller writes the status; request bodies are kept for tests to inspect
        server.set_status("serving.kserve.io/v1beta1", "inferenceservices", NS, "chat", {"url": "http://chat"})
        assert custom.get_namespaced_custom_object(*isvc, "chat")["status"] == {"url": "http://chat"}
        assert [(m, p) for m, p, _ in server.bodies][0] == (
            "POST",
            f"/apis/serving.kserve.io/v1beta1/namespaces/{NS}/inferenceservices",
        )
        api.close()
    with FakeKubeAPI() as server:  # KServe is opt-in
        api = config.new_client_from_config(config_file=str(server.write_kubeconfig(tmp_path / "kc")))
        with pytest.raises(ApiException) as absent:
            client.CustomObjectsApi(api).create_namespaced_custom_object(*isvc, _inference_service("chat"))
        assert absent.value.status == 404 and _status(absent.value)["message"] == (
            "the server could not find the requested resource"
        )
        api.close()
