# The router image: ghcr.io/npufleet/npufleet-router:<version>.
#   docker buildx build --platform linux/amd64,linux/arm64 -f deploy/router.Dockerfile \
#     -t ghcr.io/npufleet/npufleet-router:0.1.0 .
# Each platform builds natively (under emulation when it is not the host's), so the Kunpeng
# (arm64) image links against the same glibc as the runtime stage.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p npufleet-router \
    && install -D target/release/npufleet-router /out/npufleet-router

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/npufleet-router /usr/local/bin/npufleet-router
USER 65532:65532
EXPOSE 8000 8001
ENTRYPOINT ["/usr/local/bin/npufleet-router"]
