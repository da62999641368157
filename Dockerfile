# syntax=docker/dockerfile:1
# The twophase image: one image for the coordinator, the participants and the CLI.
#   docker build -t twophase:0.1.0 .
#   docker run --rm twophase:0.1.0 --help
# Pinned to an exact Python patch release and Debian release so a rebuild does not change the
# runtime under a running pipeline. Add the index digest (python:...@sha256:...) when releasing.
ARG PYTHON_IMAGE=python:3.11.16-slim-bookworm

# The optional compiled encoder (native/, Rust + PyO3) as an abi3 wheel, built on the same
# Debian release as the runtime so its glibc matches. The toolchain stays in this stage.
FROM ${PYTHON_IMAGE} AS native
ARG RUST_TOOLCHAIN=1.95.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RUSTUP_HOME=/opt/rustup \
    CARGO_HOME=/opt/cargo \
    PATH=/opt/cargo/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl gcc libc6-dev \
 && curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain "${RUST_TOOLCHAIN}" \
 && pip install maturin==1.16.0
WORKDIR /native
COPY native/Cargo.toml native/Cargo.lock native/pyproject.toml native/twophase_native.pyi ./
COPY native/src ./src
RUN maturin build --release --locked --out /wheels

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Every runtime dependency ships manylinux wheels for CPython 3.11 (confluent-kafka bundles
# librdkafka, psycopg[binary] bundles libpq), so no compiler is needed. No pyspark: it is the
# optional `spark` extra, used by Spark jobs, not by these processes.
RUN python -m venv /opt/twophase
COPY pyproject.toml README.md ./
COPY twophase ./twophase
COPY coordinator ./coordinator
COPY participants ./participants
COPY jobs ./jobs
COPY cli ./cli
COPY control-topic ./control-topic
# pip byte-compiles what it installs (the runtime root filesystem is read-only); `--help` fails
# the build if the console script or an import is broken.
COPY --from=native /wheels /wheels
RUN /opt/twophase/bin/pip install . /wheels/*.whl \
 && /opt/twophase/bin/python -c "import twophase_native" \
 && /opt/twophase/bin/twophase --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="twophase" \
      org.opencontainers.image.description="Exactly-once delivery from Kafka into PostgreSQL, MongoDB and files" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 twophase \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin twophase
COPY --from=build /opt/twophase /opt/twophase
# The root filesystem is read-only in Kubernetes: HOME and temporary files go to /tmp
# (an emptyDir in the chart).
ENV PATH=/opt/twophase/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TWOPHASE_LOG_FORMAT=json
USER 10001:10001
WORKDIR /tmp
# /metrics, /healthz, /readyz
EXPOSE 9400
ENTRYPOINT ["twophase"]
CMD ["--help"]
