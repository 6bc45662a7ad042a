"""MLflow tracking (``tracking.mlflow``), through MLflow's own client (``MlflowClient``), rank 0 only.

- Params: the resolved spec, flattened (``training.learning_rate``); tags: system facts (world
  size, device, precision, kubetune version, the output's URI); metrics: every logged train step
  and every evaluation, named as in TensorBoard (``train/loss``, ``eval/accuracy``); artifacts at
  the end: ``metrics.json``, ``job.yaml``, ``report.html`` and ``plots/``. The model is referenced
  by its ``output.uri`` (a tag, and the source of the optional registered model version), not
  copied: it is already in the output, possibly gigabytes.
- A resumed run continues the same MLflow run: its id is in the trainer state (``logger_runs``),
  saved with every checkpoint. The steps the server already has (those after the checkpoint that
  the interrupted run had logged) are not logged twice: resume is exact, so their values are the
  same.
- The server is checked before training (one line if it is down or refuses the credentials).
  If it goes away mid-run, training goes on: what could not be sent is counted and reported at
  the end (``history.jsonl`` has it all). The client's own retries (minutes of back-off per call)
  are turned down so that a lost server never stalls training.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetune.config import JobSpec
from kubetune.errors import KubetuneError, redact
from kubetune.training.events import RECORDS, Event

log = logging.getLogger(__name__)
_NOT_IN_A_NAME = re.compile(r"[^\w\-. /]")


def metric_name(kind: str, key: str) -> str:
    """The MLflow name of metric ``key`` of a ``kind`` record (``eval/loss``, ``lm_eval/TASK/acc``). MLflow refuses
    names with other characters than letters, digits, ``_ - . /`` and spaces, or that read as a path (``..``): an
    lm-eval task may be named anything (``../x``, ``a,b``), so those characters become ``_``, as do empty, ``.``
    and ``..`` parts, and the run's other metrics still reach the server."""
    name = _NOT_IN_A_NAME.sub("_", f"{kind}/{key.removeprefix('eval_')}")
    return "/".join("_" if part.strip() in ("", ".", "..") else part for part in name.split("/"))


# per HTTP request, during training: a lost server costs at most this per log step, not minutes
REQUEST_TIMEOUT_S = "10"
PARAM_VALUE_LIMIT = 6000  # MLflow's limit on a param value's length
BATCH = 100  # MLflow's limit on params per log_batch call


def tracking_uri(spec: JobSpec) -> str | None:
    cfg = spec.tracking.mlflow
    return (cfg.uri if cfg else None) or os.environ.get("MLFLOW_TRACKING_URI") or None


