#!/usr/bin/env bash
# Start a throwaway PostgreSQL server on 127.0.0.1 for the shared-storage tests and export
# SERVETUNE_TEST_PG_URL. Source it (`source .ci/postgres.sh`) so the export reaches the
# caller; run as root on Debian/Ubuntu. Installs the `postgresql` package if missing.
# Idempotent: a server already answering on the port is reused.
#
#   SERVETUNE_PG_PORT  port (default 54329)
#   SERVETUNE_PG_DIR   data directory (default /tmp/servetune-pg)

_servetune_pg_setup() {
  local port="${SERVETUNE_PG_PORT:-54329}"
  local data="${SERVETUNE_PG_DIR:-/tmp/servetune-pg}"
  local db=servetune_test user=servetune password=servetune
  local bin

  if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    echo "postgres.sh: installing postgresql" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; } \
      || { echo "postgres.sh: apt-get install postgresql failed" >&2; return 1; }
  fi
  bin="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"

  if ! "$bin/pg_isready" -h 127.0.0.1 -p "$port" -q; then
    if [ ! -s "$data/PG_VERSION" ]; then
      mkdir -p "$data" && chown postgres:postgres "$data" && chmod 700 "$data" || return 1
      su postgres -c "'$bin/initdb' -D '$data' -A trust -U postgres" >/dev/null \
        || { echo "postgres.sh: initdb failed" >&2; return 1; }
    fi
    su postgres -c "'$bin/pg_ctl' -D '$data' -l '$data/server.log' -w -t 30 \
      -o \"-h 127.0.0.1 -p $port -k /tmp\" start" >/dev/null \
      || { echo "postgres.sh: server did not start; see $data/server.log" >&2; return 1; }
  fi

  local psql=("$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -v ON_ERROR_STOP=1 -qtA)
  if [ -z "$("${psql[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname = '$user'")" ]; then
    "${psql[@]}" -c "CREATE ROLE $user LOGIN PASSWORD '$password'" || return 1
  fi
  if [ -z "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = '$db'")" ]; then
    "${psql[@]}" -c "CREATE DATABASE $db OWNER $user" || return 1
  fi
  export SERVETUNE_TEST_PG_URL="postgresql+psycopg2://$user:$password@127.0.0.1:$port/$db"
  echo "postgres.sh: SERVETUNE_TEST_PG_URL=postgresql+psycopg2://$user:***@127.0.0.1:$port/$db" >&2
}

_servetune_pg_setup
