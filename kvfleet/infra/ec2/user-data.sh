#!/bin/bash
# User data of a kvfleet EC2 GPU instance: put the weights and the serving image on disk, create the serving
# container and its systemd unit, then start it (or, going into a warm pool, leave it stopped).
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
SHM_SIZE_GIB={{SHM_SIZE_GIB}}
DRAIN_BUDGET_S={{DRAIN_BUDGET_S}}
# The variable the agent reads its group's name from (for the drain hook).
ENV_ASG_NAME={{ENV_ASG_NAME}}
# The launch hook a warm pool holds new instances with; empty: no warm pool, nothing to complete.
WARM_HOOK={{WARM_HOOK}}
# The container's environment, and the systemd unit that starts the container at every boot.
ENV_FILE={{ENV_FILE}}
UNIT_FILE={{UNIT_FILE}}

# ---- the instance ------------------------------------------------------------------------------------------
imds() { curl -sf -H "X-aws-ec2-metadata-token: $TOKEN" "http://169.254.169.254/latest/$1"; }
TOKEN=$(curl -sf -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 21600" http://169.254.169.254/latest/api/token)
REGION=$(imds meta-data/placement/region)
INSTANCE_ID=$(imds meta-data/instance-id)
# The group's name from the instance's own tags (metadata tags are on); the API as a fallback.
GROUP=$(imds meta-data/tags/instance/aws:autoscaling:groupName \
  || aws autoscaling describe-auto-scaling-instances --region "$REGION" --instance-ids "$INSTANCE_ID" \
    --query 'AutoScalingInstances[0].AutoScalingGroupName' --output text)
mkdir -p "$HOST_MODEL_DIR" "$(dirname "$ENV_FILE")"

# ---- the weights -------------------------------------------------------------------------------------------
if [ "$LOCAL_NVME" = 1 ]; then
  # Local NVMe (instance store) holds the weights: faster than EBS, and free.
  DEVS=$(lsblk -dpno NAME,MODEL | awk '/Instance Storage/ {print $1}')
  if [ -n "$DEVS" ]; then
    mapfile -t DEV_LIST <<<"$DEVS"
    if [ "${#DEV_LIST[@]}" -gt 1 ]; then
      mdadm --create /dev/md0 --run --level=0 --raid-devices="${#DEV_LIST[@]}" "${DEV_LIST[@]}"
      DEV=/dev/md0
    else
      DEV=$DEVS
    fi
    mkfs.xfs -f "$DEV" && mount "$DEV" "$HOST_MODEL_DIR"
  fi
fi
chown "$AGENT_UID:$AGENT_UID" "$HOST_MODEL_DIR"
if [ -n "$MODEL_S3_URI" ]; then
  # The weights are copied before the container starts, and it reads them where SageMaker would put them.
  aws s3 sync --only-show-errors "$MODEL_S3_URI" "$HOST_MODEL_DIR"
  MOUNT="$HOST_MODEL_DIR:$CONTAINER_MODEL_DIR:ro"
else
  # The engine downloads at start-up into a cache on the host: a restarted container does not download again.
  MOUNT="$HOST_MODEL_DIR:$CONTAINER_HF_HOME"
fi

# ---- the serving container ---------------------------------------------------------------------------------
cat > "$ENV_FILE" <<'KVFLEET_ENV'
{{CONTAINER_ENV}}
KVFLEET_ENV
# Known only on the instance.
printf '%s=%s\n' "$ENV_ASG_NAME" "$GROUP" AWS_REGION "$REGION" >> "$ENV_FILE"

aws ecr get-login-password --region "$REGION" | docker login --username AWS --password-stdin "${IMAGE%%/*}"
docker pull "$IMAGE"
# A container, started by systemd at every boot: an instance that comes out of a stopped warm pool starts
# serving without re-running this script. Docker waits the drain budget (and a margin for the agent to exit)
# before it kills the container; systemd waits longer than docker.
docker create --name kvfleet --gpus all \
  --shm-size "${SHM_SIZE_GIB}g" -p "$SERVING_PORT:$SERVING_PORT" \
  --stop-timeout "$((DRAIN_BUDGET_S + 30))" \
  --log-driver awslogs --log-opt awslogs-region="$REGION" --log-opt awslogs-group="$LOG_GROUP" \
  --log-opt awslogs-stream="$INSTANCE_ID" \
  --env-file "$ENV_FILE" -v "$MOUNT" "$IMAGE" "$SERVE_ARG"
cat > "$UNIT_FILE" <<KVFLEET_UNIT
[Unit]
Description=kvfleet serving container
After=docker.service
Requires=docker.service
[Service]
ExecStart=/usr/bin/docker start -a kvfleet
ExecStop=/usr/bin/docker stop kvfleet
TimeoutStopSec=$((DRAIN_BUDGET_S + 60))
Restart=always
RestartSec=5
[Install]
WantedBy=multi-user.target
KVFLEET_UNIT
systemctl daemon-reload && systemctl enable kvfleet.service

# ---- in service, or into the warm pool -----------------------------------------------------------------------
STATE=$(imds meta-data/autoscaling/target-lifecycle-state || echo InService)
case "$STATE" in
  Warmed:*) ;;  # going into the warm pool: ready on disk, not loaded on the GPU
  *) systemctl start kvfleet.service ;;
esac
if [ -n "$WARM_HOOK" ]; then
  # The image and the weights are on disk: the group may now stop the instance into the pool (or use it).
  aws autoscaling complete-lifecycle-action --region "$REGION" --lifecycle-hook-name "$WARM_HOOK" \
    --auto-scaling-group-name "$GROUP" --instance-id "$INSTANCE_ID" --lifecycle-action-result CONTINUE
fi
