#!/bin/bash
# User data of a kvfleet EC2 GPU instance. At first boot (cloud-init runs user data then only): put the weights and
# the serving image on disk, create the serving container, and install this script with a systemd unit that runs
# its `lifecycle` step at every boot. That step completes the launch hook in each transition the group pauses the
# instance in (into the warm pool, out of it, straight into service) and starts the container only in service.
#
# A template: kvfleet/infra/ec2/user_data.py fills in the double-brace placeholders of the settings below (each
# one shell word, quoted) and the env file's body, and nothing else. What differs between fleets is in those
# variables; the rest of the script is the same for every fleet.
set -euo pipefail

# ---- rendered settings -------------------------------------------------------------------------------------
# The serving image (its entrypoint is the kvfleet agent) and its command: the SageMaker-style `<image> serve`.
IMAGE={{IMAGE}}
SERVE_ARG={{SERVE_ARG}}
# The container's stdout goes here; its EMF lines become the scaling signals.
LOG_GROUP={{LOG_GROUP}}
# The weights on the host. LOCAL_NVME=1: on the instance store (RAID0 over its disks), else on the root volume.
HOST_MODEL_DIR={{HOST_MODEL_DIR}}
LOCAL_NVME={{LOCAL_NVME}}
# Empty: no copy from S3, the engine downloads from Hugging Face into its cache instead.
MODEL_S3_URI={{MODEL_S3_URI}}
# Inside the container: where weights copied from S3 are read, and where Hugging Face downloads are cached.
CONTAINER_MODEL_DIR={{CONTAINER_MODEL_DIR}}
CONTAINER_HF_HOME={{CONTAINER_HF_HOME}}
# The image's non-root user, who writes the Hugging Face cache.
AGENT_UID={{AGENT_UID}}
SERVING_PORT={{SERVING_PORT}}
# The engines on this instance, each with GPUS_PER_ENGINE GPUs of its own. Engine N (from 0) is the container
# kvfleet (0) or kvfleet-N, its unit UNIT_FILE or UNIT_FILE with -N before .service, its host port SERVING_PORT + N
# (the port of its own target group) and GPUs N*GPUS_PER_ENGINE onwards. One engine takes every GPU.
ENGINES={{ENGINES}}
GPUS_PER_ENGINE={{GPUS_PER_ENGINE}}
SHM_SIZE_GIB={{SHM_SIZE_GIB}}
DRAIN_BUDGET_S={{DRAIN_BUDGET_S}}
# The variables the agent reads its group's name (for the drain hook) and its region from.
ENV_ASG_NAME={{ENV_ASG_NAME}}
REGION_VARIABLE={{REGION_VARIABLE}}
# The launch hook a warm pool holds new instances with; empty: no warm pool, nothing to complete. And the
# termination hook: the agent drains for it in service, this script completes it for a running pool's instance.
WARM_HOOK={{WARM_HOOK}}
DRAIN_HOOK={{DRAIN_HOOK}}
# How often a held hook is heartbeaten.
HEARTBEAT_S={{HEARTBEAT_S}}
# Going into the warm pool, the engine starts once (to download weights from Hugging Face, and to compile): this long
# for its health route to answer. And how often the lifecycle step polls the instance metadata.
HEALTH_ROUTE={{HEALTH_ROUTE}}
WARM_READY_S={{WARM_READY_S}}
POLL_S={{POLL_S}}
# The container's environment and its systemd unit (started by the lifecycle step, in service only).
ENV_FILE={{ENV_FILE}}
UNIT_FILE={{UNIT_FILE}}
# The watchdog (in service only): it polls the agent's liveness route every WATCH_POLL_S (each poll given
# WATCH_TIMEOUT_S), and after WATCH_FAILURES failures in a row marks the instance unhealthy; after WATCH_API_TRIES
# refused calls in a row it powers the instance off instead, which the group's EC2 health check replaces.
LIVENESS_ROUTE={{LIVENESS_ROUTE}}
WATCH_POLL_S={{WATCH_POLL_S}}
WATCH_TIMEOUT_S={{WATCH_TIMEOUT_S}}
WATCH_FAILURES={{WATCH_FAILURES}}
WATCH_API_TRIES={{WATCH_API_TRIES}}
WATCHDOG_UNIT_FILE={{WATCHDOG_UNIT_FILE}}
# With several engines the agents are not given the termination hook (only one may complete it, once all have
# drained): this unit's `drain` step stops every engine at once (each agent drains on SIGTERM) and completes it.
DRAIN_UNIT_FILE={{DRAIN_UNIT_FILE}}
# Where this script installs itself, and the unit that runs its lifecycle step at every boot.
BOOT_SCRIPT={{BOOT_SCRIPT}}
LIFECYCLE_UNIT_FILE={{LIFECYCLE_UNIT_FILE}}

