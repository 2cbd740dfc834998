# paramserver image: parameter-server shards, digits workers, SPMD rank servers, tools.
#
#   docker build -t paramserver .                                  # slim official Python base
#   docker build --build-arg PYTHON_BASE=local/python-base:bookworm --network host -t paramserver .
#
# Stage 1 builds the package (the gRPC modules are generated from protos/ by the build hook)
# into a virtual environment; stage 2 copies only that environment onto a fresh base and runs
# as an unprivileged user. /data holds the named volumes (checkpoints, disk tiers, results).
ARG PYTHON_BASE=python:3.11-slim-bookworm

FROM ${PYTHON_BASE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/paramserver
WORKDIR /src
# Dependencies first (a layer cached across source edits), then the package itself.
COPY pyproject.toml setup.py README.md ./
RUN /opt/paramserver/bin/pip install --quiet --upgrade pip \
 && /opt/paramserver/bin/python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(d['dependencies'] + d['optional-dependencies']['demo']))" > /tmp/requirements.txt \
 && /opt/paramserver/bin/pip install --quiet -r /tmp/requirements.txt
COPY scripts/gen_protos.py scripts/gen_protos.py
COPY protos protos
COPY paramserver paramserver
RUN /opt/paramserver/bin/pip install --quiet --no-deps . \
 && /opt/paramserver/bin/paramserver --help > /dev/null

FROM ${PYTHON_BASE}
COPY --from=build /opt/paramserver /opt/paramserver
RUN groupadd --gid 10001 paramserver \
 && useradd --uid 10001 --gid 10001 --home-dir /data --no-create-home --shell /usr/sbin/nologin paramserver \
 && mkdir -p /data/checkpoints /data/tiers /data/results \
 && chown -R 10001:10001 /data
ENV PATH=/opt/paramserver/bin:$PATH PYTHONUNBUFFERED=1 PARAMSERVER_HOST=0.0.0.0
USER 10001:10001
WORKDIR /data
EXPOSE 50051 9100
ENTRYPOINT ["paramserver"]
CMD ["serve"]
