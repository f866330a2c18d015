"""Dashboard and alarms for one deployment, on the shared signals; every target reuses this construct.

Thresholds follow the scaling targets from the config: an alarm fires when autoscaling is not keeping
up (cache still saturated, queue still long after scale-out had time to act), when the cache is too
small for the admitted concurrency (preemptions), on server errors, and when the signals stop arriving
(then autoscaling is blind).
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from constructs import Construct

from kvfleet import contract
from kvfleet.config.schema import ScalingConfig
from kvfleet.infra.metrics import PERIOD, PlatformMetrics, signal_metric

CACHE_SATURATED = 0.95  # above this the engine preempts or queues: scale-out should have prevented it
SUSTAINED_MIN = 10  # minutes a saturation or queue must last: longer than scale-out plus model load
QUEUE_ALARM_FACTOR = 4.0  # queue depth per replica this many times the scaling target


class ServingMonitoring(Construct):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        deployment_id: str,
        scaling: ScalingConfig,
        signals_published: bool = True,
    ) -> None:
        """The signal alarms. ``add_dashboard`` adds the target's own metrics and the dashboard."""
        super().__init__(scope, id)
        self._deployment_id = deployment_id
        self._scaling = scaling
        m = _Metrics(deployment_id)
        self.alarms: list[cw.Alarm] = []
        # Alarms an endpoint update watches to roll back. They must not reference the endpoint itself (that
        # would be a dependency cycle), so they read the agent's signals, keyed by deployment.
        self.rollback_alarms: list[cw.Alarm] = []

        if signals_published:
            self.cache_saturated = self._alarm(
                "CacheSaturated",
                m.cache,
                threshold=CACHE_SATURATED,
                periods=SUSTAINED_MIN,
                op=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                what=f"KV cache above {CACHE_SATURATED:.0%} for {SUSTAINED_MIN} min: scale-out is not keeping up "
                f"(at max_replicas {scaling.max_replicas}?)",
            )
            queue_limit = QUEUE_ALARM_FACTOR * scaling.queue_depth_target
            self.queue_growing = self._alarm(
                "QueueGrowing",
                m.waiting,
                threshold=queue_limit,
                periods=SUSTAINED_MIN,
                op=cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
                what=f"more than {queue_limit:g} requests waiting per replica for {SUSTAINED_MIN} min",
            )
            self.preempting = self._alarm(
                "Preempting",
                m.preemptions,
                threshold=1,
                periods=5,
                datapoints=3,
                op=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                what="sequences preempted in 3 of 5 min: admitted concurrency exceeds the KV cache",
            )
            self.server_errors = self._alarm(
                "ServerErrors",
                m.server_errors,
                threshold=5,
                periods=5,
                datapoints=3,
                op=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                what="5 or more 5xx responses a minute in 3 of 5 min",
            )
            self.signals_missing = self._alarm(
                "SignalsMissing",
                signal_metric(deployment_id, contract.KV_CACHE_UTILIZATION, statistic="SampleCount"),
                threshold=1,
                periods=5,
                op=cw.ComparisonOperator.LESS_THAN_THRESHOLD,
                missing=cw.TreatMissingData.BREACHING,
                what="no KV-cache signal for 5 min: autoscaling is blind (agent down or metrics not delivered)",
            )
            self.rollback_alarms = [self.server_errors, self.preempting]

    def add_dashboard(self, platform: PlatformMetrics) -> cw.Dashboard:
        deployment_id, scaling = self._deployment_id, self._scaling
        m = _Metrics(deployment_id)
        if platform.errors_5xx is not None:
            self.platform_errors = self._alarm(
                "Platform5xx",
                platform.errors_5xx,
                threshold=5,
                periods=5,
                datapoints=3,
                op=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                what="the platform reports 5 or more 5xx a minute in 3 of 5 min",
            )

        instances = platform.instances or cw.MathExpression(
            expression=f"n / (PERIOD(n) / {contract.PUBLISH_INTERVAL_S})",
            using_metrics={"n": signal_metric(deployment_id, contract.KV_CACHE_UTILIZATION, statistic="SampleCount")},
            label="replicas publishing",
            period=PERIOD,
        )
        errors: list[cw.IMetric] = [m.server_errors]
        errors += [x for x in (platform.errors_4xx, platform.errors_5xx) if x is not None]

        self.dashboard = cw.Dashboard(self, "Dashboard", default_interval=Duration.hours(3))
        self.dashboard.add_widgets(
            cw.TextWidget(
                markdown=f"## kvfleet {deployment_id}\nScales on KV-cache utilization "
                f"(target {scaling.kv_cache_utilization_target:.0%}) and requests waiting per replica "
                f"(target {scaling.queue_depth_target:g}); {scaling.min_replicas}-{scaling.max_replicas} replicas.",
                width=24,
                height=2,
            )
        )
        self.dashboard.add_widgets(
            _graph("Time to first token (ms)", [m.ttft_p50, m.ttft_p95]),
            _graph("Inter-token latency (ms)", [m.itl_p50, m.itl_p95]),
            _graph("Output tokens/s (fleet)", [m.tokens_per_s]),
        )
        self.dashboard.add_widgets(
            _graph(
                "KV-cache utilization",
                [m.cache, m.cache_max],
                hline=scaling.kv_cache_utilization_target,
                left=cw.YAxisProps(min=0, max=1),
            ),
            _graph("Requests waiting per replica", [m.waiting, m.waiting_max], hline=scaling.queue_depth_target),
            _graph("Requests running per replica", [m.running]),
        )
        self.dashboard.add_widgets(
            _graph("Preemptions and shed requests", [m.preemptions, m.shed]),
            _graph("Errors", errors),
            _graph("Instances", [instances]),
        )
        if self.alarms:
            self.dashboard.add_widgets(cw.AlarmStatusWidget(alarms=list(self.alarms), title="Alarms", width=24))
        return self.dashboard

    def _alarm(
        self,
        id: str,
        metric: cw.IMetric,
        *,
        threshold: float,
        periods: int,
        op: cw.ComparisonOperator,
        what: str,
        datapoints: int | None = None,
        missing: cw.TreatMissingData = cw.TreatMissingData.NOT_BREACHING,
    ) -> cw.Alarm:
        alarm = cw.Alarm(
            self,
            id,
            metric=metric,
            threshold=threshold,
            evaluation_periods=periods,
            datapoints_to_alarm=datapoints or periods,
            comparison_operator=op,
            treat_missing_data=missing,
            alarm_description=what,
        )
        self.alarms.append(alarm)
        return alarm


