#!/usr/bin/env bash
# The secure broker of docker-compose.secure.yml (docs/kafka.md, "Secure mode"): the same settings
# as `weir kafka up --secure` (weir/kafka/launcher.py), for the apache/kafka image. It reads the
# passwords `weir kafka secrets` made on the shared volume, writes a private server.properties,
# formats the storage once with the principals' SCRAM credentials (--add-scram, from a private
# @argfile), and runs the broker. Every path and address can be overridden (a local run:
# KAFKA_LIBS=$WEIR_HOME/kafka/4.4.0/lib). One node of a cluster (docker-compose.yml's kafka-1..3)
# takes KAFKA_NODE_ID and KAFKA_CONTROLLER_QUORUM_VOTERS (the names the base file sets) and its own
# advertised addresses; every node is formatted with the same CLUSTER_ID and the same credentials.
set -euo pipefail
umask 077

SECRETS=${WEIR_KAFKA_SECRETS:-/var/lib/weir/secrets/kafka}
DATA=${KAFKA_DATA_DIR:-/var/lib/kafka/data}
LIBS=${KAFKA_LIBS:-/opt/kafka/libs}
CONF=${KAFKA_CONF_DIR:-/tmp/weir-kafka}
INTERNAL=${KAFKA_INTERNAL_LISTENER:-:9092}        # SASL_PLAINTEXT, services on the compose network
INTERNAL_ADV=${KAFKA_INTERNAL_ADVERTISED:-kafka:9092}
EXTERNAL=${KAFKA_EXTERNAL_LISTENER:-:29092}       # SASL_PLAINTEXT, clients on the host
EXTERNAL_ADV=${KAFKA_EXTERNAL_ADVERTISED:-localhost:29092}
CONTROLLER=${KAFKA_CONTROLLER_LISTENER:-:9093}
NODE_ID=${KAFKA_NODE_ID:-1}
VOTERS=${KAFKA_CONTROLLER_QUORUM_VOTERS:-1@kafka:9093}   # <id>@<host>:<controller port>, comma-separated
: "${CLUSTER_ID:?CLUSTER_ID must be set (a Kafka Uuid)}"
[[ ,$VOTERS, == *,$NODE_ID@* ]] || { echo "node $NODE_ID is not among the voters $VOTERS" >&2; exit 2; }

# Replication as the launcher's render_server_properties (docs/design.md, "Scale-out and
# failover"): min(3, nodes) replicas, 2 of them in sync where there are 2 or more.
IFS=, read -ra voter_list <<<"$VOTERS"
replicas=$(( ${#voter_list[@]} < 3 ? ${#voter_list[@]} : 3 ))
insync=$(( replicas < 2 ? replicas : 2 ))

password() { tr -d '\n' <"$SECRETS/$1.password"; }
for user in admin controller gateway batcher worker auditor client; do
  [[ -r $SECRETS/$user.password ]] || { echo "no $SECRETS/$user.password: run \`weir kafka secrets\` first" >&2; exit 2; }
done
admin=$(password admin)
controller=$(password controller)
scram=org.apache.kafka.common.security.scram.ScramLoginModule
plain=org.apache.kafka.common.security.plain.PlainLoginModule

mkdir -p "$CONF" "$DATA"
cat >"$CONF/server.properties" <<EOF
process.roles=broker,controller
node.id=$NODE_ID
controller.quorum.voters=$VOTERS
listeners=SASL_PLAINTEXT://$INTERNAL,EXTERNAL://$EXTERNAL,CONTROLLER://$CONTROLLER
advertised.listeners=SASL_PLAINTEXT://$INTERNAL_ADV,EXTERNAL://$EXTERNAL_ADV
listener.security.protocol.map=CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,EXTERNAL:SASL_PLAINTEXT
inter.broker.listener.name=SASL_PLAINTEXT
controller.listener.names=CONTROLLER
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config=$scram required username="admin" password="$admin";
listener.name.external.scram-sha-512.sasl.jaas.config=$scram required;
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config=$plain required username="controller" password="$controller" user_controller="$controller";
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin;User:controller
log.dirs=$DATA
auto.create.topics.enable=true
num.partitions=1
default.replication.factor=$replicas
min.insync.replicas=$insync
offsets.topic.replication.factor=$replicas
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=$replicas
transaction.state.log.min.isr=$insync
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=$replicas
share.coordinator.state.topic.min.isr=$insync
group.initial.rebalance.delay.ms=0
# Workers use a 2 s group session (fast failover, docs/worker.md "Failover"); Kafka's minimum is 6 s.
group.min.session.timeout.ms=1000
EOF
if (( ${#voter_list[@]} > 1 )); then
  # A dead node is fenced, and its partitions led elsewhere, after 3 s (Kafka's default: 9 s).
  printf '%s\n' broker.heartbeat.interval.ms=500 broker.session.timeout.ms=3000 >>"$CONF/server.properties"
fi
# For the healthcheck (kafka-broker-api-versions.sh --command-config) and an operator's tools.
cat >"$CONF/admin.properties" <<EOF
security.protocol=SASL_PLAINTEXT
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=$scram required username="admin" password="$admin";
EOF

if [[ ! -f $DATA/meta.properties ]]; then
  args="$CONF/format.args"
  {
    printf '%s\n' kafka.tools.StorageTool format -t "$CLUSTER_ID" -c "$CONF/server.properties"
    for user in admin gateway batcher worker auditor client; do
      printf '%s\n' --add-scram "SCRAM-SHA-512=[name=$user,password=$(password "$user")]"
    done
  } >"$args"
  java -Xmx256m -cp "$LIBS/*" "@$args" >/dev/null  # its report lists the credentials' stored keys
  rm -f "$args"
fi
exec java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx768m} -cp "$LIBS/*" kafka.Kafka "$CONF/server.properties"
