# The idemgate image: built with the locked dependencies, run as a non-root
# user on a minimal base holding only the binary and the CA roots.
# The steps are the release build (`cargo build --release --locked`), with
# the toolchain CI uses.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY migrations migrations
COPY config config
COPY examples examples
RUN cargo build --release --locked --bin idemgate

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
# scripts/oci-image.py builds this stage without a container engine and
# reads what follows from here: keep each instruction on one line.
LABEL org.opencontainers.image.title="idemgate" org.opencontainers.image.description="A reverse proxy that makes retries safe" org.opencontainers.image.source="https://github.com/idemgate/idemgate" org.opencontainers.image.licenses="Apache-2.0"
ENV SSL_CERT_FILE="/etc/ssl/certs/ca-certificates.crt"
# The proxy and the admin listener (health, readiness, metrics, admin API).
EXPOSE 8080 9090
# distroless' nonroot, by number: Kubernetes can check runAsNonRoot only
# against a numeric user.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/idemgate"]
CMD ["serve", "--config", "/etc/idemgate/idemgate.toml"]
