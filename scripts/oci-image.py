#!/usr/bin/env python3
"""Writes idemgate's container image as an OCI image layout, without a daemon.

    scripts/oci-image.py --binary target/release/idemgate --out target/oci [--tag 0.1.0]

The image is the Dockerfile's final stage, made from this machine instead of
a registry's base: the binary, the shared libraries it loads (from `ldd`,
the dynamic loader included), the CA roots, a passwd file naming the
non-root user (65532, as distroless' `nonroot`) and a writable /tmp. Its
configuration (entrypoint, command, user, ports, labels) is read from the
Dockerfile's final stage, so the two cannot drift: the release workflow
builds and pushes the Dockerfile for amd64 and arm64; this script is how a
machine without a container engine (CI here) builds and checks the same
image. `skopeo copy oci:target/oci:0.1.0 docker://...` or `podman load`
take the result.

The layer is reproducible: sorted entries, owner root, mtime 0.
Standard library only.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import platform
import re
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
NONROOT = 65532


def final_stage(dockerfile):
    """ENTRYPOINT, CMD, USER, EXPOSE, ENV and LABEL of the last stage."""
    text = open(dockerfile, encoding="utf-8").read()
    # Continuation lines joined; comments dropped.
    text = re.sub(r"\\\n", " ", text)
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    last_from = max(i for i, l in enumerate(lines) if l.upper().startswith("FROM "))
    stage = {"Entrypoint": None, "Cmd": None, "User": None, "ExposedPorts": {}, "Labels": {}, "Env": []}
    for line in lines[last_from + 1:]:
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "ENTRYPOINT":
            stage["Entrypoint"] = json.loads(rest)
        elif word == "CMD":
            stage["Cmd"] = json.loads(rest)
        elif word == "USER":
            stage["User"] = rest
        elif word == "EXPOSE":
            for port in rest.split():
                stage["ExposedPorts"][port if "/" in port else port + "/tcp"] = {}
        elif word == "LABEL":
            for key, value in re.findall(r'([\w.\-]+)="([^"]*)"', rest):
                stage["Labels"][key] = value
        elif word == "ENV":
            for key, value in re.findall(r'([\w]+)="([^"]*)"', rest):
                stage["Env"].append(f"{key}={value}")
    return stage


def libraries(binary):
    """Every shared object `binary` loads, the dynamic loader included."""
    out = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
    paths = []
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            target = line.split("=>", 1)[1].strip().split(" ")[0]
        else:
            target = line.split(" ")[0]
        if target.startswith("/"):
            paths.append(target)
    return sorted(set(paths))


def add_file(tar, name, data, mode=0o644):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tar.addfile(info, io.BytesIO(data))


def add_dir(tar, name, mode=0o755, owner=0):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, 0
    info.uid = info.gid = owner
    tar.addfile(info)


def layer(binary):
    """The root filesystem as an uncompressed tar."""
    files = {"usr/local/bin/idemgate": (open(binary, "rb").read(), 0o755)}
    for lib in libraries(binary):
        files[lib.lstrip("/")] = (open(os.path.realpath(lib), "rb").read(), 0o755)
    files[CA_BUNDLE.lstrip("/")] = (open(CA_BUNDLE, "rb").read(), 0o644)
    files["etc/passwd"] = (f"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:{NONROOT}:{NONROOT}:nonroot:/home/nonroot:/sbin/nologin\n".encode(), 0o644)
    files["etc/group"] = (f"root:x:0:\nnonroot:x:{NONROOT}:\n".encode(), 0o644)
    dirs = {"tmp": (0o1777, 0), "home/nonroot": (0o700, NONROOT), "etc/idemgate": (0o755, 0)}
    for name in files:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.setdefault("/".join(parts[:i]), (0o755, 0))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(set(dirs) | set(files)):
            if name in files:
                data, mode = files[name]
                add_file(tar, name, data, mode)
            else:
                mode, owner = dirs[name]
                add_dir(tar, name, mode, owner)
    return buf.getvalue()


def blob(out, data):
    digest = hashlib.sha256(data).hexdigest()
    path = os.path.join(out, "blobs", "sha256")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, digest), "wb") as f:
        f.write(data)
    return "sha256:" + digest


def canonical(value):
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def version():
    text = open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8").read()
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)


def build(binary, out, tag):
    stage = final_stage(os.path.join(ROOT, "Dockerfile"))
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    tar = layer(binary)
    gz = gzip.compress(tar, mtime=0)
    layer_digest = blob(out, gz)
    labels = dict(stage["Labels"], **{"org.opencontainers.image.version": tag})
    config = {
        "architecture": arch,
        "os": "linux",
        "config": {
            "User": stage["User"],
            "Entrypoint": stage["Entrypoint"],
            "Cmd": stage["Cmd"],
            "ExposedPorts": stage["ExposedPorts"],
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] + stage["Env"],
            "WorkingDir": "/",
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]},
        "history": [{"created_by": "scripts/oci-image.py (the Dockerfile's final stage)"}],
    }
    config_bytes = canonical(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(out, config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_digest, "size": len(gz)}],
        "annotations": {"org.opencontainers.image.version": tag},
    }
    manifest_bytes = canonical(manifest)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": blob(out, manifest_bytes),
            "size": len(manifest_bytes),
            "platform": {"architecture": arch, "os": "linux"},
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }],
    }
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(canonical(index))
    with open(os.path.join(out, "oci-layout"), "w", encoding="utf-8") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", required=True, help="the idemgate binary to put in the image")
    parser.add_argument("--out", required=True, help="the OCI image layout directory to write")
    parser.add_argument("--tag", default=None, help="the image's tag (default: the crate's version)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    build(args.binary, args.out, args.tag or version())
    print(f"oci-image: wrote {args.out} ({args.tag or version()})")


if __name__ == "__main__":
    sys.exit(main())