# ---- the instance ------------------------------------------------------------------------------------------
imds_token() { curl -sf -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 21600" http://169.254.169.254/latest/api/token; }
imds() { curl -sf -H "X-aws-ec2-metadata-token: $TOKEN" "http://169.254.169.254/latest/$1"; }
TOKEN=$(imds_token)
REGION=$(imds meta-data/placement/region)
INSTANCE_ID=$(imds meta-data/instance-id)
# The group's name from the instance's own tags (metadata tags are on); the API as a fallback.
GROUP=$(imds meta-data/tags/instance/aws:autoscaling:groupName \
  || aws autoscaling describe-auto-scaling-instances --region "$REGION" --instance-ids "$INSTANCE_ID" \
    --query 'AutoScalingInstances[0].AutoScalingGroupName' --output text)

# Where the group is taking the instance (InService, Warmed:Stopped|Running|Hibernated, Terminated); outside a
# group there is no such metadata: in service.
target_state() { imds meta-data/autoscaling/target-lifecycle-state || echo InService; }

# Complete hook $1 for the wait the instance is in (target state $2). A reboot in service has no action pending:
# the call fails, and that is not an error of this boot.
complete_hook() {
  [ -n "$1" ] || return 0
  aws autoscaling complete-lifecycle-action --region "$REGION" --lifecycle-hook-name "$1" \
    --auto-scaling-group-name "$GROUP" --instance-id "$INSTANCE_ID" --lifecycle-action-result CONTINUE \
    || echo "kvfleet: no $1 action pending (target state $2)" >&2
}

# ---- the engines -------------------------------------------------------------------------------------------
# Engine $1's container, unit file, unit and host port; engine 0 keeps the names of a one-engine instance.
engine_name() { if [ "$1" = 0 ]; then echo kvfleet; else echo "kvfleet-$1"; fi; }
engine_unit_file() { if [ "$1" = 0 ]; then echo "$UNIT_FILE"; else echo "${UNIT_FILE%.service}-$1.service"; fi; }
engine_unit() { basename "$(engine_unit_file "$1")"; }
engine_port() { echo "$((SERVING_PORT + $1))"; }
# Its GPUs as docker's --gpus takes them: a device list is quoted, or the option's CSV parser splits it at the commas
# (Docker docs, "GPU access": --gpus '"device=1,2"').
engine_gpus() {
  if [ "$ENGINES" = 1 ]; then echo all; return 0; fi
  echo "\"device=$(seq -s, "$(($1 * GPUS_PER_ENGINE))" "$((($1 + 1) * GPUS_PER_ENGINE - 1))")\""
}
# systemctl $1 on every engine's unit, in order.
engines_systemctl() {
  local i
  for ((i = 0; i < ENGINES; i++)); do systemctl "$1" "$(engine_unit "$i")"; done
}

# ---- the instance store ------------------------------------------------------------------------------------
# Mounts the instance store (RAID0 over its disks) at HOST_MODEL_DIR. The AMI may have assembled and mounted it
# already (the DLAMI release notes list nvme_location /opt/dlami/nvme for the Base OSS NVIDIA Driver GPU AMIs),
# and an array or filesystem survives a reboot: those are reused; a device that is mounted, in an array or holds a
# filesystem is never formatted.
local_storage() {
  [ "$LOCAL_NVME" = 1 ] || return 0
  if mountpoint -q "$HOST_MODEL_DIR"; then return 0; fi
  local devs existing dev
  devs=$(lsblk -dpno NAME,MODEL | awk '/Instance Storage/ {print $1}')
  [ -n "$devs" ] || return 0
  mapfile -t DEV_LIST <<<"$devs"
  # A mountpoint of the disks or of an array over them (lsblk lists an array under each of its members).
  existing=$(lsblk -nro MOUNTPOINT "${DEV_LIST[@]}" | grep -m1 . || true)
  if [ -n "$existing" ]; then
    mkdir -p "$existing/kvfleet"
    mount --bind "$existing/kvfleet" "$HOST_MODEL_DIR"
    return 0
  fi
  dev=$(lsblk -nrpo NAME,TYPE "${DEV_LIST[@]}" | awk '$2 ~ /^raid/ {print $1; exit}' || true)
  if [ -z "$dev" ]; then
    if [ "${#DEV_LIST[@]}" -gt 1 ]; then
      mdadm --create /dev/md0 --run --level=0 --raid-devices="${#DEV_LIST[@]}" "${DEV_LIST[@]}"
      dev=/dev/md0
    else
      dev=${DEV_LIST[0]}
    fi
  fi
  if [ -z "$(blkid -o value -s TYPE "$dev" || true)" ]; then
    mkfs.xfs -f "$dev"
  fi
  mount "$dev" "$HOST_MODEL_DIR"
}

# Engine $1's container (weights mounted as $2) and its unit: started by the lifecycle step when the instance goes
# into service, not at boot. Docker waits the drain budget (and a margin for the agent to exit) before it kills the
# container; systemd waits longer than docker. As the agent user: the image's own user is root, for SageMaker, which
# cannot choose one. Engine 0 logs to the instance's stream, engine N to the instance's with -N.
create_engine() {
  local name stream=$INSTANCE_ID
  name=$(engine_name "$1")
  [ "$1" = 0 ] || stream="$INSTANCE_ID-$1"
  docker create --name "$name" --gpus "$(engine_gpus "$1")" --user "$AGENT_UID:$AGENT_UID" \
    --shm-size "${SHM_SIZE_GIB}g" -p "$(engine_port "$1"):$SERVING_PORT" \
    --stop-timeout "$((DRAIN_BUDGET_S + 30))" \
    --log-driver awslogs --log-opt awslogs-region="$REGION" --log-opt awslogs-group="$LOG_GROUP" \
    --log-opt awslogs-stream="$stream" \
    --env-file "$ENV_FILE" -v "$2" "$IMAGE" "$SERVE_ARG"
  cat > "$(engine_unit_file "$1")" <<KVFLEET_UNIT
[Unit]
Description=kvfleet serving container
After=docker.service
Requires=docker.service
[Service]
ExecStart=/usr/bin/docker start -a $name
ExecStop=/usr/bin/docker stop $name
TimeoutStopSec=$((DRAIN_BUDGET_S + 60))
Restart=always
RestartSec=5
KVFLEET_UNIT
}

# ---- first boot: everything on disk ------------------------------------------------------------------------
prepare() {
  mkdir -p "$HOST_MODEL_DIR" "$(dirname "$ENV_FILE")" "$(dirname "$BOOT_SCRIPT")"
  local_storage
  chown "$AGENT_UID:$AGENT_UID" "$HOST_MODEL_DIR"
  local mount
  if [ -n "$MODEL_S3_URI" ]; then
    # The weights are copied before the container starts, and it reads them where SageMaker would put them.
    aws s3 sync --only-show-errors "$MODEL_S3_URI" "$HOST_MODEL_DIR"
    mount="$HOST_MODEL_DIR:$CONTAINER_MODEL_DIR:ro"
  else
    # The engine downloads at start-up into a cache on the host: a restarted container does not download again.
    mount="$HOST_MODEL_DIR:$CONTAINER_HF_HOME"
  fi

  cat > "$ENV_FILE" <<'KVFLEET_ENV'
{{CONTAINER_ENV}}
KVFLEET_ENV
  # Known only on the instance.
  printf '%s=%s\n' "$ENV_ASG_NAME" "$GROUP" "$REGION_VARIABLE" "$REGION" >> "$ENV_FILE"

  aws ecr get-login-password --region "$REGION" | docker login --username AWS --password-stdin "${IMAGE%%/*}"
  docker pull "$IMAGE"
  # Docker waits the drain budget (and a margin for the agent to exit) before it kills the container; systemd
  # waits longer than docker.
  # As the agent user: the image's own user is root, for SageMaker, which cannot choose one.
  local i
  for ((i = 0; i < ENGINES; i++)); do create_engine "$i" "$mount"; done
  # Started beside the container in service, and not bound to it: systemd restarts the units PartOf a unit with
  # each of its automatic restarts (systemd.unit(5), PartOf=; service.c, service_enter_restart), which would reset
  # the count of a container that keeps exiting. The watchdog acts only while the instance is InService.
  cat > "$WATCHDOG_UNIT_FILE" <<KVFLEET_UNIT
[Unit]
Description=kvfleet watchdog: replace this instance when its replica has failed
After=kvfleet.service
[Service]
ExecStart=$BOOT_SCRIPT watchdog
Restart=always
RestartSec=$WATCH_POLL_S
KVFLEET_UNIT
  if [ "$ENGINES" -gt 1 ]; then
    cat > "$DRAIN_UNIT_FILE" <<KVFLEET_UNIT
[Unit]
Description=kvfleet drain: drain every engine for the termination hook, then complete it once
After=kvfleet.service
[Service]
ExecStart=$BOOT_SCRIPT drain
Restart=on-failure
RestartSec=10
KVFLEET_UNIT
  fi
  # cloud-init runs user data at first boot only; this unit runs the lifecycle step at every boot.
  install -m 0755 "$0" "$BOOT_SCRIPT"
  cat > "$LIFECYCLE_UNIT_FILE" <<KVFLEET_UNIT
[Unit]
Description=kvfleet lifecycle: complete the launch hook, serve when in service
Wants=network-online.target
After=network-online.target docker.service
Requires=docker.service
[Service]
Type=simple
ExecStart=$BOOT_SCRIPT lifecycle
Restart=on-failure
RestartSec=10
[Install]
WantedBy=multi-user.target
KVFLEET_UNIT
}

# Going into the warm pool the engine starts once and stops, so that the instance leaves the pool warm:
# - weights from Hugging Face are downloaded (with the token it is given) into the host cache;
# - vLLM compiles its graphs into its compile cache: VLLM_CACHE_ROOT, by default $XDG_CACHE_HOME/vllm with the
#   Inductor and Triton caches under it (vllm/envs.py, vllm/compilation/compiler_interface.py at 0.34.0). The image
#   sets XDG_CACHE_HOME inside the container, outside the Hugging Face mount, so the cache is in the container's
#   own layer, which `docker start` keeps across stops and restarts. A first boot without that cache charges the compiler's temporaries to the memory
#   profile and leaves a smaller KV cache than planned (1.18 against 0.19 GiB of activation peak on a public
#   vLLM 0.27.1 log, kvfleet/sizing/capacity.py), and spends the compile time at scale-out.
warm_cache() {
  engines_systemctl start
  local i deadline=$((SECONDS + WARM_READY_S))
  for ((i = 0; i < ENGINES; i++)); do
    until curl -sf -o /dev/null "http://127.0.0.1:$(engine_port "$i")$HEALTH_ROUTE"; do
      if [ "$SECONDS" -ge "$deadline" ]; then
        echo "kvfleet: engine $i did not answer within ${WARM_READY_S}s" >&2
        engines_systemctl stop
        return 1
      fi
      sleep "$POLL_S"
    done
  done
  engines_systemctl stop
}

# A lifecycle hook waits two hours at most, and a big checkpoint may take longer to put on disk: while the first
# boot works, it heartbeats the launch hook, for the padded start-up estimate at most (a boot that hangs is then
# abandoned at the hook's timeout).
hold_launch_hook() {
  [ -n "$WARM_HOOK" ] || return 0
  heartbeat_hook "$WARM_HOOK" "$WARM_READY_S"
}

# Heartbeats hook $1 every HEARTBEAT_S for $2 seconds at most.
heartbeat_hook() {
  local deadline=$((SECONDS + $2))
  while [ "$SECONDS" -lt "$deadline" ] && sleep "$HEARTBEAT_S"; do
    aws autoscaling record-lifecycle-action-heartbeat --region "$REGION" --lifecycle-hook-name "$1" \
      --auto-scaling-group-name "$GROUP" --instance-id "$INSTANCE_ID" || true
  done
}

first_boot() {
  hold_launch_hook &
  HOLDER=$!
  trap 'kill "$HOLDER" 2>/dev/null || true' EXIT
  prepare
  case "$(target_state)" in
    Warmed:*) warm_cache ;;
  esac
  systemctl daemon-reload
  systemctl enable "$(basename "$LIFECYCLE_UNIT_FILE")"
  # Not waited for: in a running or hibernated pool it keeps watching, and cloud-init must finish.
  systemctl start --no-block "$(basename "$LIFECYCLE_UNIT_FILE")"
}