def _quiet_client() -> None:
    """No retries with back-off (MLflow's default: 7 tries over minutes per call), a short timeout."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", REQUEST_TIMEOUT_S)
    # MLflow prints the run's address to stdout at its end, credentials and all (a URL given in
    # MLFLOW_TRACKING_URI may hold them); kubetune logs the address itself, redacted.
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    logging.getLogger("mlflow").setLevel(logging.ERROR)


def connect(spec: JobSpec) -> Any:
    """An ``MlflowClient`` for the spec's server, checked with one request.

    Raises:
        KubetuneError: no server named, MLflow not installed, the server unreachable or refusing
            the credentials: one line naming tracking.mlflow.uri.
    """
    uri = tracking_uri(spec)
    if not uri:
        raise KubetuneError(
            "tracking.mlflow is set but names no server, and MLFLOW_TRACKING_URI is not set",
            field="tracking.mlflow.uri",
            fix="set tracking.mlflow.uri: http://HOST:5000, or export MLFLOW_TRACKING_URI",
        )
    if not uri.startswith(("http://", "https://")):
        raise KubetuneError(
            f"MLFLOW_TRACKING_URI {uri!r} is not an http(s) URL of a tracking server",
            field="tracking.mlflow.uri",
            fix="set tracking.mlflow.uri: http://HOST:5000 (a local file store is not shared by the ranks' nodes)",
        )
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise KubetuneError(
            "tracking.mlflow needs the MLflow client, which is not installed",
            field="tracking.mlflow",
            fix="pip install 'kubetune[mlflow]' (the trainer image has it)",
        ) from None
    _quiet_client()
    client = MlflowClient(tracking_uri=uri)
    try:
        client.search_experiments(max_results=1)
    except Exception as e:
        # MLflow wraps a request that got no answer (refused, unknown host, timeout) as "API request
        # to URL failed with exception ..."; an HTTP error answer carries its status instead
        if isinstance(e, MlflowException) and "failed with exception" not in str(e):
            raise KubetuneError(_refusal(uri, e), field="tracking.mlflow.uri", fix=_fix(e)) from None
        raise KubetuneError(
            f"cannot reach the MLflow server at {uri}: {_connection_reason(e)}",
            field="tracking.mlflow.uri",
            fix="check the address and that the server runs (curl URI/health), or remove tracking.mlflow",
        ) from None
    return client


def _connection_reason(e: Exception) -> str:
    import re

    text = str(e)
    found = re.search(
        r"Connection refused|Name or service not known|Temporary failure in name resolution|timed out|"
        r"No route to host|Network is unreachable|CERTIFICATE_VERIFY_FAILED|Connection reset",
        text,
    )
    return found.group(0) if found else (text.splitlines() or [type(e).__name__])[0][:160]


def _status(e: Exception) -> int | None:
    code = getattr(e, "get_http_status_code", lambda: None)()
    return code if isinstance(code, int) else None


def _refusal(uri: str, e: Exception) -> str:
    code = _status(e)
    if code in (401, 403):
        return f"the MLflow server at {uri} refused the credentials (HTTP {code})"
    first = (str(getattr(e, "message", e)) or type(e).__name__).splitlines()[0][:200]
    return f"the MLflow server at {uri} answered an error: {first}"


def _fix(e: Exception) -> str:
    if _status(e) in (401, 403):
        return (
            "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN); on Kubernetes, "
            "put them in a Secret named by kubernetes.secrets.mlflow"
        )
    return "check that tracking.mlflow.uri is an MLflow tracking server"


def flatten(value: object, prefix: str = "") -> dict[str, str]:
    """``{"training": {"epochs": 1}}`` -> ``{"training.epochs": "1"}``; lists and nulls as JSON."""
    if isinstance(value, dict) and value:
        out: dict[str, str] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    text = value if isinstance(value, str) else json.dumps(value)
    return {prefix.rstrip("."): text[:PARAM_VALUE_LIMIT]}


class MLflowLogger:
    """MLflow's rendering of the trainer's events (``events.Subscriber``): the records (train, eval, lm_eval) as
    metrics; ``done`` logs the artifacts of ``out`` and ends the run, ``stopped`` ends it as KILLED."""

    def __init__(self, spec: JobSpec, run_ids: dict[str, str], facts: dict[str, Any], out: Path | None = None):
        from mlflow.entities import Param

        self.spec, self.out = spec, out
        cfg = spec.tracking.mlflow
        assert cfg is not None, "MLflowLogger is made for a spec with tracking.mlflow"
        self.cfg = cfg
        self.client = connect(spec)
        self.failed: list[int] = []  # the steps whose metrics did not reach the server
        self.ended = False  # finish() ended the run; otherwise close() marks it FAILED
        self.skip: dict[str, int] = {}
        self.resumed = False  # continuing the MLflow run of the checkpoint
        run_id = run_ids.get("mlflow")
        if run_id and not self._exists(run_id):
            log.warning(
                "MLflow: run %s of the checkpoint is not on %s (deleted?); starting a new run",
                run_id,
                redact(self.client.tracking_uri),
            )
            run_id = None
        if run_id:  # a resumed run: the same MLflow run, without the steps the server already has
            self.run_id, self.resumed = run_id, True
            for kind in ("train", "eval"):
                history = self.client.get_metric_history(run_id, f"{kind}/loss")
                self.skip[kind] = max((m.step for m in history), default=-1)
            self.client.update_run(run_id, status="RUNNING")
            log.info("MLflow: continuing run %s (%s)", run_id, self._url())
            return
        experiment = self.client.get_experiment_by_name(self.cfg.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.cfg.experiment)
        tags = {
            **{f"kubetune.{k}": str(v) for k, v in facts.items()},
            "kubetune.job": spec.name,
            "kubetune.task": spec.task,
            "kubetune.output_uri": spec.output.uri,
            **self.cfg.tags,
        }
        run = self.client.create_run(experiment_id, run_name=self.cfg.run_name or spec.name, tags=tags)
        self.run_id = run_ids["mlflow"] = run.info.run_id
        params = [Param(k, v) for k, v in flatten(spec.model_dump(mode="json")).items()]
        for i in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + BATCH])
        log.info("MLflow: run %s in experiment %r (%s)", self.run_id, self.cfg.experiment, self._url())

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return bool(self.client.get_run(run_id).info.lifecycle_stage != "deleted")
        except MlflowException as e:
            if "RESOURCE_DOES_NOT_EXIST" in str(e.error_code):
                return False
            raise

    def _url(self) -> str:
        return redact(f"{self.client.tracking_uri.rstrip('/')}/#/experiments/runs/{self.run_id}")

    def on_event(self, event: Event) -> None:
        if event.kind in RECORDS:
            self.log(event.kind, event.step, event.metrics, event.context)
        elif event.kind == "done":
            self.finish(self.out)
        elif event.kind == "stopped":
            self.finish(self.out, status="KILLED")

    def log(self, kind: str, step: int, metrics: dict[str, Any], context: dict[str, Any]) -> None:
        """Send one record's numbers (``metric_name`` each) unless the server has its step already."""
        from mlflow.entities import Metric

        if self.resumed and kind not in self.skip and metrics:  # a kind without a loss (lm_eval): its first metric
            try:
                history = self.client.get_metric_history(self.run_id, metric_name(kind, next(iter(metrics))))
                self.skip[kind] = max((m.step for m in history), default=-1)
            except Exception:  # the server went away: log_batch below reports it
                self.skip[kind] = -1
        if step <= self.skip.get(kind, -1):
            return
        now = int(time.time() * 1000)
        batch = [
            Metric(metric_name(kind, k), float(v), now, step)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except Exception as e:  # the server went away: training goes on, the gap is reported at the end
            if not self.failed:
                log.warning("MLflow: could not send the metrics of step %d (%s); training goes on", step, _short(e))
            self.failed.append(step)

    def finish(self, out: Path | None, status: str = "FINISHED") -> None:
        """Log the run's artifacts from ``out`` (the finished output), register the model if asked,
        and end the MLflow run; report what could not be sent."""
        self.ended = True
        if status == "FINISHED" and out is not None:
            self._attempt("log the artifacts", lambda: self._artifacts(out))
            if self.cfg.register_model:
                self._attempt("register the model", self._register)
        self._attempt("end the run", lambda: self.client.set_terminated(self.run_id, status))
        if self.failed:
            steps = [s for s in self.failed if s >= 0]
            where = (
                f"the metrics of {len(steps)} log steps ({steps[0]}..{steps[-1]})" if steps else "the end of the run"
            )
            log.warning(
                "MLflow: %s did not reach %s (history.jsonl in the output has every metric)",
                where,
                redact(self.client.tracking_uri),
            )

    def _attempt(self, what: str, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as e:  # each part on its own: a refused registration still ends the run
            log.warning("MLflow: could not %s of run %s (%s)", what, self.run_id, _short(e))
            self.failed.append(-1)

    def _artifacts(self, out: Path) -> None:
        for name in ("metrics.json", "job.yaml", "report.html"):
            if (out / name).is_file():
                self.client.log_artifact(self.run_id, str(out / name))
        if (out / "plots").is_dir():
            self.client.log_artifacts(self.run_id, str(out / "plots"), "plots")

    def _register(self) -> None:
        from mlflow.exceptions import MlflowException

        name = self.cfg.register_model
        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
                raise
        version = self.client.create_model_version(name, source=self.spec.output.uri, run_id=self.run_id)
        log.info("MLflow: registered model %r version %s (source %s)", name, version.version, self.spec.output.uri)

    def close(self) -> None:
        """However training ends: a run that finish() did not end (an error, a diverged loss) is marked
        FAILED rather than left RUNNING; a resumed run sets it RUNNING again."""
        if not self.ended:
            self.ended = True
            self._attempt("end the run", lambda: self.client.set_terminated(self.run_id, "FAILED"))


def _short(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:160]