class _Metrics:
    def __init__(self, deployment_id: str) -> None:
        d = deployment_id
        s = contract
        self.cache = signal_metric(d, s.KV_CACHE_UTILIZATION, label="average")
        self.cache_max = signal_metric(d, s.KV_CACHE_UTILIZATION, statistic="Maximum", label="hottest replica")
        self.waiting = signal_metric(d, s.REQUESTS_WAITING, label="average")
        self.waiting_max = signal_metric(d, s.REQUESTS_WAITING, statistic="Maximum", label="longest queue")
        self.running = signal_metric(d, s.REQUESTS_RUNNING)
        self.ttft_p50 = signal_metric(d, s.TIME_TO_FIRST_TOKEN, statistic="p50", label="p50")
        self.ttft_p95 = signal_metric(d, s.TIME_TO_FIRST_TOKEN, statistic="p95", label="p95")
        self.itl_p50 = signal_metric(d, s.INTER_TOKEN_LATENCY, statistic="p50", label="p50")
        self.itl_p95 = signal_metric(d, s.INTER_TOKEN_LATENCY, statistic="p95", label="p95")
        self.tokens_per_s = cw.MathExpression(
            expression="t / PERIOD(t)",
            using_metrics={"t": signal_metric(d, s.OUTPUT_TOKENS)},
            label="output tokens/s",
            period=PERIOD,
        )
        self.preemptions = signal_metric(d, s.PREEMPTIONS, label="preemptions")
        self.shed = signal_metric(d, s.REQUESTS_SHED, label="shed (429)")
        self.server_errors = signal_metric(d, s.SERVER_ERRORS, label="5xx (agent)")


def _graph(
    title: str, metrics: list[cw.IMetric], *, hline: float | None = None, left: cw.YAxisProps | None = None
) -> cw.GraphWidget:
    return cw.GraphWidget(
        title=title,
        left=metrics,
        width=8,
        height=6,
        left_y_axis=left,
        left_annotations=[cw.HorizontalAnnotation(value=hline, label="scaling target")] if hline is not None else None,
    )