# ---- every boot: the lifecycle step ------------------------------------------------------------------------
# Completes the launch hook once per target state. Out of a stopped pool the instance boots again (this runs
# again); a running or hibernated pool's instance leaves without booting, so this keeps watching it.
lifecycle() {
  local state done_for=""
  local_storage
  while :; do
    TOKEN=$(imds_token)  # a pool may keep the instance longer than a token lives
    state=$(target_state)
    if [ "$state" != "$done_for" ]; then
      case "$state" in
        Warmed:Terminated) complete_hook "$DRAIN_HOOK" "$state" ;;  # out of the pool: nothing to drain
        Warmed:*) complete_hook "$WARM_HOOK" "$state" ;;  # ready on disk, not loaded on the GPU
        InService)  # a failed start ends the step: systemd runs it again
          engines_systemctl start
          systemctl start "$(basename "$WATCHDOG_UNIT_FILE")"
          if [ "$ENGINES" -gt 1 ]; then systemctl start "$(basename "$DRAIN_UNIT_FILE")"; fi
          complete_hook "$WARM_HOOK" "$state"
          ;;
        *) ;;  # Terminated: the agent (several: the drain step) drains for the termination hook and completes it
      esac
      done_for=$state
    fi
    case "$state" in
      Warmed:Running | Warmed:Hibernated) sleep "$POLL_S" ;;
      *) return 0 ;;
    esac
  done
}

