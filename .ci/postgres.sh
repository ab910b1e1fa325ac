# Sourced by .ci/run: a throwaway PostgreSQL for the tests that need a real server (tests/conftest.py).
# Installs Debian's server package if its binaries are missing, starts a cluster as an unprivileged
# user in a temporary folder (fsync on, 127.0.0.1 only, trust auth: nothing here outlives the run),
# exports FLYWHEEL_PG_URL, and stops and removes the cluster when the calling script exits.

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql
    else
        echo "PostgreSQL is missing and this user cannot install it: run \`apt-get install -y postgresql\` as root" >&2
        exit 1
    fi
fi
FLYWHEEL_PG_BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
FLYWHEEL_PG_DIR=$(mktemp -d /tmp/flywheel-ci-pg.XXXXXX)
FLYWHEEL_PG_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
FLYWHEEL_PG_AS=()
if [ "$(id -u)" -eq 0 ]; then  # initdb refuses to run as root: the package's `postgres` user runs it
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin postgres
    chown postgres "$FLYWHEEL_PG_DIR"
    FLYWHEEL_PG_AS=(runuser -u postgres --)
fi
"${FLYWHEEL_PG_AS[@]}" "$FLYWHEEL_PG_BIN/initdb" -D "$FLYWHEEL_PG_DIR/data" -U flywheel -A trust -E UTF8 --no-locale \
    >"$FLYWHEEL_PG_DIR/initdb.log"
"${FLYWHEEL_PG_AS[@]}" "$FLYWHEEL_PG_BIN/pg_ctl" -D "$FLYWHEEL_PG_DIR/data" -l "$FLYWHEEL_PG_DIR/server.log" -w \
    -o "-c listen_addresses=127.0.0.1 -c port=$FLYWHEEL_PG_PORT -c unix_socket_directories=$FLYWHEEL_PG_DIR -c fsync=on -c max_connections=200" \
    start >/dev/null
flywheel_pg_stop() {
    "${FLYWHEEL_PG_AS[@]}" "$FLYWHEEL_PG_BIN/pg_ctl" -D "$FLYWHEEL_PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
    rm -rf "$FLYWHEEL_PG_DIR"
}
trap flywheel_pg_stop EXIT
export FLYWHEEL_PG_URL="postgresql://flywheel@127.0.0.1:$FLYWHEEL_PG_PORT/postgres"
echo "PostgreSQL $("$FLYWHEEL_PG_BIN/postgres" --version | awk '{print $3}') for the tests at $FLYWHEEL_PG_URL"
