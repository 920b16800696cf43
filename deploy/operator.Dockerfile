# The operator image: ghcr.io/npufleet/npufleet-operator:<version>.
#   docker buildx build --platform linux/amd64,linux/arm64 -f deploy/operator.Dockerfile \
#     -t ghcr.io/npufleet/npufleet-operator:0.1.0 .
# Each platform builds natively (under emulation when it is not the host's), so the Kunpeng
# (arm64) image links against the same glibc as the runtime stage.
# To package a binary built outside (same glibc as the runtime base: Debian 12), skip the
# build stage:
#   cargo build --release -p npufleet-operator
#   docker buildx build --build-arg BINARIES=prebuilt -f deploy/operator.Dockerfile \
#     -t ghcr.io/npufleet/npufleet-operator:0.1.0 .
# The bases are arguments so that a site without access to these registries can name copies
# of its own (tests/setup/images.sh builds a runtime base from Debian packages).
ARG RUST_IMAGE=rust:1.95-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot
# `build` compiles the binary here; `prebuilt` takes it from BINARIES_DIR in the build context.
ARG BINARIES=build

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p npufleet-operator \
    && install -D target/release/npufleet-operator /out/npufleet-operator

FROM scratch AS prebuilt
ARG BINARIES_DIR=target/release
COPY ${BINARIES_DIR}/npufleet-operator /out/npufleet-operator

FROM ${BINARIES} AS binaries

FROM ${RUNTIME_IMAGE}
COPY --from=binaries /out/npufleet-operator /usr/local/bin/npufleet-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/npufleet-operator"]
