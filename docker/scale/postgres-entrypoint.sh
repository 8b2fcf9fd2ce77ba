#!/bin/sh
# Debian's PostgreSQL as the official image starts it: a cluster in $PGDATA made on the first
# start for POSTGRES_USER (password POSTGRES_PASSWORD) and its database POSTGRES_DB, reached
# from other containers with a password; then the server in the foreground.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | tail -1)
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  "$bin/initdb" -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --encoding=UTF8 --locale=C --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "host all all 0.0.0.0/0 scram-sha-256" >>"$PGDATA/pg_hba.conf"
  echo "host all all ::/0 scram-sha-256" >>"$PGDATA/pg_hba.conf"
  "$bin/pg_ctl" -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  "$bin/createdb" -U "$POSTGRES_USER" "$POSTGRES_DB"
  "$bin/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec "$bin/postgres" -D "$PGDATA" -c listen_addresses='*'
