"""Dashboard and alarms for one deployment, on the shared signals; every target reuses this construct.

Thresholds follow the scaling targets from the config: an alarm fires when autoscaling is not keeping
up (replicas still saturated, queue still long after scale-out had time to act), when the cache is too
small for the admitted concurrency (preemptions), on the share of requests answered 5xx, and when the
signals stop arriving (then autoscaling is blind).

Saturation (``contract.REPLICA_SATURATION``) is what scales and what the saturation alarm reads: the larger of
KV-cache use and running sequences over max_num_seqs. KV-cache use alone counts only the blocks of running
sequences, which max_num_seqs caps, so where the plan's cache holds more sequences than max_num_seqs runs it never
reaches the target (dev's plan: at most about 0.20); the dashboard still charts it beside saturation.

Updates roll back on the 5xx *rate* only (``rollback_alarms``): a SageMaker endpoint update
(AutoRollbackConfiguration) and an EC2 instance refresh (AlarmSpecification) take the names of CloudWatch
alarms, and a metric-math alarm is one (SageMaker API Alarm and AutoRollbackConfig: "CloudWatch alarms in your
account"; Auto Scaling AlarmSpecification: "names of one or more CloudWatch alarms"). A count, of errors or of
preemptions, grows with traffic and with what clients send (long prompts preempt more), so it would roll back
a good release at peak load.

What the rate cannot tell apart: the agent publishes under the deployment's dimensions only
(``contract.DIMENSION_SETS``), so during an update the old and the new instances' requests are counted
together. SageMaker's own per-fleet metrics (AWS/SageMaker with an EndpointConfigName dimension, published
for the new fleet once it takes traffic: Developer Guide, "Auto-Rollback Configuration and Monitoring",
https://docs.aws.amazon.com/sagemaker/latest/dg/deployment-guardrails-configuration.html) need the endpoint's
name in the alarm, while the endpoint names the alarm in its DeploymentConfig: a CloudFormation cycle, broken
only by a fixed EndpointName (refused here: it replaces every existing endpoint and collides across stacks).
So the alarm means "this share of the requests the deployment answered, old and new instances together,
were 5xx"; its threshold is set low enough for the smallest new share an update exposes (one instance among
``max_replicas``), and, as that guide notes for its both-fleets example, an old fleet already failing also
ends (rolls back) the update.
"""

from __future__ import annotations

import math

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from constructs import Construct

from kvfleet import contract
from kvfleet.infra.metrics import PERIOD, PlatformMetrics, signal_metric
from kvfleet.scaling import ScalingPolicy

# Saturation above this: the engine preempts (cache full) or queues (every sequence slot taken); scale-out should
# have prevented it.
CACHE_SATURATED = 0.95
SUSTAINED_MIN = 10  # minutes a saturation or queue must last: longer than scale-out plus model load
QUEUE_ALARM_FACTOR = 4.0  # queue depth per replica this many times the scaling target
# The binding limit is not the planned one: the cache full while fewer than this share of the sequence slots run.
SLOTS_IDLE_FRACTION = 0.75

# The 5xx rate. A healthy replica answers 5xx only when its engine dies under a request (the agent counts every
# 5xx it sends, drain's 503 excepted: contract.SERVER_ERRORS), so any sustained share is a fault; 5% is the
# ceiling. An update puts at least one new instance among at most max_replicas in service, and a new instance
# failing every request shows up as 1/max_replicas of the fleet's requests: the threshold is half of that when it
# is lower, so a new instance failing half its requests still trips it (``error_rate_threshold``).
ERROR_RATE_CEILING = 0.05
# Below this many requests a minute the rate reads 0: at the threshold a minute must hold at least this many
# errors, so one failed request in a quiet minute never rolls an update back.
ERROR_RATE_MIN_ERRORS = 2


