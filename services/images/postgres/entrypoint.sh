#!/bin/sh
# The official postgres image's start-up, cut to what this project uses: on an empty data directory,
# initdb with POSTGRES_USER as the superuser (password POSTGRES_PASSWORD, required), create
# POSTGRES_DB (default: the user's name) and accept password logins from any address; then run the
# command, `postgres` with any `-c name=value` options. The password is never printed.
set -eu

if [ "${1#-}" != "$1" ]; then
    set -- postgres "$@"
fi

if [ "$1" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ -z "${POSTGRES_PASSWORD:-}" ]; then
        echo "docker-entrypoint: POSTGRES_PASSWORD must be set (as for the official postgres image)" >&2
        exit 1
    fi
    user="${POSTGRES_USER:-postgres}"
    database="${POSTGRES_DB:-$user}"
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
        -E UTF8 --locale=C.UTF-8 > /dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    if [ "$database" != postgres ]; then
        quoted="$(printf '%s' "$database" | sed 's/"/""/g')"
        # Single-user mode: no server to start and stop; it exits 0 even when the statement fails.
        output="$(echo "CREATE DATABASE \"$quoted\"" | postgres --single -D "$PGDATA" postgres 2>&1)"
        case "$output" in
            *ERROR:*) printf '%s\n' "$output" >&2; exit 1 ;;
        esac
    fi
    echo "docker-entrypoint: initialised $PGDATA (superuser $user, database $database)"
fi

exec "$@"