# ---- in service: the watchdog ------------------------------------------------------------------------------
# The group's health check is EC2's, not the load balancer's: an engine restart takes the instance out of the load
# balancer's rotation (the health route answers 503) without replacing it. This replaces it when the replica has
# failed: the liveness route answers 503 once the engine has been down past its restart budget, and a refused
# connection or a timeout (no agent, no container) fails the same way. Only an instance in service is marked: a
# draining or pooled one is the group's own to end. Marking respects the grace period, so a first start that is
# still within it is left alone; the call is repeated each poll until the group acts. When the API cannot be reached
# (no route to it, the role refused), the instance powers off: a stopped instance fails the group's EC2 health check.
# With several engines each has its own count, and one failed engine replaces the instance (its GPUs would idle).
watchdog() {
  local refused=0 i failed
  local -a failures=()
  for ((i = 0; i < ENGINES; i++)); do failures[i]=0; done
  while :; do
    failed=""  # the first engine whose liveness route has failed WATCH_FAILURES times in a row
    for ((i = 0; i < ENGINES; i++)); do
      if curl -sf -o /dev/null -m "$WATCH_TIMEOUT_S" "http://127.0.0.1:$(engine_port "$i")$LIVENESS_ROUTE"; then
        failures[i]=0
      else
        failures[i]=$((failures[i] + 1))
      fi
      if [ -z "$failed" ] && [ "${failures[i]}" -ge "$WATCH_FAILURES" ]; then failed=$i; fi
    done
    if [ -z "$failed" ]; then
      refused=0
    else
      TOKEN=$(imds_token || true)
      if [ "$(target_state)" = InService ]; then
        echo "kvfleet: engine $failed's $LIVENESS_ROUTE failed ${failures[failed]} times in a row:" \
          "marking $INSTANCE_ID unhealthy" >&2
        if aws autoscaling set-instance-health --region "$REGION" --instance-id "$INSTANCE_ID" \
          --health-status Unhealthy --should-respect-grace-period; then
          refused=0
        else
          refused=$((refused + 1))
        fi
        if [ "$refused" -ge "$WATCH_API_TRIES" ]; then
          echo "kvfleet: set-instance-health failed $refused times: powering off for the group to replace" >&2
          systemctl poweroff
          return 0
        fi
      fi
    fi
    sleep "$WATCH_POLL_S"
  done
}

# ---- several engines: one drain for the termination hook ---------------------------------------------------
# Each agent drains when its container is stopped (SIGTERM: admission closes, in-flight requests finish within the
# drain budget). Once the group is terminating the instance, every engine is stopped at once, the hook heartbeaten
# meanwhile, and completed once, after the last engine has exited: the instance never ends under a draining engine.
drain() {
  local i holder
  local -a stops=()
  until [ "$(target_state)" = Terminated ]; do
    sleep "$POLL_S"
    TOKEN=$(imds_token || true)  # in service longer than a token lives
  done
  heartbeat_hook "$DRAIN_HOOK" "$((DRAIN_BUDGET_S + 60))" &
  holder=$!
  for ((i = 0; i < ENGINES; i++)); do
    systemctl stop "$(engine_unit "$i")" &
    stops+=("$!")
  done
  for i in "${stops[@]}"; do wait "$i" || echo "kvfleet: an engine's stop failed; completing the hook anyway" >&2; done
  kill "$holder" 2>/dev/null || true
  complete_hook "$DRAIN_HOOK" Terminated
}

case "${1:-}" in
  lifecycle) lifecycle ;;
  watchdog) watchdog ;;
  drain) drain ;;
  *) first_boot ;;
esac
