# The images `make image` builds (internal/ociimage) for those who build with
# Docker. It cannot be built in this project's CI (no Docker daemon there): a
# test (internal/ociimage, TestDockerfile) reads it and holds its ENTRYPOINT,
# CMD, USER, EXPOSE, LABEL and files to the Go-built images' config. From the
# repository root:
#
#   docker build --target limiterd   -t ghcr.io/limiterd/limiterd:0.1.0 .
#   docker build --target reconciler -t ghcr.io/limiterd/reconciler:0.1.0 .
#
# Each image is a static binary at /usr/local/bin on an empty base, with the
# CA bundle at Debian's path, run as 65532:65532 (deploy/k8s runs it so).

ARG GO_VERSION=1.26.8

FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# TARGETARCH is set by BuildKit (docker build --platform); empty, Go builds
# for the machine's own architecture.
ARG TARGETARCH
RUN CGO_ENABLED=0 GOOS=linux GOARCH=${TARGETARCH} go build -trimpath -ldflags='-s -w' -o /out/limiterd ./cmd/limiterd && \
    CGO_ENABLED=0 GOOS=linux GOARCH=${TARGETARCH} go build -trimpath -ldflags='-s -w' -o /out/reconciler ./cmd/reconciler

FROM scratch AS limiterd
ARG VERSION=0.1.0
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/limiterd /usr/local/bin/limiterd
USER 65532:65532
EXPOSE 8081/tcp 9091/tcp
LABEL org.opencontainers.image.source="https://github.com/limiterd/limiterd" \
      org.opencontainers.image.title="limiterd" \
      org.opencontainers.image.version="${VERSION}"
ENTRYPOINT ["/usr/local/bin/limiterd"]
CMD ["--grpc.listen-address=:8081", "--http.listen-address=:9091"]

FROM scratch AS reconciler
ARG VERSION=0.1.0
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/reconciler /usr/local/bin/reconciler
USER 65532:65532
EXPOSE 9191/tcp
LABEL org.opencontainers.image.source="https://github.com/limiterd/limiterd" \
      org.opencontainers.image.title="reconciler" \
      org.opencontainers.image.version="${VERSION}"
ENTRYPOINT ["/usr/local/bin/reconciler"]
CMD ["--http.listen-address=:9191"]
