# The idemgate image: built with the locked dependencies, run as a non-root
# user on a minimal base holding only the binary and the CA roots.
# The steps are the README's build: `cargo build --release --locked`, with
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
# The proxy and the admin listener (health, readiness, metrics, admin API).
EXPOSE 8080 9090
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/idemgate"]
CMD ["serve", "--config", "/etc/idemgate/idemgate.toml"]
