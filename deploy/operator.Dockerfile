# The operator image: ghcr.io/npufleet/npufleet-operator:<version>.
#   docker buildx build --platform linux/amd64,linux/arm64 -f deploy/operator.Dockerfile \
#     -t ghcr.io/npufleet/npufleet-operator:0.1.0 .
# Each platform builds natively (under emulation when it is not the host's), so the Kunpeng
# (arm64) image links against the same glibc as the runtime stage.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p npufleet-operator \
    && install -D target/release/npufleet-operator /out/npufleet-operator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/npufleet-operator /usr/local/bin/npufleet-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/npufleet-operator"]
