"""`hivekeeper-operator` / `python -m hivekeeper_operator`: run the operator.

Every flag has an environment variable (what the Helm chart sets)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def key_values(text: str) -> tuple[tuple[str, str], ...]:
    """KEY=VALUE,KEY=VALUE (how the chart passes a map of labels) as pairs."""
    return tuple(_key_value(pair.strip()) for pair in text.split(",") if pair.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivekeeper-operator", description="Reconcile hivekeeper resources into pods.")
    parser.add_argument("--namespace", action="append", default=None, dest="namespaces", metavar="NS",
                        help="watch only this namespace (repeatable; default: every namespace) "
                             "[HIVEKEEPER_WATCH_NAMESPACES, comma-separated]")
    parser.add_argument("--image", default=_env("HIVEKEEPER_IMAGE", "hivekeeper:latest"),
                        help="image of the resources' pods [HIVEKEEPER_IMAGE]")
    parser.add_argument("--image-pull-policy", default=_env("HIVEKEEPER_IMAGE_PULL_POLICY", "IfNotPresent"))
    parser.add_argument("--image-pull-secret", action="append", default=None, dest="pull_secrets",
                        help="[HIVEKEEPER_IMAGE_PULL_SECRETS, comma-separated]")
    parser.add_argument("--cluster-domain", default=_env("HIVEKEEPER_CLUSTER_DOMAIN", "cluster.local"))
    parser.add_argument("--resync-seconds", type=float, default=float(_env("HIVEKEEPER_RESYNC_SECONDS", "15")))
    parser.add_argument("--metrics-port", type=int, default=int(_env("HIVEKEEPER_METRICS_PORT", "8080")),
                        help="port for /metrics, /healthz, /readyz [HIVEKEEPER_METRICS_PORT]")
    parser.add_argument("--service-monitors", choices=("auto", "off"), default=_env("HIVEKEEPER_SERVICE_MONITORS", "auto"),
                        help="create a ServiceMonitor per resource when the Prometheus Operator CRD exists")
    parser.add_argument("--service-monitor-label", action="append", default=None, dest="service_monitor_labels",
                        metavar="KEY=VALUE", type=_key_value,
                        help="a label of those ServiceMonitors (repeatable) [HIVEKEEPER_SERVICE_MONITOR_LABELS, "
                             "comma-separated]")
    parser.add_argument("--leader-elect", action=argparse.BooleanOptionalAction,
                        default=_env("HIVEKEEPER_LEADER_ELECT", "false").lower() == "true",
                        help="run as one of several replicas: only the holder of a Lease reconciles "
                             "[HIVEKEEPER_LEADER_ELECT=true]")
    parser.add_argument("--leader-elect-namespace", default=_env("HIVEKEEPER_LEADER_ELECT_NAMESPACE", "default"),
                        help="the Lease's namespace (the operator's own) [HIVEKEEPER_LEADER_ELECT_NAMESPACE]")
    parser.add_argument("--leader-elect-lease", default=_env("HIVEKEEPER_LEADER_ELECT_LEASE", "hivekeeper-operator"),
                        help="the Lease's name [HIVEKEEPER_LEADER_ELECT_LEASE]")
    parser.add_argument("--leader-elect-lease-duration", type=float, default=15.0,
                        help="seconds a standby waits for an unrenewed Lease before it takes it")
    parser.add_argument("--leader-elect-renew-deadline", type=float, default=10.0,
                        help="seconds the leader keeps trying to renew before it gives up leading")
    parser.add_argument("--leader-elect-retry-period", type=float, default=2.0,
                        help="seconds between two tries to acquire or renew")
    parser.add_argument("--kubeconfig", default=None, help="default: in-cluster config, else $KUBECONFIG")
    parser.add_argument("--log-level", default=_env("HIVEKEEPER_LOG_LEVEL", "INFO"))
    return parser


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def exit_at_once(error: BaseException) -> None:
    """controller-runtime's answer to a lost Lease: end the process now, reconciles under way or
    not (another replica may lead already); the Deployment starts it again, as a standby."""
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

    from hivekeeper_operator.leader import LeaderElection
    from hivekeeper_operator.reconcile import OperatorConfig
    from hivekeeper_operator.runtime import Operator
    from hivekeeper_operator.pods import WorkloadSettings

    namespaces = args.namespaces or [n.strip() for n in _env("HIVEKEEPER_WATCH_NAMESPACES").split(",") if n.strip()]
    pull_secrets = args.pull_secrets or [s.strip() for s in _env("HIVEKEEPER_IMAGE_PULL_SECRETS").split(",") if s.strip()]
    monitor_labels = args.service_monitor_labels or key_values(_env("HIVEKEEPER_SERVICE_MONITOR_LABELS"))
    config = OperatorConfig(
        settings=WorkloadSettings(image=args.image, image_pull_policy=args.image_pull_policy,
                                  image_pull_secrets=tuple(pull_secrets), cluster_domain=args.cluster_domain,
                                  service_monitor_labels=tuple(monitor_labels)),
        namespaces=tuple(namespaces), resync_seconds=args.resync_seconds, metrics_port=args.metrics_port,
        service_monitors=args.service_monitors, kubeconfig=args.kubeconfig)
    if args.leader_elect:
        try:
            config.leader_election = LeaderElection(
                namespace=args.leader_elect_namespace, lease_name=args.leader_elect_lease,
                lease_duration=args.leader_elect_lease_duration, renew_deadline=args.leader_elect_renew_deadline,
                retry_period=args.leader_elect_retry_period)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    Operator(config, on_lost_leadership=exit_at_once).run()  # until SIGTERM or SIGINT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