class ServingMonitoring(Construct):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        deployment_id: str,
        scaling: ScalingPolicy,
        signals_published: bool = True,
        max_num_seqs: int | None = None,
        slots_bind: bool = False,
        data_parallel_size: int = 1,
    ) -> None:
        """The signal alarms. ``add_dashboard`` adds the target's own metrics and the dashboard. ``max_num_seqs``
        and ``slots_bind`` (the plan expects the sequence slots, not the cache, to fill first) add the alarm for
        a replica whose cache fills first instead. ``max_num_seqs`` is one engine core's (vLLM's --max-num-seqs);
        a data-parallel replica runs ``data_parallel_size`` cores, and the agent's running count sums them."""
        super().__init__(scope, id)
        self._deployment_id = deployment_id
        self._scaling = scaling
        self.alarms: list[cw.Alarm] = []
        # Alarms an endpoint update watches to roll back. They must not reference the endpoint itself (that
        # would be a dependency cycle), so they read the agent's signals, keyed by deployment.
        self.rollback_alarms: list[cw.Alarm] = []

        if signals_published:
            m = _Metrics(deployment_id)
            self._capacity_alarms(m)
            self.cache_binds_first: cw.Alarm | None = None
            if slots_bind and max_num_seqs is not None:
                self.cache_binds_first = self._cache_binds_first_alarm(m, max_num_seqs * data_parallel_size)
            self._health_alarms()
            self.rollback_alarms = [self.server_error_rate]

    def _capacity_alarms(self, m: _Metrics) -> None:
        """Scale-out not keeping up (saturation, queue) and a cache too small for the admitted concurrency."""
        scaling = self._scaling
        self.saturated = self._alarm(
            "Saturated",
            m.saturation,
            threshold=CACHE_SATURATED,
            periods=SUSTAINED_MIN,
            op=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            what=f"replicas on average {CACHE_SATURATED:.0%} saturated or more for {SUSTAINED_MIN} min (KV cache "
            f"or sequence slots, max_num_seqs, full): scale-out is not keeping up "
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

    def _cache_binds_first_alarm(self, m: _Metrics, replica_seqs: int) -> cw.Alarm:
        """The plan has the sequence slots binding first, yet the cache fills while slots are free. Both sides are
        the replica's: RequestsRunning is the sum over a data-parallel replica's cores and KV use is used over
        their caches together (kvfleet.agent.metrics), so the slots are every core's, ``replica_seqs``."""
        slots = SLOTS_IDLE_FRACTION * replica_seqs
        return self._alarm(
            "CacheBindsFirst",
            cw.MathExpression(
                expression=f"IF(kv >= {CACHE_SATURATED}, IF(running < {slots:g}, 1, 0), 0)",
                using_metrics={"kv": m.cache, "running": m.running},
                label="cache full with sequence slots free",
                period=PERIOD,
            ),
            threshold=1,
            periods=SUSTAINED_MIN,
            op=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            what=f"the KV cache above {CACHE_SATURATED:.0%} with fewer than {slots:g} of {replica_seqs} "
            f"sequences running for {SUSTAINED_MIN} min: the plan has the sequence slots binding first, so "
            "requests are longer than it assumed; re-plan with the measured lengths (kvfleet workload on "
            "the agent's request log)",
        )

    def _health_alarms(self) -> None:
        """The 5xx share (the one an update rolls back on) and signals that stop arriving."""
        deployment_id, scaling = self._deployment_id, self._scaling
        rate_limit = error_rate_threshold(scaling)
        self.server_error_rate = self._alarm(
            "ServerErrorRate",
            server_error_rate(deployment_id, threshold=rate_limit),
            threshold=rate_limit,
            periods=5,
            datapoints=3,
            op=cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
            what=f"more than {rate_limit:.1%} of requests answered 5xx in 3 of 5 min (minutes with fewer than "
            f"{min_requests(rate_limit)} requests count as 0; old and new instances together during an update)",
        )
        # A fleet that scales to zero publishes nothing while at zero, which is no fault: there the alarm
        # catches only replicas that publish too few samples, and a dead agent shows as the load balancer's
        # failed health checks and 5xx instead.
        at_zero = scaling.min_replicas == 0
        self.signals_missing = self._alarm(
            "SignalsMissing",
            signal_metric(deployment_id, contract.REPLICA_SATURATION, statistic="SampleCount"),
            threshold=1,
            periods=5,
            op=cw.ComparisonOperator.LESS_THAN_THRESHOLD,
            missing=cw.TreatMissingData.NOT_BREACHING if at_zero else cw.TreatMissingData.BREACHING,
            what="no saturation signal for 5 min: autoscaling is blind (agent down or metrics not delivered)"
            + ("; not raised while the fleet is at zero (scaling.min_replicas 0)" if at_zero else ""),
        )

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
            using_metrics={"n": signal_metric(deployment_id, contract.REPLICA_SATURATION, statistic="SampleCount")},
            label="replicas publishing",
            period=PERIOD,
        )
        errors: list[cw.IMetric] = [m.server_errors]
        errors += [x for x in (platform.errors_4xx, platform.errors_5xx) if x is not None]
        rate = server_error_rate(deployment_id, threshold=error_rate_threshold(scaling), label="5xx share (agent)")

        self.dashboard = cw.Dashboard(self, "Dashboard", default_interval=Duration.hours(3))
        self.dashboard.add_widgets(
            cw.TextWidget(
                markdown=f"## kvfleet {deployment_id}\nScales on replica saturation, the larger of KV-cache use "
                f"and running sequences over max_num_seqs (target {scaling.saturation_target:.0%}), and requests "
                f"waiting per replica (target {scaling.queue_depth_target:g}); "
                f"{scaling.min_replicas}-{scaling.max_replicas} replicas.",
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
                "Replica saturation (KV cache or sequence slots)",
                [m.saturation, m.saturation_max, m.cache],
                hline=scaling.saturation_target,
                left=cw.YAxisProps(min=0, max=1),
            ),
            _graph("Requests waiting per replica", [m.waiting, m.waiting_max], hline=scaling.queue_depth_target),
            _graph("Requests running per replica", [m.running]),
        )
        self.dashboard.add_widgets(
            _graph("Preemptions, shed and cancelled requests", [m.preemptions, m.shed, m.cancelled]),
            _graph("Errors", errors, right=[rate]),
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
        self.saturation = signal_metric(d, s.REPLICA_SATURATION, label="saturation (average)")
        self.saturation_max = signal_metric(
            d, s.REPLICA_SATURATION, statistic="Maximum", label="most saturated replica"
        )
        # Still published, and charted beside saturation: where it stays well under it, sequence slots bind.
        self.cache = signal_metric(d, s.KV_CACHE_UTILIZATION, label="KV-cache use (average)")
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
        self.cancelled = signal_metric(d, s.CLIENT_CANCELLED, label="cancelled by the client")


def error_rate_threshold(scaling: ScalingPolicy) -> float:
    """The 5xx share the rate alarm fires above (see ERROR_RATE_CEILING)."""
    return min(ERROR_RATE_CEILING, 1 / (2 * scaling.max_replicas))


def min_requests(threshold: float) -> int:
    """Requests a minute below which the rate reads 0 (see ERROR_RATE_MIN_ERRORS)."""
    return math.ceil(ERROR_RATE_MIN_ERRORS / threshold)


def server_error_rate(deployment_id: str, *, threshold: float, label: str | None = None) -> cw.MathExpression:
    """The share of the deployment's requests answered 5xx, per minute; 0 below ``min_requests(threshold)``.

    The agent publishes no request count; the requests it answered are those answered 5xx (ServerErrors) and those
    that reached their first token (TimeToFirstToken's SampleCount: the engine observes it once per request). A 429
    from admission and a request cancelled before its first token are neither: they are not the release's doing.
    Both FILLed with 0: a minute without a 5xx publishes no ServerErrors.
    """
    errors = signal_metric(deployment_id, contract.SERVER_ERRORS)
    started = signal_metric(deployment_id, contract.TIME_TO_FIRST_TOKEN, statistic="SampleCount")
    answered = "(FILL(e, 0) + FILL(t, 0))"
    return cw.MathExpression(
        expression=f"IF({answered} >= {min_requests(threshold)}, FILL(e, 0) / {answered}, 0)",
        using_metrics={"e": errors, "t": started},
        label=label or "share of requests answered 5xx",
        period=PERIOD,
    )


def _graph(
    title: str,
    metrics: list[cw.IMetric],
    *,
    hline: float | None = None,
    left: cw.YAxisProps | None = None,
    right: list[cw.IMetric] | None = None,
) -> cw.GraphWidget:
    return cw.GraphWidget(
        title=title,
        left=metrics,
        right=right,
        width=8,
        height=6,
        left_y_axis=left,
        left_annotations=[cw.HorizontalAnnotation(value=hline, label="scaling target")] if hline is not None else None,
    )
