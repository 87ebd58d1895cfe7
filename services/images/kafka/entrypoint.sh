#!/bin/bash
# Writes server.properties and starts the node, as the apache/kafka image does: a single-node default
# (broker and controller on localhost:9092/9093), then one property per KAFKA_* variable, named the
# apache/kafka way (KAFKA_LOG_DIRS -> log.dirs; `__` -> `_`, `___` -> `-`). Later lines win, so a
# variable overrides the default. JVM options come from KAFKA_HEAP_OPTS and KAFKA_OPTS, not from here.
set -euo pipefail

config=/opt/kafka/config/server.properties
cat > "$config" <<DEFAULTS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@localhost:9093
listeners=PLAINTEXT://:9092,CONTROLLER://:9093
advertised.listeners=PLAINTEXT://localhost:9092
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=/var/lib/kafka/data
num.partitions=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# Share groups (outbox.queue's share backend): as bin/services sets them.
group.share.delivery.count.limit=10
group.share.min.record.lock.duration.ms=1000
group.share.min.session.timeout.ms=1000
group.share.min.heartbeat.interval.ms=250
DEFAULTS

for variable in $(compgen -e | sort); do
    case "$variable" in
        KAFKA_HEAP_OPTS | KAFKA_OPTS | KAFKA_JVM_PERFORMANCE_OPTS | KAFKA_LOG4J_OPTS | KAFKA_JMX_OPTS \
            | KAFKA_GC_LOG_OPTS | KAFKA_DEBUG) ;;
        KAFKA_*)
            name="${variable#KAFKA_}"
            name="${name,,}"
            name="${name//___/-}"
            name="${name//__/$'\x01'}"
            name="${name//_/.}"
            name="${name//$'\x01'/_}"
            printf '%s=%s\n' "$name" "${!variable}" >> "$config"
            ;;
    esac
done

java=(java -cp "/opt/kafka/libs/*" -Dlog4j2.configurationFile=/opt/kafka/log4j2.properties)
log_dirs="$(sed -n 's/^log\.dirs=//p' "$config" | tail -n 1)"
if [ ! -e "${log_dirs%%,*}/meta.properties" ]; then
    "${java[@]}" kafka.tools.StorageTool format --ignore-formatted \
        -t "${CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}" -c "$config" > /dev/null
fi

# shellcheck disable=SC2086  # the option strings are word lists
exec "${java[@]:0:1}" ${KAFKA_HEAP_OPTS:--Xms1g -Xmx1g} -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -Djava.awt.headless=true ${KAFKA_OPTS:-} "${java[@]:1}" kafka.Kafka "$config"
